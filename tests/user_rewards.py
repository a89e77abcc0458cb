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
