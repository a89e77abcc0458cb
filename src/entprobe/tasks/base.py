"""The task protocol (the builder that instantiates ``task._target_``: build.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Prompt:
    text: str  # the user-facing prompt, before any chat template (a conversation: its messages' contents)
    answer: str  # the reference answer the reward compares against
    messages: tuple | None = None  # a conversational prompt: its {"role", "content"} messages, as the dataset holds them
    columns: dict | None = None  # the record's fields other than "prompt" (reward functions' keyword arguments)

    @property
    def source(self) -> str | list[dict]:
        """The prompt as a TRL / verl dataset holds it: the message list, else the text."""
        return [dict(m) for m in self.messages] if self.messages is not None else self.text

    @property
    def fields(self) -> dict:
        """The keyword columns a TRL reward function receives for this prompt (``columns``; a prompt
        without any, from a task class of its own: its ``answer``)."""
        return dict(self.columns) if self.columns is not None else {"answer": self.answer}


@runtime_checkable
class Task(Protocol):
    prompts: list[Prompt]

    def reward(self, response: str, prompt: Prompt) -> float: ...


def score_rows(task: Task, prompts: list[Prompt], responses: list[str], response_ids: list[list[int]]
               ) -> torch.Tensor:
    """Rewards [N] of the rows (prompt, decoded response): through the task's batched ``score``
    when it has one (``task.reward_funcs``), else its ``reward`` row by row."""
    score = getattr(task, "score", None)
    if callable(score):
        return score(prompts, responses, response_ids)
    return torch.tensor([float(task.reward(r, p)) for p, r in zip(prompts, responses)], dtype=torch.float32)


def check_encodable(task: Task, tokenizer, where: str, sample: int = 256, max_unknown: float = 0.5) -> None:
    """Refuse prompts the tokenizer cannot read: when more than ``max_unknown`` of the tokens of the
    first ``sample`` prompts are the unknown token, every response would be conditioned on
    ``<unk>``s (English on a 16-symbol vocabulary). ``where`` names the task for the message."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:  # byte-level vocabularies encode any text
        return
    ids = [i for p in task.prompts[:sample] for i in tokenizer(p.text, add_special_tokens=False)["input_ids"]]
    frac = sum(i == unk for i in ids) / max(1, len(ids))
    if frac > max_unknown:
        first = task.prompts[0].text[:60]
        raise ValueError(f"{where}: {frac:.0%} of the prompts' tokens are unknown to the tokenizer "
                         f"({tokenizer.unk_token!r}), e.g. {first!r}: the model cannot read these prompts; "
                         "use a task in the model's vocabulary or a model whose tokenizer covers it")
