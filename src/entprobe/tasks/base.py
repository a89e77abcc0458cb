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
