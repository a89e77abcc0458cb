"""Your own TRL reward functions as the task's reward (``task.reward_funcs``, ``task.reward_weights``).

A reward function is what TRL's ``GRPOTrainer(reward_funcs=...)`` takes: a callable
``f(prompts, completions, **kwargs) -> list[float | None]``, one value per row, named here by
import path (``my_pkg.rewards:accuracy``, or ``my_pkg.rewards.accuracy``). It is called as
``GRPOTrainer._calculate_rewards`` calls it (TRL 1.16):

- ``prompts``: each row's prompt as the dataset holds it (a text, or its message list), repeated
  for the G responses of a prompt; ``completions``: the decoded responses (special tokens
  skipped), each as ``[{"role": "assistant", "content": text}]`` when the prompts are message lists;
  ``completion_ids``: the response token ids (EOS included);
- every other field of the prompt's record as a keyword list (``answer``, ``solution``, ...), and
  ``trainer_state=None`` (there is no trainer), ``log_extra`` / ``log_metric`` (accept and drop).

The functions' values are combined as TRL's default ``sum_then_normalize``: ``None`` becomes NaN,
the reward is ``nansum_k w_k r_k`` (``reward_weights``, default all 1); a row every function
returned None for is unscorable: its reward is NaN, it is left out of its group's mean and std,
and its advantage is 0. A function that raises (or calls ``sys.exit``), returns a list of another
length, or a value that is not a number, or NaN / inf (TRL would silently read NaN as None) is a
``RewardFunctionError`` naming it and the row.
"""
from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Callable

import torch

from entprobe.config import ConfigError
from entprobe.tasks.base import Prompt, RewardFunctionError, as_reward, call_user, row_label

_KEY = "task.reward_funcs"


def load_reward_func(path: str) -> Callable:
    """The callable named ``module:attr`` (or ``module.attr``); a ConfigError naming ``path`` otherwise."""
    spec = str(path)
    module, sep, attr = spec.partition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{_KEY}: {spec!r} is not an import path; write module:function, e.g. my_pkg.rewards:accuracy")
    try:
        obj: Any = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # ImportError, or an error (or sys.exit) while the module runs
        said = f"it called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(f"{_KEY}: {spec!r}: module {module!r} cannot be imported ({said}); "
                          "make it importable (installed, or its folder on PYTHONPATH)") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{_KEY}: {spec!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{_KEY}: {spec!r} is a {type(obj).__name__}, not a callable "
                          "(prompts, completions, **kwargs) -> list[float | None]")
    return obj


def weight_errors(funcs: list, weights: list | None) -> list[tuple[str, str]]:
    """``(key, message)`` for ``task.reward_weights`` against ``task.reward_funcs``."""
    if weights is None:
        return []
    if not funcs:
        return [("task.reward_weights", "weighs task.reward_funcs; give the functions too, or drop the weights")]
    if len(weights) != len(funcs):
        return [("task.reward_weights", f"has {len(weights)} values for {len(funcs)} task.reward_funcs; "
                 "give one weight per function")]
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        return [("task.reward_weights", f"is {list(weights)}; each weight must be a finite number")]
    return []


def check_weights(funcs: list, weights: list | None) -> list[float]:
    """The weights of ``funcs`` (all 1 when None), checked: one finite number per function."""
    for key, msg in weight_errors(funcs, weights):
        raise ConfigError(f"{key} {msg}")
    return [1.0] * len(funcs) if weights is None else [float(w) for w in weights]


def combine(values: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """TRL's ``sum_then_normalize`` reward of rows [N, K] of function values (NaN = None):
    ``nansum_k w_k r_k``, NaN where every function gave None."""
    w = torch.tensor(weights, dtype=values.dtype)
    rewards = (values * w).nansum(-1)
    return rewards.masked_fill(values.isnan().all(-1), math.nan)


class WithRewardFuncs:
    """A task whose rewards are TRL reward functions' (module docstring); prompts as ``task``'s."""

    def __init__(self, task, paths: list[str], weights: list | None = None):
        self.task = task
        self.prompts = task.prompts
        self.paths = [str(p) for p in paths]
        self.funcs = [load_reward_func(p) for p in self.paths]
        self.weights = check_weights(self.funcs, weights)

    def score(self, prompts: list[Prompt], responses: list[str], response_ids: list[list[int]]) -> torch.Tensor:
        """Rewards [N] of the rows, every function called once on all of them."""
        n = len(prompts)
        conversational = prompts[0].messages is not None
        completions = [[{"role": "assistant", "content": r}] for r in responses] if conversational else list(responses)
        keys = list(dict.fromkeys(k for p in prompts for k in p.fields if k not in ("prompt", "completion",
                                                                                    "completion_ids")))
        columns = {k: [p.fields.get(k) for p in prompts] for k in keys}
        kwargs = dict(columns, completion_ids=[list(r) for r in response_ids], trainer_state=None,
                      log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
        values = torch.empty(n, len(self.funcs), dtype=torch.float32)
        for j, (f, name) in enumerate(zip(self.funcs, self.paths)):
            label = f"{_KEY}: {name}"
            out = call_user(f, label, lambda: f"the {n} completions of a batch",
                            prompts=[p.source for p in prompts], completions=completions, **kwargs)
            try:
                out = list(out)
            except TypeError:
                raise RewardFunctionError(f"{label} returned {type(out).__name__}; it must return a list with one "
                                          f"reward per completion ({n})") from None
            if len(out) != n:
                raise RewardFunctionError(f"{label} returned {len(out)} rewards for {n} completions; it must "
                                          "return exactly one per completion")
            values[:, j] = torch.tensor([as_reward(v, label, lambda i=i: row_label(prompts, responses, i), none_ok=True)
                                         for i, v in enumerate(out)], dtype=torch.float32)
        return combine(values, self.weights)

    def reward(self, response: str, prompt: Prompt) -> float:
        """One row's reward (the functions called on that row alone)."""
        return float(self.score([prompt], [response], [[]])[0])
