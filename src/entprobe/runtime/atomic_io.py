"""Atomic writes: a reader sees the old file or the complete new one, never a half-written file,
and two processes writing the same path never share a temp file.

Every write goes to a temp file in the target's folder with a unique name
(``.<name>.<host>.<pid>.<random>.tmp``: who wrote it, so a run can tell a dead writer's leftover,
``runtime/rundir.py``, from a live one's), is flushed and fsync'd, then renamed over the target
(``os.replace``, atomic on POSIX within one file system). Files are created as ``open()`` would:
mode 0666 less the umask (folders 0777 less the umask). On any error the temp file is removed and
the target is left as it was; a full disk, a disk quota or a file-size limit (``ulimit -f``) raises
``OutputFileError``, one line naming the file and what to do. Concurrent writers of one path: the
last rename wins, whole (serialize them with ``entprobe.runtime.locks.file_lock`` when the pairing
of several files matters).

    with atomic_open(path, "w", newline="") as f: csv.writer(f).writerows(rows)
    write_text_atomic(path, text); write_json_atomic(obj, path); torch_save_atomic(obj, path)
    with staging_dir(target) as tmp: build(tmp)     # a whole folder, renamed into place
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import IO, Callable, Iterator, NamedTuple

# errors of a write that say the output does not fit (not that the path is wrong)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
_LEGACY_TEMP = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")  # mkstemp's, before the writer was named


class OutputFileError(OSError):
    """An output does not fit: the disk is full, a quota or the file-size limit is reached. The
    message names the file and what to do; ``errno`` is the write's."""


class TempName(NamedTuple):
    """What a temp file's name says: the file it becomes, and the host and pid of its writer (None
    for a temp file of an entprobe that did not name the writer)."""
    target: str
    host: str | None
    pid: int | None


def this_host() -> str:
    """The host part of temp names: the host name's first label, letters, digits and '-' only."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32] or "host"


def _fresh(folder: Path, target: str, make: Callable[[Path], object]) -> Path:
    """``make(path)`` on the first unused ``.<target>.<host>.<pid>.<random>.tmp`` in ``folder``."""
    for _ in range(100):
        tmp = folder / f".{target}.{this_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temp name for {target} in {folder}")


def parse_temp_name(name: str) -> TempName | None:
    """The ``TempName`` of an entprobe temp file or folder name; None for any other name."""
    m = _TEMP.match(name)
    if m:
        return TempName(m["target"], m["host"], int(m["pid"]))
    m = _LEGACY_TEMP.match(name)
    return TempName(m["target"], None, None) if m else None


def _no_room(exc: BaseException) -> int | None:
    """The errno of a full disk / quota / file-size limit behind ``exc`` (libraries such as torch
    re-raise a failed write as their own error: its context is searched too), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def no_room_error(path: Path, code: int) -> OutputFileError:
    """One line naming ``path``, what stopped the write (``code``: ENOSPC, EDQUOT or EFBIG) and what to do."""
    if code == errno.EFBIG:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        msg = (f"cannot write {path}: it is larger than the file-size limit allows (ulimit -f: {limit}, or the "
               f"file system's largest file); raise the limit (ulimit -f unlimited) or set run_dir on another "
               f"file system, then rerun")
    else:
        what = "the disk quota is exceeded" if code == errno.EDQUOT else "no space is left on its file system"
        msg = (f"cannot write {path}: {what}; free space there (or raise the quota) or set run_dir on another "
               f"file system, then rerun")
    err = OutputFileError(msg)
    err.errno = code
    return err


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
    """A file object on a fresh temp file beside ``path`` (mode 0666 less the umask); on a clean exit
    it is fsync'd and renamed over ``path``, on an exception removed (``OutputFileError`` when the
    file did not fit). ``mode`` is "w" or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fds = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    tmp = None
    try:
        tmp = _fresh(path.parent, path.name, lambda p: fds.append(os.open(p, flags, 0o666)))
        with os.fdopen(fds[0], mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        code = _no_room(exc)
        if code is not None:
            raise no_room_error(path, code) from None
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
    (both built the same thing). On an exception the staging folder is removed (``OutputFileError``
    when its files did not fit)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh(target.parent, target.name, lambda p: os.mkdir(p, 0o777))  # 0777 less the umask
    try:
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        code = _no_room(exc)
        if code is not None:
            raise no_room_error(target, code) from None
        raise
    try:
        tmp.rename(target)
    except OSError:  # target exists (non-empty): another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        _fsync_dir(target.parent)
