"""Verifiable rewards (``task.reward``): the first or the last number of the response, or its last
``\\boxed{}``, against the reference answer."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _number_matches(response: str, answer: str, m) -> float:
    target = _as_number(answer)
    got = _as_number(m.group()) if m is not None else None
    if got is None or target is None:
        return float(response.strip() == answer.strip())
    return float(abs(got - target) < 1e-9)


def numeric_reward(response: str, answer: str) -> float:
    """1.0 when the first number in the response equals the answer numerically, else 0.0 (a response
    without a number, or a non-numeric answer: 1.0 on an exact text match). For short answers
    ("3+4=" -> "7"); a model that reasons first ("3 plus 4 is 7") scores 0: use ``last_number``."""
    return _number_matches(response, answer, _NUMBER.search(response))


def last_number_reward(response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the answer numerically (commas dropped:
    "1,000" is 1000), else 0.0; the usual reward of a GSM8K-style run whose model reasons before it
    answers. A response without a number, or a non-numeric answer: 1.0 on an exact text match."""
    last = None
    for last in _NUMBER.finditer(response):
        pass
    return _number_matches(response, answer, last)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in text, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth, out = start + len("\\boxed{"), 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


def boxed_reward(response: str, answer: str) -> float:
    """1.0 when the last ``\\boxed{}`` answer matches (numerically if both parse, else as text)."""
    got = extract_boxed(response)
    if got is None:
        return 0.0
    a, b = _as_number(got), _as_number(answer)
    if a is not None and b is not None:
        return float(abs(a - b) < 1e-9)
    return float(got.replace(" ", "") == answer.replace(" ", ""))


REWARDS = {"numeric": numeric_reward, "last_number": last_number_reward, "boxed": boxed_reward}
