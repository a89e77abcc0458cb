"""A JSONL file of ``{"prompt": ..., "answer": ...}`` records with a numeric or boxed reward."""
from __future__ import annotations

import json
from pathlib import Path

from entprobe.tasks.base import Prompt
from entprobe.tasks.rewards import REWARDS


class JsonlTask:
    def __init__(self, path: str | None = None, reward: str = "numeric", num_prompts: int = 0):
        if not path:
            raise ValueError("task.path must point to a .jsonl file with 'prompt' and 'answer' fields")
        if reward not in REWARDS:
            raise ValueError(f"task.reward={reward!r}; choose one of {sorted(REWARDS)}")
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"task.path={path!r} does not exist")
        self.prompts = []
        for lineno, line in enumerate(p.read_text(encoding="utf-8").split("\n"), 1):  # not splitlines: U+2028 etc. are not line ends in JSONL
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({e.msg})") from None
            if not isinstance(rec, dict) or "prompt" not in rec or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: each record needs 'prompt' and 'answer'")
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            if isinstance(rec["answer"], bool) or not isinstance(rec["answer"], (str, int, float)) \
                    or not str(rec["answer"]).strip():
                raise ValueError(f"{path}:{lineno}: 'answer' is {rec['answer']!r}; it must be a number or a "
                                 "non-empty string (the reward compares responses with it)")
            self.prompts.append(Prompt(text=str(rec["prompt"]), answer=str(rec["answer"])))
        if num_prompts:
            self.prompts = self.prompts[:num_prompts]
        self._reward = REWARDS[reward]

    def reward(self, response: str, prompt: Prompt) -> float:
        return self._reward(response, prompt.answer)
