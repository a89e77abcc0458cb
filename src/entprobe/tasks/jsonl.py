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
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "prompt" not in rec or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: each record needs 'prompt' and 'answer'")
            self.prompts.append(Prompt(text=str(rec["prompt"]), answer=str(rec["answer"])))
        if num_prompts:
            self.prompts = self.prompts[:num_prompts]
        self._reward = REWARDS[reward]

    def reward(self, response: str, prompt: Prompt) -> float:
        return self._reward(response, prompt.answer)
