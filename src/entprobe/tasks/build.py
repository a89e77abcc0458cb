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



# the built-in task classes by the name a description gives them (conf/task/)
BUILTIN = {"entprobe.tasks.arithmetic.ArithmeticTask": "arithmetic", "entprobe.tasks.jsonl.JsonlTask": "jsonl"}


def _reward_funcs_named(paths: list[str], weights: list | None) -> str:
    """``a:f, b:g``, with ``(weights 1, 0.1)`` unless every weight is 1."""
    named = ", ".join(str(p) for p in paths)
    if weights is None or all(float(w) == 1.0 for w in weights):
        return named
    return f"{named} (weights {', '.join(f'{float(w):g}' for w in weights)})"


def describe_task(task_cfg: Any) -> dict[str, str]:
    """What the probe's task and reward are, for the results (``task``, ``task_reward``), from the config
    it is built from (a ``TaskConfig`` or its DictConfig): a built-in by its name and what sets it
    apart (the arithmetic template, the jsonl file), any other class by its ``_target_``; the reward
    functions by import path (with their weights), else the built-in reward's name (``numeric``
    ...), else the class's own ``reward``."""
    def get(key: str, default=None):
        return task_cfg.get(key, default) if hasattr(task_cfg, "get") else getattr(task_cfg, key, default)

    target = str(get("_target_"))
    name = BUILTIN.get(target)
    if name == "arithmetic":
        task = f"arithmetic {str(get('template', '{a}+{b}='))!r}"
    elif name == "jsonl":
        task = f"jsonl {get('path')}"
    else:
        task = target
    funcs, weights = list(get("reward_funcs") or []), get("reward_weights")
    if funcs:
        reward = _reward_funcs_named(funcs, list(weights) if weights is not None else None)
    elif name is not None:
        reward = str(get("reward", "numeric"))
    else:
        reward = f"{target}.reward"
    return {"task": task, "task_reward": reward}


def describe_task_object(task: Any) -> dict[str, str]:
    """``describe_task`` for a task passed in as an object (the Python API): its class, and its
    reward functions by import path when it has them (``WithRewardFuncs``)."""
    if isinstance(task, WithRewardFuncs):
        inner = type(task.task)
        return {"task": f"{inner.__module__}.{inner.__qualname__} (passed in)",
                "task_reward": _reward_funcs_named(task.paths, task.weights)}
    cls = type(task)
    return {"task": f"{cls.__module__}.{cls.__qualname__} (passed in)",
            "task_reward": f"{cls.__module__}.{cls.__qualname__}.reward"}
