"""``build_task``: a task from its config (``task._target_`` and, with ``task.reward_funcs``, the
reward functions that score it)."""
from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_class

from entprobe.tasks.base import Task
from entprobe.tasks.reward_funcs import WithRewardFuncs


def _said(exc: BaseException) -> str:
    return f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else str(exc)


def build_task(task_cfg: Any) -> Task:
    """Instantiate ``task_cfg._target_`` with the remaining keys the class accepts; with
    ``task_cfg.reward_funcs``, its rewards are those functions' (``reward_funcs.WithRewardFuncs``)."""
    target = task_cfg["_target_"]
    try:
        cls = get_class(target)
    except (Exception, SystemExit) as exc:  # hydra wraps import errors; a module may sys.exit while it runs
        raise ValueError(f"task._target_={target!r} cannot be imported: {_said(exc)}") from exc
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in dict(task_cfg).items() if k != "_target_" and k in accepted}
    try:
        task = cls(**kwargs)
    except SystemExit as exc:  # would end the run with its code and no message; other errors say their own
        raise ValueError(f"task._target_={target!r} {_said(exc)} while building the task: raise an exception "
                         "saying what is wrong instead") from exc
    if not isinstance(task, Task):
        raise TypeError(f"{target} must provide .prompts and .reward(response, prompt)")
    if len(task.prompts) == 0:
        raise ValueError(f"task {target} has no prompts (check task.path / task.num_prompts)")
    funcs = list(task_cfg.get("reward_funcs") or [])
    if funcs:
        weights = task_cfg.get("reward_weights")
        task = WithRewardFuncs(task, funcs, list(weights) if weights is not None else None)
    return task

