"""Saved batches on disk (``batch.save`` / ``batch.load`` and the sweep's batch cache): ``E.pt``,
``U.pt`` and ``batches.json``, the fingerprint of what sampled them.

The fingerprint holds the model's and tokenizer's identity (hashes of their files, so a copied
checkpoint still matches and a retrained one does not), the task, the sampling settings
(temperature, top_k, top_p, max_new_tokens), G, B_E, B_U and the seeds. Loading compares it with
the config and refuses batches of another distribution with a message naming the key. Folders
saved before fingerprints existed are checked on what the tensors carry (G, B, temperature).

A folder is written and read under ``<folder>/.lock`` (``entprobe.runtime.locks``): two runs saving to one
folder take turns, and the folder always holds one run's complete pair (the last writer's), never
E of one run beside U of another; a reader never sees a pair being replaced.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from entprobe.runtime.atomic_io import write_json_atomic
from entprobe.config import ConfigError, EntprobeConfig
from entprobe.runtime.input_files import load_json_file
from entprobe.runtime.locks import file_lock
from entprobe.tasks.prompt_ids import style_of
from entprobe.rollouts.sampling import RolloutBatch

META = "batches.json"
# the value a task key had in effect before it was added (prompts tokenized as entprobe, built-in rewards)
_TASK_BEFORE = {"tokenize": "entprobe", "chat_template_kwargs": {}, "reward_funcs": [], "reward_weights": None}
LOCK = ".lock"
_CHUNK, _CHUNKS = 1 << 16, 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "special_tokens_map.json")


def _file_digest(h, path: Path) -> None:
    """Name, size and 16 evenly spaced 64 KiB chunks of ``path`` into ``h`` (a weights file of any
    size in milliseconds; any trained change of the weights moves the chunks)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        for i in range(_CHUNKS):
            f.seek(max(0, (size - _CHUNK) * i // (_CHUNKS - 1)))
            h.update(f.read(_CHUNK))


def file_digest(path: str | Path) -> str:
    """Digest of one file, or of every file under a folder (a sharded checkpoint; relative paths
    and ``_file_digest`` of each, sorted)."""
    path, h = Path(path), hashlib.sha256()
    if path.is_file():
        _file_digest(h, path)
    for f in sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else ():
        h.update(str(f.relative_to(path)).encode())
        _file_digest(h, f)
    return h.hexdigest()[:16]


def files_digest(folder: Path, names: tuple[str, ...] | None, suffixes: tuple[str, ...] = ()) -> str:
    """Digest of the files of ``folder`` named ``names`` or ending in ``suffixes`` (sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file()
                   and ((names and p.name in names) or p.name.endswith(suffixes or ("\0",))))
    for p in files:
        _file_digest(h, p)
    return h.hexdigest()[:16]


def model_identity(model_dir: Path | None, gguf: Path | None, tokenizer_dir: Path | None) -> dict:
    """``{"model", "tokenizer"}`` digests of the files the weights and the tokenizer come from."""
    if gguf is not None:  # weights and tokenizer both live in the GGUF file
        model = file_digest(gguf)
        tok = files_digest(tokenizer_dir, _TOKENIZER_FILES) if tokenizer_dir else model
        return {"model": model, "tokenizer": tok}
    assert model_dir is not None
    model = files_digest(model_dir, ("config.json",), (".safetensors", ".bin"))
    return {"model": model, "tokenizer": files_digest(tokenizer_dir or model_dir, _TOKENIZER_FILES)}


def task_fingerprint(cfg: EntprobeConfig) -> dict:
    """The task keys, ``tokenize`` resolved (``auto`` tokenizes as the objective's trainer)."""
    task = {k: getattr(v, "value", v) for k, v in dataclasses.asdict(cfg.task).items()}
    task["tokenize"] = style_of(cfg)
    return task


def fingerprint(cfg: EntprobeConfig, identity: dict) -> dict:
    """What the batches ``cfg`` samples depend on, for ``batches.json``."""
    b, s = cfg.batch, cfg.sampling
    return {**identity, "task": task_fingerprint(cfg), "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens, "G": b.G, "B_E": b.B_E, "B_U": b.B_U,
            "seed_E": b.seed_E, "seed_U": b.seed_U, "advantage": b.advantage.value,
            "mode": cfg.probe.mode.value}


def save_batches(folder: str | Path, E: RolloutBatch, U: RolloutBatch, meta: dict, timeout_s: float) -> None:
    """``batches.json``, ``E.pt``, ``U.pt`` into ``folder``, each atomically, the three under the lock."""
    folder = Path(folder)
    with file_lock(folder / LOCK, timeout_s, f"saving batches to {folder}"):
        write_json_atomic(meta, folder / META)
        E.save(folder / "E.pt")
        U.save(folder / "U.pt")


def load_batches(folder: str | Path, timeout_s: float, key: str = "batch.load"
                 ) -> tuple[RolloutBatch, RolloutBatch, dict | None]:
    """(E, U, fingerprint or None for an old folder) read under the folder's lock."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{key}={folder}: no such folder; give a folder written with batch.save")
    with file_lock(folder / LOCK, timeout_s, f"loading batches from {folder}"):
        todo = f"sample anew (drop {key}) or save the batches again with batch.save"
        E, U = RolloutBatch.load(folder / "E.pt", todo), RolloutBatch.load(folder / "U.pt", todo)
        meta = load_json_file(folder / META, "the batches' fingerprint", todo) if (folder / META).is_file() else None
    return E, U, meta


def check_saved(src: Path, E: RolloutBatch, U: RolloutBatch, meta: dict | None, cfg: EntprobeConfig,
                identity: dict | None = None) -> None:
    """Saved batches must be what the config would sample: the same G, B_E / B_U, temperature,
    top_k / top_p (the log-probs every estimate uses are those of the sampling distribution), task,
    max_new_tokens, advantage type (the saved advantages are used as they are) and (``identity``)
    the same model and tokenizer."""
    b, s = cfg.batch, cfg.sampling
    two = cfg.probe.mode.value == "two_batch"
    for label, batch, B in (("E", E, b.B_E), ("U", U, b.B_U)):
        if batch.G != b.G:
            raise ConfigError(f"batch.load={src}: the saved {label} has G={batch.G} responses per prompt, the "
                              f"config batch.G={b.G}; set batch.G={batch.G} or sample anew")
        if (two or label == "U") and batch.B != B:
            raise ConfigError(f"batch.load={src}: the saved {label} has {batch.B} prompts, the config "
                              f"batch.B_{label}={B}; set batch.B_{label}={batch.B} or sample anew")
        if abs(batch.temperature - s.temperature) > 1e-12:
            raise ConfigError(f"batch.load={src}: {label} was sampled at temperature {batch.temperature}, the "
                              f"config says sampling.temperature={s.temperature}; the log-probs "
                              "would be of another distribution: set it to the sampling temperature")
    if meta is None:
        return
    task = task_fingerprint(cfg)
    if isinstance(meta.get("task"), dict):  # saved before a task key existed: that key's then behaviour
        meta = {**meta, "task": {**_TASK_BEFORE, **meta["task"]}}
    # max_new_tokens: a response cut at another length is a draw of another distribution; advantage:
    # the saved advantages are used as they are, so another advantage type would be probed silently
    for key, cfg_key, want in (("top_k", "sampling.top_k", s.top_k), ("top_p", "sampling.top_p", s.top_p),
                               ("task", "task", task), ("max_new_tokens", "sampling.max_new_tokens", s.max_new_tokens),
                               ("advantage", "batch.advantage", b.advantage.value)):
        if key in meta and meta[key] != want:
            raise ConfigError(f"batch.load={src}: the batches were sampled with {cfg_key}={meta[key]}, the "
                              f"config says {cfg_key}={want}; set it to match or sample anew")
    for key, what in (("model", "model weights"), ("tokenizer", "tokenizer")):
        if identity and key in meta and meta[key] != identity[key]:
            raise ConfigError(f"batch.load={src}: the batches were sampled by other {what} (fingerprint "
                              f"{meta[key]}, this run's {identity[key]}): they are not samples of this "
                              "policy; load the model they came from (model.*) or sample anew")
