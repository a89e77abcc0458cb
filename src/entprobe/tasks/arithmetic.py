"""Built-in task: single-operation integer arithmetic ("3+4=") with an exact-match reward."""
from __future__ import annotations

import random

from entprobe.tasks.base import Prompt
from entprobe.tasks.rewards import numeric_reward


class ArithmeticTask:
    """``num_prompts`` prompts ``a+b=`` with 0 <= a, b <= max_operand, reproducible from ``seed``."""

    def __init__(self, num_prompts: int = 512, max_operand: int = 9, seed: int = 0):
        rng = random.Random(seed)
        self.prompts = [
            Prompt(text=f"{a}+{b}=", answer=str(a + b))
            for a, b in ((rng.randint(0, max_operand), rng.randint(0, max_operand))
                         for _ in range(num_prompts))
        ]

    def reward(self, response: str, prompt: Prompt) -> float:
        return numeric_reward(response, prompt.answer)
