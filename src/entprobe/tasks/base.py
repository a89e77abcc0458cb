"""The task protocol (the builder that instantiates ``task._target_``: build.py)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Prompt:
    text: str  # the user-facing prompt, before any chat template (a conversation: its messages' contents)
    answer: str  # the reference answer the reward compares against
    messages: tuple | None = None  # a conversational prompt: its {"role", "content"} messages, as the dataset holds them
    columns: dict | None = None  # the record's fields other than "prompt" (reward functions' keyword arguments)
    origin: str | None = field(default=None, compare=False)  # where it was read ("file:line"), for messages

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


class RewardFunctionError(ValueError):
    """A user's reward (a ``task.reward_funcs`` function, or a task class's ``reward``) raised or
    returned something that is not a reward; the message names it, the row and what to do."""


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def row_label(prompts: list[Prompt], responses: list[str], i: int) -> str:
    """How a message names row ``i`` of a batch: its index, prompt (and where it was read) and response."""
    p = prompts[i]
    return f"row {i} (prompt {_short(p.text)}{f' at {p.origin}' if p.origin else ''}, response {_short(responses[i])})"


def call_user(fn: Callable, name: str, on: Callable[[], str], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; whatever it raises, ``sys.exit`` included (which would end the run
    silently with its code), becomes a RewardFunctionError naming ``name`` and what it was scoring
    (``on()``), the original chained."""
    try:
        return fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        what = (f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
                else f"raised {type(exc).__name__}: {str(exc)[:200] or '(no message)'}")
        raise RewardFunctionError(f"{name} {what} while scoring {on()}; "
                                  "a reward function must return its rewards, not raise or exit: fix it "
                                  "(run it on one row by hand to see its traceback)") from exc


def as_reward(value: Any, name: str, where: Callable[[], str], none_ok: bool = False) -> float:
    """``value`` as a finite float (None -> NaN when ``none_ok``: TRL's "no reward" for a row); a
    RewardFunctionError naming ``name`` and the row (``where()``) for anything else, NaN and inf included."""
    if value is None and none_ok:
        return math.nan
    if hasattr(value, "numel") and value.numel() == 1:  # a one-element tensor
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardFunctionError(f"{name} returned {value!r} ({type(value).__name__}) for {where()}; a reward "
                                  "function returns one float" + (" (or None: no reward)" if none_ok else "")
                                  + " per completion")
    v = float(value)
    if not math.isfinite(v):
        raise RewardFunctionError(f"{name} returned {v} for {where()}; a reward must be a finite number"
                                  + (" (None where the row has no reward)" if none_ok else "")
                                  + ": fix the function so it never divides by zero or returns nan/inf")
    return v


def score_rows(task: Task, prompts: list[Prompt], responses: list[str], response_ids: list[list[int]]
               ) -> torch.Tensor:
    """Rewards [N] of the rows (prompt, decoded response): through the task's batched ``score``
    when it has one (``task.reward_funcs``), else its ``reward`` row by row (each value checked:
    a finite number, ``as_reward``)."""
    score = getattr(task, "score", None)
    if callable(score):
        return score(prompts, responses, response_ids)
    name = f"task._target_={type(task).__module__}.{type(task).__qualname__}: its reward(response, prompt)"
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        where = lambda: row_label(prompts, responses, i)  # noqa: E731 (only built for a message)
        out.append(as_reward(call_user(task.reward, name, where, r, p), name, where))
    return torch.tensor(out, dtype=torch.float32)


def first_unknown_char(tokenizer, text: str, unk: int) -> str | None:
    """The first character of ``text`` the tokenizer encodes as its unknown token ``unk`` (each
    character encoded alone), None when it reads every one."""
    for c in dict.fromkeys(text):
        if unk in tokenizer(c, add_special_tokens=False)["input_ids"]:
            return c
    return None


def check_encodable(task: Task, tokenizer, where: str, sample: int = 256) -> None:
    """Refuse prompts with a character the tokenizer cannot read (encoded as its unknown token: the
    built-in character tokenizer's vocabulary is the arithmetic task's 16 symbols, and its unknown
    token is its padding, so the character would vanish from the prompt): an InputFileError naming
    the record (``file:line`` for a JSONL task) and the character, over the first ``sample``
    prompts. Byte-level vocabularies (no unknown token) encode any text and are not checked."""
    from entprobe.runtime.input_files import InputFileError

    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:  # byte-level vocabularies encode any text
        return
    for n, p in enumerate(task.prompts[:sample]):
        if unk not in tokenizer(p.text, add_special_tokens=False)["input_ids"]:
            continue
        c = first_unknown_char(tokenizer, p.text, unk)
        record = p.origin or f"{where}, prompt {n}"
        raise InputFileError(f"{record}: the prompt has {c!r} (U+{ord(c):04X}), which the tokenizer does not have "
                             f"(an unknown token, read as {tokenizer.unk_token!r}): remove or replace it, or probe a model "
                             "whose tokenizer covers it (a byte-level one reads any text)" if c else
                             f"{record}: the tokenizer reads part of the prompt as {tokenizer.unk_token!r}: "
                             "use prompts in the model's vocabulary")
