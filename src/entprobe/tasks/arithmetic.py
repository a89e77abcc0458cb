"""Built-in task: single-operation integer arithmetic ("3+4=", or a question such as "What is 3 + 4?")
with a verifiable reward on the answer."""
from __future__ import annotations

import random

from entprobe.tasks.base import Prompt
from entprobe.tasks.rewards import REWARDS


class ArithmeticTask:
    """``num_prompts`` prompts ``template.format(a=a, b=b)`` (default ``a+b=``) with
    0 <= a, b <= max_operand, reproducible from ``seed``; the reward is ``reward`` of the response
    against ``a + b``: ``numeric`` (the first number is the answer), ``last_number`` (the last one
    is: a chat model that writes "3 + 4 = 7") or ``boxed``."""

    def __init__(self, num_prompts: int = 512, max_operand: int = 9, seed: int = 0, template: str = "{a}+{b}=",
                 reward: str = "numeric"):
        if reward not in REWARDS:
            raise ValueError(f"task.reward={reward!r}; choose one of {sorted(REWARDS)}")
        if "{a}" not in template or "{b}" not in template:
            raise ValueError(f"task.template={template!r} must hold the operands as {{a}} and {{b}}, e.g. 'What is {{a}} + {{b}}?'")
        rng = random.Random(seed)
        self.prompts = [
            Prompt(text=template.format(a=a, b=b), answer=str(a + b))
            for a, b in ((rng.randint(0, max_operand), rng.randint(0, max_operand))
                         for _ in range(num_prompts))
        ]
        self._reward = REWARDS[reward]

    def reward(self, response: str, prompt: Prompt) -> float:
        return self._reward(response, prompt.answer)
