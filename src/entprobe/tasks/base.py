"""The task protocol and the builder that instantiates ``task._target_``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hydra.utils import get_class


@dataclass(frozen=True)
class Prompt:
    text: str  # the user-facing prompt, before any chat template
    answer: str  # the reference answer the reward compares against


@runtime_checkable
class Task(Protocol):
    prompts: list[Prompt]

    def reward(self, response: str, prompt: Prompt) -> float: ...


def build_task(task_cfg: Any) -> Task:
    """Instantiate ``task_cfg._target_`` with the remaining keys the class accepts."""
    target = task_cfg["_target_"]
    try:
        cls = get_class(target)
    except Exception as exc:  # hydra wraps import errors
        raise ValueError(f"task._target_={target!r} cannot be imported: {exc}") from exc
    import inspect

    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in dict(task_cfg).items() if k != "_target_" and k in accepted}
    task = cls(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"{target} must provide .prompts and .reward(response, prompt)")
    if len(task.prompts) == 0:
        raise ValueError(f"task {target} has no prompts (check task.path / task.num_prompts)")
    return task


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
