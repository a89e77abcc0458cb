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
