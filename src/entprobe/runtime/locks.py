"""An exclusive file lock that says who holds it and gives up after a timeout.

Used around ``batch.save`` / ``batch.load`` folders and the sweep's batch cache, so that two runs
never write or read a half-replaced pair of batches:

    with file_lock(folder / ".lock", timeout_s=cfg.batch.lock_timeout_s, what="saved batches"):
        ...

The lock is ``fcntl.flock`` on the lock file: the kernel releases it when its holder exits, so a
lock file left by a dead process (a killed job) is free; its contents are only the last holder's
``{"pid", "host", "since"}``, rewritten by each new holder. A waiter prints the holder once and
raises ``LockTimeout`` after ``timeout_s`` seconds. File systems without locks (some network
mounts) degrade to no lock, with a warning.
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


class LockTimeout(TimeoutError):
    """A lock stayed held longer than the configured timeout; the message names the holder."""


def _holder(f) -> str:
    """The holder recorded in an open lock file, in words."""
    f.seek(0)
    try:
        h = json.loads(f.read() or "{}")
    except ValueError:
        h = {}
    if not h:
        return "another process (no holder recorded)"
    since = h.get("since", "?")
    try:
        age = f" ({time.time() - datetime.fromisoformat(since).timestamp():.0f} s ago)"
    except (TypeError, ValueError):
        age = ""
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')} since {since}{age}"


@contextlib.contextmanager
def file_lock(path: str | Path, timeout_s: float, what: str, key: str = "batch.lock_timeout_s",
              poll_s: float = 0.1) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created with its folder if missing) for the block.

    While another process holds it: one line on stderr naming the holder, then poll every
    ``poll_s`` seconds; after ``timeout_s`` seconds raise ``LockTimeout`` naming the lock file, the
    holder and the config ``key`` that sets the timeout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    with open(path, "a+") as f:  # "a+": opening must not erase the holder's record
        locked = False
        if fcntl is not None:
            start, told = time.monotonic(), False
            while not locked:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    waited = time.monotonic() - start
                    if waited >= timeout_s:
                        raise LockTimeout(
                            f"{what}: gave up after {waited:.0f} s waiting for the lock {path}, held by "
                            f"{_holder(f)}. Raise {key} to wait longer; if that process is gone (a "
                            f"network file system may keep a dead holder's lock), delete {path}.") from None
                    if not told:
                        print(f"[entprobe] {what}: waiting for the lock {path}, held by {_holder(f)} "
                              f"(timeout {timeout_s:g} s: {key})", file=sys.stderr, flush=True)
                        told = True
                    time.sleep(poll_s)
                except OSError as exc:  # no locks on this file system
                    warnings.warn(f"{what}: no file lock on {path} ({exc}); concurrent runs may both "
                                  "write and the last one wins", stacklevel=3)
                    break
        if locked:
            f.truncate(0)  # append mode: the record is written at offset 0
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
            f.flush()
        try:
            yield
        finally:
            if locked:
                f.truncate(0)
                fcntl.flock(f, fcntl.LOCK_UN)
