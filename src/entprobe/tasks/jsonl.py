"""A JSONL file of prompt records: ``{"prompt": ..., "answer": ...}`` and any other fields.

``prompt`` is a text or, conversational, a list of ``{"role", "content"}`` messages (TRL's and
verl's ``prompt`` column); every prompt of a file is of one kind. ``answer`` is what the built-in
``task.reward`` compares with (not needed with ``task.reward_funcs``, which read whatever fields
they name). All fields but ``prompt`` reach reward functions as keyword columns, a field a record
lacks as None (as a ``datasets`` table of the file has it).
"""
from __future__ import annotations

import json
from pathlib import Path

from entprobe.config import ConfigError
from entprobe.runtime.input_files import InputFileError

from entprobe.tasks.prompt_ids import is_conversational
from entprobe.tasks.base import Prompt
from entprobe.tasks.rewards import REWARDS


class TaskFileError(InputFileError):
    """A record of a task's JSONL file is not a prompt record; the message names the file and line
    (a user error: the commands print it as one line; a ``ValueError``, as it was)."""


def _messages(value, where: str) -> tuple | None:
    """The prompt's message list (None for a text), each message a {"role": str, "content": str}."""
    if isinstance(value, str):
        if not value.strip():
            raise TaskFileError(f"{where}: 'prompt' must be a non-empty string (or a list of messages)")
        return None
    if not isinstance(value, list) or not value or not is_conversational(value):
        raise TaskFileError(f"{where}: 'prompt' must be a non-empty string or a list of "
                         '{"role": ..., "content": ...} messages')
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TaskFileError(f"{where}: message {m!r} needs a string 'role' and a string 'content'")
    return tuple(dict(m) for m in value)


def read_utf8(path: Path, key: str = "task.path") -> str:
    """The file's text; an InputFileError naming the file, the line and the byte offset of the first
    byte that is not UTF-8 (a Latin-1 or cp1252 export) and how to re-encode it."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors write one) is dropped
    except UnicodeDecodeError as e:
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            what, src = "is UTF-16 (its byte-order mark)", "UTF-16"
        else:
            line = data.count(b"\n", 0, e.start) + 1
            what, src = f"line {line} (byte {e.start}, 0x{data[e.start]:02x}) is not UTF-8", "LATIN1"
        raise InputFileError(f"{key}={path}: {what}; JSONL is UTF-8: re-encode the file (e.g. iconv -f {src} "
                             f"-t UTF-8 {path.name} > {path.stem}.utf8.jsonl, with the encoding it was written in) "
                             f"and point {key} at the result") from None


def _answer(rec: dict, where: str, required: bool) -> str:
    if "answer" not in rec and not required:
        return ""
    a = rec.get("answer")
    if isinstance(a, bool) or not isinstance(a, (str, int, float)) or not str(a).strip():
        raise TaskFileError(f"{where}: 'answer' is {a!r}; it must be a number or a non-empty string (the reward "
                         "compares responses with it)")
    return str(a)


class JsonlTask:
    def __init__(self, path: str | None = None, reward: str = "numeric", num_prompts: int = 0,
                 reward_funcs: list | None = None):
        if not path:
            raise ConfigError("task.path must point to a .jsonl file with a 'prompt' field per line")
        if reward not in REWARDS:
            raise ConfigError(f"task.reward={reward!r}; choose one of {sorted(REWARDS)}")
        p = Path(path).expanduser()
        if not p.is_file():
            raise InputFileError(f"task.path={path!r} does not exist: give the .jsonl file of prompt records")
        need_answer = not reward_funcs
        records = []
        for lineno, line in enumerate(read_utf8(p).split("\n"), 1):  # not splitlines: U+2028 etc. are not line ends in JSONL
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{where}: not a JSON record ({e.msg})") from None
            if not isinstance(rec, dict) or "prompt" not in rec or (need_answer and "answer" not in rec):
                raise TaskFileError(f"{where}: each record needs 'prompt' and 'answer'" if need_answer else
                                 f"{where}: each record needs a 'prompt'")
            records.append((where, rec, _messages(rec["prompt"], where)))
        if len({m is None for _, _, m in records}) > 1:
            first_text = next(w for w, _, m in records if m is None)
            first_chat = next(w for w, _, m in records if m is not None)
            raise TaskFileError(f"task.path={path}: prompts of both kinds ({first_text} is a text, {first_chat} a "
                             "message list); a trainer's dataset has one kind: convert them to one")
        keys = list(dict.fromkeys(k for _, rec, _ in records for k in rec if k != "prompt"))
        self.prompts = []
        for where, rec, msgs in records:
            text = rec["prompt"] if msgs is None else "\n".join(m["content"] for m in msgs)
            self.prompts.append(Prompt(text=text, answer=_answer(rec, where, need_answer), messages=msgs,
                                       columns={k: rec.get(k) for k in keys}, origin=where))
        if num_prompts:
            self.prompts = self.prompts[:num_prompts]
        self._reward = REWARDS[reward]

    def reward(self, response: str, prompt: Prompt) -> float:
        return self._reward(response, prompt.answer)
