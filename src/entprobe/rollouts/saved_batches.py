"""Saved batches on disk (``batch.save`` / ``batch.load`` and the sweep's batch cache): ``E.pt``,
``U.pt`` and ``batches.json``, the fingerprint of what sampled them and the sha256 of the two files.

The fingerprint (``fingerprint``) holds the model's and tokenizer's identity (full-content sha256 of
their files, ``runtime.file_digest``: a copied checkpoint still matches, a retrained or overwritten
one does not), the task, every sampling and batch key that changes what is drawn or the advantages
stored with it (``SAMPLED_KEYS``), and ``sha256`` of ``E.pt`` / ``U.pt``. Loading compares each key
with the config and refuses batches of another distribution with a message naming the key, and
refuses an ``E.pt`` / ``U.pt`` that is not the file ``batches.json`` recorded. Folders saved before
a key existed read as that key's behaviour then (``_TASK_BEFORE``; a sampling key not recorded is
not compared; identities hashed from 16 chunks of each file, ``identity["before"]``, which read a
file of up to 1 MiB whole: such a fingerprint of a larger model file cannot tell whether the model
changed, and is refused with what to do); folders without fingerprint are checked on what the
tensors carry.

A pair is replaced as one unit: ``save_batches`` writes the three files into a fresh folder
``.saving-<id>`` beside them, renames it ``.ready-<id>`` (the commit point), then moves E, U and
last ``batches.json`` into place. Whoever takes the folder's lock next (``<folder>/.lock``,
``entprobe.runtime.locks``) first finishes a ``.ready-*`` move a killed writer left and drops a
``.saving-*`` one: a reader gets the last committed pair whole, never E of one save beside U of
another (and if the move cannot be finished, the sha256 check refuses the mix).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from entprobe.runtime.atomic_io import write_json_atomic
from entprobe.config import ConfigError, EntprobeConfig
from entprobe.runtime.file_digest import hash_file, sha256_file
from entprobe.runtime.input_files import InputFileError, load_json_file
from entprobe.runtime.locks import file_lock
from entprobe.tasks.prompt_ids import style_of
from entprobe.rollouts.sampling import RolloutBatch

META = "batches.json"
PAIR = ("E.pt", "U.pt", META)  # the order a committed pair moves into place: the fingerprint last
STAGING, READY = ".saving-", ".ready-"
DIGESTS = "sha256"  # the fingerprint's "digests": how its model / tokenizer identities were hashed
# the value a task key had in effect before it was added (prompts tokenized as entprobe, built-in rewards)
_TASK_BEFORE = {"tokenize": "entprobe", "chat_template_kwargs": {}, "reward_funcs": [], "reward_weights": None,
                "template": "{a}+{b}="}
LOCK = ".lock"
_CHUNK, _CHUNKS = 1 << 16, 16
# the largest file the chunked digest of early fingerprints reads whole: 16 chunks of 64 KiB, evenly
# spaced from the first byte to the last, leave no byte out of a file up to 16 x 64 KiB = 1 MiB
_CHUNKED_SEES = _CHUNK * _CHUNKS
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "special_tokens_map.json")


class BatchSaveError(OSError):
    """Writing a pair of batches failed (no space, no permission, ...); the message names the folder."""


def _chunk_digest(h, path: Path) -> None:
    """Name, size and 16 evenly spaced 64 KiB chunks of ``path`` into ``h``: how identities were
    hashed before full digests (kept to read fingerprints of that time, ``identity["before"]``)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        for i in range(_CHUNKS):
            f.seek(max(0, (size - _CHUNK) * i // (_CHUNKS - 1)))
            h.update(f.read(_CHUNK))


def _full_digest(h, path: Path) -> None:
    """Name and full-content sha256 of ``path`` (remembered while unchanged, ``sha256_file``) into ``h``."""
    h.update(f"{path.name}:{sha256_file(path)}".encode())


def file_digest(path: str | Path, full: bool = True) -> str:
    """Digest of one file, or of every file under a folder (a sharded checkpoint; relative paths
    and the digest of each, sorted). ``full=False``: the chunked digest of earlier fingerprints."""
    path, h = Path(path), hashlib.sha256()
    add = _full_digest if full else _chunk_digest
    if path.is_file():
        add(h, path)
    for f in sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else ():
        h.update(str(f.relative_to(path)).encode())
        add(h, f)
    return h.hexdigest()[:16]


def _selected(folder: Path, names: tuple[str, ...] | None, suffixes: tuple[str, ...] = ()) -> list[Path]:
    """The files of ``folder`` named ``names`` or ending in ``suffixes`` (sorted)."""
    return sorted(p for p in folder.iterdir() if p.is_file()
                  and ((names and p.name in names) or p.name.endswith(suffixes or ("\0",))))


def _chunks_miss(model_dir: Path | None, gguf: Path | None, tokenizer_dir: Path | None,
                 adapter_dir: Path | None) -> str:
    """The first file of the identity larger than the chunked digest reads whole (``_CHUNKED_SEES``:
    a change between its chunks went unseen by early fingerprints); "" when there is none."""
    files = []
    if gguf is not None:
        files += [gguf] if gguf.is_file() else sorted(q for q in gguf.rglob("*") if q.is_file())
    for folder in (model_dir, adapter_dir):
        if folder is not None:
            files += _selected(folder, ("config.json",), (".safetensors", ".bin"))
    tok = tokenizer_dir or (model_dir if gguf is None else None)
    files += _selected(tok, _TOKENIZER_FILES) if tok is not None else []
    return next((str(f) for f in files if f.stat().st_size > _CHUNKED_SEES), "")


def files_digest(folder: Path, names: tuple[str, ...] | None, suffixes: tuple[str, ...] = (),
                 full: bool = True) -> str:
    """Digest of the files of ``folder`` named ``names`` or ending in ``suffixes`` (sorted)."""
    h = hashlib.sha256()
    for p in _selected(folder, names, suffixes):
        (_full_digest if full else _chunk_digest)(h, p)
    return h.hexdigest()[:16]


def _identity(model_dir: Path | None, gguf: Path | None, tokenizer_dir: Path | None, full: bool) -> dict:
    """``{"model", "tokenizer"}`` digests (``full``: sha256 of the contents; else chunked)."""
    if gguf is not None:  # weights and tokenizer both live in the GGUF file
        model = file_digest(gguf, full)
        tok = files_digest(tokenizer_dir, _TOKENIZER_FILES, (), full) if tokenizer_dir else model
        return {"model": model, "tokenizer": tok}
    assert model_dir is not None
    model = files_digest(model_dir, ("config.json",), (".safetensors", ".bin"), full)
    return {"model": model, "tokenizer": files_digest(tokenizer_dir or model_dir, _TOKENIZER_FILES, (), full)}


def model_identity(model_dir: Path | None, gguf: Path | None, tokenizer_dir: Path | None,
                   adapter_dir: Path | None = None) -> dict:
    """``{"model", "tokenizer"}`` digests of the files the weights and the tokenizer come from
    (with a PEFT adapter: the base's and the adapter's, ``"<base>+<adapter>"``), and under
    ``"before"`` the same hashed as fingerprints without ``"digests"`` were, with ``"unseen"``: a
    file too large for that hash to read whole (``_chunks_miss``; "" when none)."""
    out = {}
    for key, full in (("now", True), ("before", False)):
        ident = _identity(model_dir, gguf, tokenizer_dir, full)
        if adapter_dir is not None:
            ident["model"] += "+" + _identity(adapter_dir, None, None, full)["model"]
        out[key] = ident
    out["before"]["unseen"] = _chunks_miss(model_dir, gguf, tokenizer_dir, adapter_dir)
    return {**out["now"], "before": out["before"]}


def task_fingerprint(cfg: EntprobeConfig) -> dict:
    """The task keys, ``tokenize`` resolved (``auto`` tokenizes as the objective's trainer)."""
    task = {k: getattr(v, "value", v) for k, v in dataclasses.asdict(cfg.task).items()}
    task["tokenize"] = style_of(cfg)
    return task


def sampled_keys(cfg: EntprobeConfig) -> dict:
    """Every config key that changes what is sampled or the advantages stored with it, by its
    fingerprint name: ``(config key, value)``. The whole ``task`` (prompts, rewards, template,
    ``tokenize`` resolved by the objective: the objective changes the batches only through it),
    ``sampling.temperature`` / ``top_k`` / ``top_p`` / ``max_new_tokens``, ``batch.G`` / ``B_E`` /
    ``B_U`` / ``seed_E`` / ``seed_U`` / ``advantage`` / ``adv_eps``, and whether E was drawn on its
    own (``two_batch`` or importance sampling) or is U (``E_drawn``), and ``sampling.coupling`` /
    ``coupling_block`` / ``coupling_order`` / ``coupling_U`` (folders saved before them: independent draws).

    Left out on purpose: ``sampling.gen_microbatch_prompts``, ``model.dtype`` / ``device`` /
    ``attn_implementation`` and the world size (each response draws from its own keyed stream:
    they move the draws by rounding only, and saved batches exist to be probed on another machine,
    dtype or world size); ``seed`` (not a sampling seed); ``batch.save`` / ``load`` /
    ``lock_timeout_s`` / ``share_across_lr`` (where and how, not what); ``probe.*``,
    ``importance.*``, ``optimizer.*`` and the objective's loss keys (what is computed on the batches)."""
    b, s = cfg.batch, cfg.sampling
    return {"task": ("task", task_fingerprint(cfg)), "temperature": ("sampling.temperature", s.temperature),
            "top_k": ("sampling.top_k", s.top_k), "top_p": ("sampling.top_p", s.top_p),
            "max_new_tokens": ("sampling.max_new_tokens", s.max_new_tokens), "G": ("batch.G", b.G),
            "B_E": ("batch.B_E", b.B_E), "B_U": ("batch.B_U", b.B_U), "seed_E": ("batch.seed_E", b.seed_E),
            "seed_U": ("batch.seed_U", b.seed_U), "advantage": ("batch.advantage", b.advantage.value),
            "adv_eps": ("batch.adv_eps", b.adv_eps), "E_drawn": ("probe.mode", e_drawn(cfg)),
            "coupling": ("sampling.coupling", s.coupling), "coupling_block": ("sampling.coupling_block",
            s.coupling_block), "coupling_order": ("sampling.coupling_order", s.coupling_order),
            "coupling_U": ("sampling.coupling_U", s.coupling_U)}


def resave_overrides(cfg: EntprobeConfig) -> str:
    """The overrides that sample the batches ``cfg`` loads again, into a new folder: every scalar
    key of ``sampled_keys`` at its value and ``batch.save=DIR`` (the task and the model are the
    command line's own, kept as they are)."""
    off = cfg.sampling.coupling == "none"  # the coupling keys then say nothing: left out
    keys = [f"{key}={want}" for name, (key, want) in sampled_keys(cfg).items()
            if name not in ("task", "E_drawn") and want is not None and not (off and name.startswith("coupling"))]
    return " ".join(keys + ["batch.save=DIR"])


def e_drawn(cfg: EntprobeConfig) -> bool:
    """Whether a run of ``cfg`` draws E on its own (else E is U: single_batch without importance)."""
    return cfg.probe.mode.value == "two_batch" or cfg.importance.enabled


def fingerprint(cfg: EntprobeConfig, identity: dict) -> dict:
    """What the batches ``cfg`` samples depend on, for ``batches.json`` (``save_batches`` adds the
    files' sha256)."""
    return {**{k: v for k, v in identity.items() if k != "before"}, "digests": DIGESTS,
            **{k: v for k, (_, v) in sampled_keys(cfg).items()}, "mode": cfg.probe.mode.value}


# ----------------------------------------------------------------------------- the folder
def _recover(folder: Path) -> None:
    """Finish what a killed writer left (the caller holds the lock): a committed ``.ready-*`` pair
    is moved into place, an uncommitted ``.saving-*`` one removed. Best effort (a read-only
    folder stays as it is; the sha256 check then refuses a mixed pair)."""
    try:
        for stage in folder.glob(STAGING + "*"):
            shutil.rmtree(stage, ignore_errors=True)
        for ready in sorted(folder.glob(READY + "*"), key=lambda p: p.stat().st_mtime_ns):
            _move_in(ready, folder)
    except OSError:
        pass


def _move_in(ready: Path, folder: Path) -> None:
    """The files of a committed pair into ``folder`` (E, U, then ``batches.json``), then its folder away."""
    for name in PAIR:
        if (ready / name).is_file():
            os.replace(ready / name, folder / name)
    shutil.rmtree(ready, ignore_errors=True)


def is_complete(folder: str | Path) -> bool:
    """A pair was committed there: E, U and the fingerprint in place, or a committed pair left to
    move in (``_recover`` does it under the lock)."""
    folder = Path(folder)
    return all((folder / n).is_file() for n in PAIR) or any(folder.glob(READY + "*"))


def save_batches(folder: str | Path, E: RolloutBatch, U: RolloutBatch, meta: dict, timeout_s: float,
                 key: str = "batch.save") -> None:
    """``E.pt``, ``U.pt`` and ``batches.json`` (``meta`` and the two files' sha256) into ``folder``
    as one unit, under its lock (module docstring). A failed write (a full disk) is a
    ``BatchSaveError`` naming the folder; the folder keeps its earlier pair."""
    folder = Path(folder)
    try:
        with file_lock(folder / LOCK, timeout_s, f"saving batches to {folder}"):
            _recover(folder)
            stage = Path(tempfile.mkdtemp(prefix=STAGING, dir=folder))
            try:
                E.save(stage / "E.pt")
                U.save(stage / "U.pt")
                sums = {n: hash_file(stage / n) for n in ("E.pt", "U.pt")}
                write_json_atomic({**meta, "sha256": sums}, stage / META)
                ready = stage.rename(folder / (READY + stage.name[len(STAGING):]))  # the commit point
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            _move_in(ready, folder)
    except OSError as exc:
        if isinstance(exc, (BatchSaveError, TimeoutError)):
            raise
        raise BatchSaveError(f"{key}={folder}: cannot write the batches there ({exc.strerror or exc}); "
                             f"free space or set {key} elsewhere") from None


def load_batches(folder: str | Path, timeout_s: float, key: str = "batch.load"
                 ) -> tuple[RolloutBatch, RolloutBatch, dict | None]:
    """(E, U, fingerprint or None for an old folder) read under the folder's lock; an E.pt / U.pt
    that is not the file the fingerprint recorded is refused (``InputFileError`` naming it)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{key}={folder}: no such folder; give a folder written with batch.save")
    with file_lock(folder / LOCK, timeout_s, f"loading batches from {folder}"):
        _recover(folder)
        todo = f"sample anew (drop {key}) or save the batches again with batch.save"
        E, U = RolloutBatch.load(folder / "E.pt", todo), RolloutBatch.load(folder / "U.pt", todo)
        meta = load_json_file(folder / META, "the batches' fingerprint", todo) if (folder / META).is_file() else None
        sums = meta.get("sha256") if isinstance(meta, dict) else None
        for name in ("E.pt", "U.pt") if isinstance(sums, dict) else ():
            if hash_file(folder / name) != sums.get(name):
                raise InputFileError(f"{folder / name}: not the file {META} beside it recorded (its sha256 "
                                     "differs: another run's batch copied in, or an edited file); put the "
                                     f"saved pair back whole, or {todo}")
    return E, U, meta


# ----------------------------------------------------------------------------- checks
def check_saved(src: Path, E: RolloutBatch, U: RolloutBatch, meta: dict | None, cfg: EntprobeConfig,
                identity: dict | None = None) -> None:
    """Saved batches must be what the config would sample: the same G, B_E / B_U, temperature (the
    log-probs every estimate uses are those of the sampling distribution) from the tensors, then
    every key of ``sampled_keys`` the fingerprint holds (a key it lacks reads as its behaviour
    before it was recorded) and (``identity``) the same model and tokenizer."""
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
    if isinstance(meta.get("task"), dict):  # saved before a task key existed: that key's then behaviour
        meta = {**meta, "task": {**_TASK_BEFORE, **meta["task"]}}
    for name, (cfg_key, want) in sampled_keys(cfg).items():
        if name not in meta or meta[name] == want or name in ("G", "B_E", "B_U", "temperature"):
            continue  # absent (saved before adv_eps / E_drawn were recorded): not compared, as then;
            # the tensors' G, B, temperature are checked above
        if name == "adv_eps" and b.advantage.value != "grpo":
            continue  # dr_grpo advantages do not involve it
        if name == "E_drawn":
            if want and meta[name] is False:
                raise ConfigError(f"batch.load={src}: the saved E is U (saved by a single_batch run without "
                                  "importance sampling), this run needs E drawn on its own (probe.mode="
                                  f"{cfg.probe.mode.value}, importance.enabled={cfg.importance.enabled}); "
                                  "sample anew or load batches saved by such a run")
            continue
        raise ConfigError(f"batch.load={src}: the batches were sampled with {cfg_key}={meta[name]}, the "
                          f"config says {cfg_key}={want}; set it to match or sample anew")
    ident = identity if identity is None or meta.get("digests") == DIGESTS else identity.get("before", identity)
    for key, what in (("model", "model weights"), ("tokenizer", "tokenizer")):
        if ident and key in meta and meta[key] != ident[key]:
            raise ConfigError(f"batch.load={src}: the batches were sampled by other {what} (fingerprint "
                              f"{meta[key]}, this run's {ident[key]}): they are not samples of this "
                              "policy; load the model they came from (model.*) or sample anew")
    unseen = (identity or {}).get("before", {}).get("unseen")
    if unseen and meta.get("digests") != DIGESTS and ("model" in meta or "tokenizer" in meta):
        # equal, but its chunks of a file over 1 MiB miss the bytes between them: a changed model matches too
        raise ConfigError(f"batch.load={src}: {META} predates whole-file digests: it fingerprinted the model by "
                          f"{_CHUNKS} chunks of each file, which do not cover {unseen} (over "
                          f"{_CHUNKED_SEES >> 20} MiB), so it cannot tell whether the model changed since; save "
                          "the batches again from the model they came from, with the same model, task and "
                          f"sampling keys: {resave_overrides(cfg)} (batch.load dropped), then batch.load=DIR")


def check_tokens(src: Path, E: RolloutBatch, U: RolloutBatch, vocab_size: int | None) -> None:
    """Every token id of E and U is one of the model's ``vocab_size`` ids (``InputFileError``
    naming the file: batches of another model's vocabulary would index out of its embeddings)."""
    for name, batch in (("E.pt", E), ("U.pt", U)):
        top = int(batch.input_ids.max()) if batch.input_ids.numel() else 0
        if vocab_size is not None and top >= vocab_size:
            raise InputFileError(f"{Path(src) / name}: token id {top} is outside this model's vocabulary "
                                 f"(0..{vocab_size - 1}): the batches were sampled with another tokenizer; "
                                 "load the model they came from or sample anew")
