"""Full-content sha256 of a file, computed once and remembered while the file is unchanged.

``sha256_file(path)`` reads the whole file (1 MiB blocks, hashlib) the first time, then returns the
remembered digest as long as the file's (path, size, mtime_ns, ctime_ns, inode, device) are those it
was hashed at: any write, truncation, copy over or replacement changes one of them (ctime cannot be
set back by a user, so restoring mtime after an edit does not hide it).

The memory is one JSON file, ``$ENTPROBE_DIGEST_CACHE`` if set (empty: no cache, every call hashes),
else ``digests.json`` in ``$ENTPROBE_CACHE`` (the default checkpoint's cache) or else in
``$XDG_CACHE_HOME/entprobe`` (``~/.cache/entprobe`` without XDG_CACHE_HOME). It is read
afresh and merged before each write and replaced atomically (``atomic_io``): concurrent writers
never leave a torn file, at worst one's new entry is lost and hashed again later. A corrupt or
unreadable cache is ignored, an unwritable one skipped: the digest is the same, only slower. The
newest ``MAX_ENTRIES`` entries are kept.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from entprobe.runtime.atomic_io import write_text_atomic

ENV = "ENTPROBE_DIGEST_CACHE"
BLOCK = 1 << 20
MAX_ENTRIES = 4096


def cache_file() -> Path | None:
    """Where digests are remembered (module docstring); None when ``$ENTPROBE_DIGEST_CACHE`` is empty."""
    if ENV in os.environ:
        return Path(os.environ[ENV]).expanduser() if os.environ[ENV] else None
    if os.environ.get("ENTPROBE_CACHE"):
        return Path(os.environ["ENTPROBE_CACHE"]).expanduser() / "digests.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "entprobe" / "digests.json"


def stamp(st: os.stat_result) -> list[int]:
    """What must be unchanged for a remembered digest to hold: size, mtime, ctime, inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def hash_file(path: Path) -> str:
    """sha256 (hex) of the whole file, read in ``BLOCK``-sized pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _read(cache: Path) -> dict:
    """The cache's entries, ``{}`` when it is missing, unreadable or not what this module writes."""
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(cache: Path, key: str, entry: dict) -> None:
    """Merge ``entry`` into the cache file as it is now and replace it atomically (best effort)."""
    entries = {k: v for k, v in _read(cache).items() if k != key}
    entries[key] = entry
    keep = dict(list(entries.items())[-MAX_ENTRIES:])  # insertion order: the newest last
    try:
        write_text_atomic(cache, json.dumps(keep))
    except OSError:
        pass


def sha256_file(path: str | Path) -> str:
    """sha256 (hex) of the file's contents, remembered by its stamp (module docstring)."""
    path = Path(path).resolve()
    cache, st = cache_file(), path.stat()
    key, now = str(path), stamp(st)
    if cache is not None:
        hit = _read(cache).get(key)
        if isinstance(hit, dict) and hit.get("stamp") == now and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
    digest = hash_file(path)
    if cache is not None and stamp(path.stat()) == now:  # unchanged while it was read
        _remember(cache, key, {"stamp": now, "sha256": digest})
    return digest
