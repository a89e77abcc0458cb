"""Atomic writes: a reader sees the old file or the complete new one, never a half-written file,
and two processes writing the same path never share a temp file.

Every write goes to a temp file in the target's folder with a unique name (``mkstemp``:
``.<name>.<random>.tmp``), is flushed and fsync'd, then renamed over the target (``os.replace``,
atomic on POSIX within one file system). On any error the temp file is removed and the target is
left as it was. Concurrent writers of one path: the last rename wins, whole (serialize them with
``entprobe.runtime.locks.file_lock`` when the pairing of several files matters).

    with atomic_open(path, "w", newline="") as f: csv.writer(f).writerows(rows)
    write_text_atomic(path, text); write_json_atomic(obj, path); torch_save_atomic(obj, path)
    with staging_dir(target) as tmp: build(tmp)     # a whole folder, renamed into place
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every file system supports it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs) -> Iterator[IO]:
    """A file object on a fresh temp file beside ``path``; on a clean exit it is fsync'd and renamed
    over ``path`` (mode 0644), on an exception removed. ``mode`` is "w" or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def _jsonable(x):
    """Tensors and numpy scalars as numbers, Enums as their values, anything else as its str."""
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "value"):
        return x.value
    return str(x)


def write_json_atomic(obj, path: str | Path) -> Path:
    """``obj`` as indented JSON with sorted keys (NaN stays ``NaN``, as Python's json writes it)."""
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=_jsonable)
    return Path(path)


def torch_save_atomic(obj, path: str | Path) -> Path:
    """``torch.save(obj)`` through a unique temp file (readable with ``weights_only=True`` when
    ``obj`` holds only tensors, numbers, strings and containers of them)."""
    import torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)
    return Path(path)


@contextlib.contextmanager
def staging_dir(target: str | Path) -> Iterator[Path]:
    """A fresh folder beside ``target`` to build a whole folder in; renamed to ``target`` on a clean
    exit. When another process published ``target`` first, theirs is kept and ours discarded
    (both built the same thing). On an exception the staging folder is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)
    except OSError:  # target exists (non-empty): another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        _fsync_dir(target.parent)
