"""Checked reads of the files a user points entprobe at (optimizer / scheduler state, trainer
state, saved batches, safetensors weights, GGUF files).

Every failure is an ``InputFileError`` whose message names the file, says what is wrong with it
in plain words and what to do. Library errors are not relayed: in particular torch's advice to
retry with ``weights_only=False`` (which would execute code from the file) never reaches the
user. Nothing is unpickled: ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any


class InputFileError(ValueError):
    """A file is missing, empty, truncated or not what it should be; the message names it."""


def _present(path: Path, what: str, todo: str) -> int:
    """The file's size; an error when it is missing or empty."""
    if not path.is_file():
        raise InputFileError(f"{path}: {what} not found; {todo}")
    size = path.stat().st_size
    if size == 0:
        raise InputFileError(f"{path}: {what} is empty (0 bytes; an interrupted save or copy?); {todo}")
    return size


def load_torch_file(path: str | Path, what: str, todo: str, allow: list | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, or an error naming the file. ``allow``:
    extra globals the weights-only unpickler may build (``torch.serialization.safe_globals``
    entries: a class, or ``(stand-in class, "module.Name")`` to build a record in its place)."""
    import torch

    path = Path(path)
    size = _present(path, what, todo)
    try:
        with torch.serialization.safe_globals(allow or []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            reason = ("it holds Python objects other than tensors, numbers and containers, which entprobe "
                      "never unpickles (nothing from a checkpoint is executed)")
        else:
            reason = "it is not a file torch.save wrote (unpickling failed)"
    except RuntimeError as exc:
        reason = ("it is truncated or corrupt (its zip archive cannot be read)" if "zip" in str(exc).lower()
                  else f"torch cannot read it ({str(exc).splitlines()[0][:120]})")
    except Exception as exc:  # random bytes surface as IndexError, KeyError, EOFError, ...
        reason = f"it is not a file torch.save wrote ({type(exc).__name__} while unpickling)"
    raise InputFileError(f"{path}: cannot read {what} ({size} bytes): {reason}; {todo}") from None


def load_json_file(path: str | Path, what: str, todo: str) -> Any:
    """The parsed JSON of ``path``, or an error naming the file (and line:column for bad JSON)."""
    path = Path(path)
    _present(path, what, todo)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}:{exc.lineno}:{exc.colno}: {what} is not valid JSON ({exc.msg}); "
                             f"{todo}") from None
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: {what} is not UTF-8 text; {todo}") from None


def check_safetensors(path: str | Path, todo: str) -> None:
    """The header parses and covers the whole file (a truncated copy fails here, not mid-load)."""
    from safetensors import safe_open

    path = Path(path)
    _present(path, "safetensors weights", todo)
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception as exc:
        detail = str(exc).replace("Error while deserializing header: ", "")
        raise InputFileError(f"{path}: not a complete safetensors file ({detail}); {todo}") from None


GGUF_MAGIC = b"GGUF"


def check_gguf(path: str | Path, todo: str) -> None:
    """The file is non-empty and starts with the GGUF magic and a known version (the cheap part of
    the format; a truncated tensor block is reported by ``load_model`` with the file's name)."""
    path = Path(path)
    size = _present(path, "GGUF file", todo)
    with path.open("rb") as f:
        head = f.read(8)
    if size < 24 or head[:4] != GGUF_MAGIC:
        raise InputFileError(f"{path}: not a GGUF file ({size} bytes, starts with {head[:4]!r}, not "
                             f"{GGUF_MAGIC!r}); {todo}")
    version = int.from_bytes(head[4:8], "little")
    if version not in (1, 2, 3):
        raise InputFileError(f"{path}: GGUF version {version} is not one transformers reads (1-3); {todo}")
