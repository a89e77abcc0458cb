"""A user's TRL reward module, written to tmp_path and imported by path (``rewmod``), for the tests of
``task.reward_funcs`` (test_reward_funcs.py, and against GRPOTrainer in test_trl_inputs.py)."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

REWARD_MODULE = textwrap.dedent('''
    SEEN = []  # the keyword columns each call received

    def _text(c):
        return c[0]["content"] if isinstance(c, list) else c

    def accuracy(prompts, completions, answer, **kwargs):
        """None for completions with a '+'; else 1 when their last character is the answer's last digit."""
        SEEN.append((sorted(kwargs) + ["answer"], type(prompts[0]).__name__, type(completions[0]).__name__))
        return [None if "+" in _text(c) else float(_text(c)[-1:] == str(a)[-1]) for c, a in zip(completions, answer)]

    def length_or_none(prompts, completions, completion_ids, level, **kwargs):
        """None for completions with a '+', else their token count times the level."""
        return [None if "+" in _text(c) else len(ids) * lv for c, ids, lv in zip(completions, completion_ids, level)]

    def digits_or_none(prompts, completions, **kwargs):
        """None for completions that do not start with a digit, else their number of digits."""
        return [sum(ch.isdigit() for ch in _text(c)) if _text(c)[:1].isdigit() else None for c in completions]

    def wrong_length(prompts, completions, **kwargs):
        return [0.0]

    def words(prompts, completions, **kwargs):
        return ["good" for _ in completions]

    NOT_CALLABLE = 3
''')
FUNCS = ["rewmod:accuracy", "rewmod.length_or_none", "rewmod:digits_or_none"]
WEIGHTS = [1.0, 0.5, -0.25]


@pytest.fixture
def rewmod(tmp_path, monkeypatch):
    """The user's reward module, importable as ``rewmod`` from tmp_path (a fresh import per test)."""
    (tmp_path / "rewmod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rewmod", raising=False)
    yield importlib.import_module("rewmod")
    sys.modules.pop("rewmod", None)


# Module-level reward functions, importable as ``user_rewards:NAME`` (tests/ is on sys.path), for the
# faults of a user's function run through ``run(cfg)`` (test_bad_inputs.py's TASK_CASES).
def exits_3(prompts, completions, **kwargs):
    """A function that ends the process: without the guard the run would exit 3 and print nothing."""
    sys.exit(3)


def raises_key_error(prompts, completions, **kwargs):
    return [kwargs["no_such_column"] for _ in completions]


def nan_for_second(prompts, completions, **kwargs):
    """A finite reward, then NaN (0/0 in a user's normalisation), then finite ones."""
    return [float("nan") if i == 1 else 1.0 for i in range(len(completions))]


def inf_reward(prompts, completions, **kwargs):
    return [float("inf")] * len(completions)


def always_none(prompts, completions, **kwargs):
    """No reward for any completion (every row unscorable)."""
    return [None] * len(completions)


class NanRewardTask:
    """A user's task class whose ``reward`` gives NaN for a response without a digit."""

    def __init__(self, num_prompts: int = 4):
        from entprobe.tasks.base import Prompt
        self.prompts = [Prompt(f"{i}+1=", str(i + 1)) for i in range(num_prompts)]

    def reward(self, response, prompt):
        return float("nan")
