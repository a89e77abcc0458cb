"""Verifiable rewards: numeric exact match and a ``\\boxed{}`` math answer."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def numeric_reward(response: str, answer: str) -> float:
    """1.0 when the first number in the response equals the answer numerically, else 0.0."""
    m = _NUMBER.search(response)
    target = _as_number(answer)
    got = _as_number(m.group()) if m is not None else None
    if got is None or target is None:
        return float(response.strip() == answer.strip())
    return float(abs(got - target) < 1e-9)


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


REWARDS = {"numeric": numeric_reward, "boxed": boxed_reward}
