"""An exclusive file lock that says who holds it and gives up after a timeout.

Used around ``batch.save`` / ``batch.load`` folders and the sweep's batch cache, so that two runs
never write or read a half-replaced pair of batches:

    with file_lock(folder / ".lock", timeout_s=cfg.batch.lock_timeout_s, what="saved batches"):
        ...

The lock is the ``filelock`` package's ``FileLock`` (``flock`` on POSIX): the kernel releases it
when its holder exits, so a lock file left by a dead process (a killed job) is free. The lock
file's contents are only the last holder's ``{"pid", "host", "since", "job"}`` (``job``: the
distributed job it is a rank of, ``distributed.launch_id``), written by each new holder and read
by a waiter before each try (``filelock`` < 4 empties the file when it opens it). A waiter prints
the holder once and raises ``LockTimeout`` after ``timeout_s`` seconds. It prints nothing while
the holder is another rank of its own job (the ranks of a torchrun job take the same lock one
after the other by design), nor, for up to ``UNRECORDED_S`` seconds, while the holder has taken
the lock but not yet written its record. Where the file system has no locks, ``filelock`` >= 4 falls back to its own lock files;
an older one raises, and the block then runs unlocked, with a warning.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from entprobe.runtime.distributed import launch_id


class LockTimeout(TimeoutError):
    """A lock stayed held longer than the configured timeout; the message names the holder."""


UNRECORDED_S = 2.0  # a waiter says nothing this long while the holder has not written its record yet


def holder_record(path: str | Path) -> dict:
    """The holder recorded in the lock file ``path`` (``{}`` when none is)."""
    try:
        h = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        h = {}
    return h if isinstance(h, dict) else {}


def describe_holder(h: dict) -> str:
    """A holder record in words: pid, host, since when (and how long ago), and whether it is a
    rank of this process's own distributed job."""
    if not h:
        return "another process (no holder recorded)"
    since = h.get("since", "?")
    try:
        age = f" ({time.time() - datetime.fromisoformat(since).timestamp():.0f} s ago)"
    except (TypeError, ValueError):
        age = ""
    peer = ", another rank of this job" if is_peer(h) else ""
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')} since {since}{age}{peer}"


def _me() -> dict:
    """This process's holder record (``since``: now)."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"), "job": launch_id()}


def is_peer(h: dict) -> bool:
    """Whether holder record ``h`` is another process of this process's own distributed job."""
    job = h.get("job")
    return bool(job) and job == launch_id() and (h.get("pid"), h.get("host")) != (os.getpid(), socket.gethostname())


def _record(path: Path, text: str) -> None:
    """Replace the lock file's contents in place (the lock is on this inode: never a new file)."""
    with open(path, "r+") as f:
        f.truncate(0)
        f.write(text)


def try_lock(path: str | Path) -> FileLock | None:
    """The lock on ``path`` held by this process when no one else holds it, else None (no wait);
    ``release()`` it, or let the process end. The holder record is written as by ``file_lock``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    _record(path, json.dumps(_me()))
    return lock


@contextlib.contextmanager
def file_lock(path: str | Path, timeout_s: float, what: str, key: str = "batch.lock_timeout_s",
              poll_s: float = 0.1) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created with its folder if missing) for the block.

    While another process holds it: one line on stderr naming the holder (none while the holder
    is another rank of this job, or for ``UNRECORDED_S`` while it has not recorded itself yet:
    module docstring), then poll every ``poll_s`` seconds; after ``timeout_s`` seconds raise
    ``LockTimeout`` naming the lock file, the holder and the config ``key`` that sets the timeout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    start, told, lock, holder = time.monotonic(), False, None, holder_record(path)
    while lock is None:
        holder = holder_record(path) or holder  # before each try: an old filelock empties the file as it opens it
        try:
            lock = try_lock(path)
        except OSError as exc:  # no locks on this file system (filelock < 4)
            warnings.warn(f"{what}: no file lock on {path} ({exc}); concurrent runs may both "
                          "write and the last one wins", stacklevel=3)
            break
        if lock is not None:
            break
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise LockTimeout(
                f"{what}: gave up after {waited:.0f} s waiting for the lock {path}, held by "
                f"{describe_holder(holder)}. Raise {key} to wait longer; if that process is gone (a "
                f"network file system may keep a dead holder's lock), delete {path}.")
        if not told and not is_peer(holder) and (holder or waited >= UNRECORDED_S):
            print(f"[entprobe] {what}: waiting for the lock {path}, held by {describe_holder(holder)} "
                  f"(timeout {timeout_s:g} s: {key})", file=sys.stderr, flush=True)
            told = True
        time.sleep(poll_s)
    try:
        yield
    finally:
        if lock is not None:
            with contextlib.suppress(OSError):
                _record(path, "")
            lock.release()
