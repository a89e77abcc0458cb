"""Stages 1-2 of the two-batch probe, computed once per sweep and shared by the jobs that differ
only in the lr.

Everything the two-batch probe computes before the ground truth is independent of the lr or
linear in it (``Stage12``): Ybar, Xbar, the per-parameter ``Xbar . P Ybar`` terms, the entropy and
log-probs of E and U, and each unit's projection onto ``P Ybar`` / ``P Xbar`` do not involve the
lr; the update's parts and its Jacobian are ``lr`` times something that does not (math/adamw.py:
AdamW's every part is ``lr / bc1`` or ``lr wd`` times a function of Ybar and the state; SGD's and
``preconditioned_sgd``'s are ``lr`` times one). So the prediction, its SEs and deltaH1 at another
lr are the stored numbers rescaled (``Stage12.at_lr``). The ground truth (one real step at the
job's lr, then importance sampling over E) runs in every job, on the stored Ybar and Xbar.

On disk, in a sweep's batch cache (reporting/sweep.py)::

    batch_cache/<batch key>/stage12/<key>/
        entry.json   what the entry was computed from (``key``), at which lr, CRC-32 checksums
        buffers.pt   Xbar and Ybar: 2 x parameters x probe.buffers_dtype bytes (1.1 GB for
                     SmolLM2-135M in fp32); the rest is per-prompt and a few KB
        values.pt    everything else in ``Stage12``
    batch_cache/<batch key>/stage12/<key>.lock

The key is everything the job's Stage 1-2 numbers depend on except ``optimizer.lr``: the whole
config (less ``optimizer.lr``, ``run_dir``, ``logging``, ``batch.save`` / ``batch.load`` -- the E
and U batches enter by their contents -- ``batch.lock_timeout_s`` and the switch itself), the
full-content sha256 of the model / tokenizer files and of the optimizer, scheduler and trainer
state files (``state_files_digest``), the batches' contents, the devices and dtypes
the passes run in, the world size and the entprobe source. The first job takes the lock, computes
and writes (``entry.json`` last, every file atomically); the others wait on the lock, verify the
entry (the key in full, the checksums -- of Xbar's and Ybar's bytes once loaded, so the big file
is read once -- and the parameter shapes) and load it. An entry that fails a check is reported
and recomputed in its place.

Shared only where the rescaling is exact up to rounding: one process (under torchrun each rank
holds its own shard of the per-prompt values: off), the two-batch mode, and an update in closed
form (AdamW, SGD; with gradient clipping too, whose factor ``min(1, c / (||Ybar|| + 1e-6))`` does
not depend on the lr: math/adamw.py) or ``preconditioned_sgd`` (the optimizer's own step -- other
optimizers -- is a difference of two parameter vectors, linear in lr only up to the parameters'
rounding).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import warnings
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from entprobe.runtime import distributed as D
from entprobe.math import paramvec as pv
from entprobe.runtime.atomic_io import torch_save_atomic, write_json_atomic
from entprobe.rollouts.saved_batches import file_digest
from entprobe.runtime.locks import file_lock
from entprobe.checkpoints.preflight import CheckedInputs
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.prediction import LINEAR_IN_LR, step_model_kind

FORMAT = 2  # of the files below; part of the key
SUBDIR = "stage12"
ENTRY, BUFFERS, VALUES = "entry.json", "buffers.pt", "values.pt"
_READ = 1 << 24


@dataclass
class Stage12:
    """What the two-batch probe computes before the ground truth, at ``lr``.

    Independent of the lr: Ybar, Xbar (buffers device), the per-parameter terms of
    ``Xbar . P Ybar``, the norms, the dot over never-updated coordinates, the local E / U
    log-probs and entropies, column 0 of ``a`` (``X_u . P Ybar``) and of ``b`` (``Y_v . P Xbar``).
    Linear in the lr: ``step_dots`` (``Xbar . Delta theta_part``), ``step_terms`` (per parameter
    tensor, ``Xbar_i . Delta theta_i``), ``a[:, 1:]`` (``X_u . Delta theta_part``) and ``b[:, 1:]``
    (``Y_v . J Xbar``). ``a``, ``b``: gathered over ranks, ``b`` linearised by the objective; None
    without the variance."""
    lr: float
    names: list[str]
    Ybar: pv.Buffer
    Xbar: pv.Buffer
    B_E: int
    B_U: int
    S_U: torch.Tensor  # [B_U, G] this rank's U log-probs at theta
    U_token_logp: torch.Tensor  # [B_U, G, T]
    S_E: torch.Tensor  # [B_E, G]
    E_entropy: torch.Tensor | None  # [B_E, G, T]
    terms: torch.Tensor  # per parameter tensor: Xbar . P Ybar
    norm_Xbar: float
    norm_PYbar: float
    no_history_dot: float | None  # Xbar . P Ybar over coordinates Adam never updated
    step_names: list[str]
    step_kind: str
    step_dots: list[float]
    a: torch.Tensor | None  # [B_E, 1 + parts]
    b: torch.Tensor | None  # [B_U, 1 or 2]
    projection: str | None
    unit_backward: str | None  # set when per-unit gradients were taken in the X pass
    step_terms: torch.Tensor  # per parameter tensor: Xbar . Delta theta (all parts; the attribution)
    E_token_logp: torch.Tensor | None = None  # [B_E, G, T] this rank's E token log-probs at theta
    step_facts: dict = dataclasses.field(default_factory=dict)  # the step model's, lr-free (clipping's factor)
    x_constants: tuple[float, float] = (0.0, 1.0)  # X's (kappa, scale) (token_mean's; lr-free): the measured side pairs with them

    def at_lr(self, lr: float) -> "Stage12":
        """The same Stages 1-2 at another lr: the lr-linear values times ``lr / self.lr``."""
        r = lr / self.lr

        def scaled(m: torch.Tensor | None) -> torch.Tensor | None:
            return None if m is None else torch.cat([m[:, :1], m[:, 1:] * r], 1)
        return dataclasses.replace(self, lr=lr, step_dots=[d * r for d in self.step_dots],
                                   a=scaled(self.a), b=scaled(self.b), step_terms=self.step_terms * r)


def _json(obj) -> dict:
    """``obj`` as plain JSON values (Enums by value), so that a stored key compares equal."""
    return json.loads(json.dumps(obj, sort_keys=True, default=lambda v: getattr(v, "value", str(v))))


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of entprobe's own Python sources: an entry written by other code is never read."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def batches_digest(*batches: RolloutBatch) -> str:
    """sha256 of the batches' tensors (tokens, masks, sampler log-probs, rewards, advantages)."""
    h = hashlib.sha256()
    for batch in batches:
        for f in dataclasses.fields(batch):
            v = getattr(batch, f.name)
            h.update(f.name.encode())
            if isinstance(v, torch.Tensor):
                t = v.detach().cpu().contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(repr(v).encode())
    return h.hexdigest()[:16]


STATE_BESIDE = ("scheduler.pt", "trainer_state.json")  # read with the optimizer state (its lr, its step)


def state_files_digest(state: Path | None) -> dict | None:
    """Full-content digests (``saved_batches.file_digest``) of the optimizer state (``optimizer.pt``
    or a sharded trainer's folder, every file under it) and of the scheduler / trainer state beside
    it, by name; None without a state."""
    if state is None:
        return None
    state = Path(state)
    out = {state.name: file_digest(state)}
    for name in STATE_BESIDE:
        if (state.parent / name).is_file():
            out[name] = file_digest(state.parent / name)
    return out


def share_key(cfg, identity: dict, optimizer_file: Path | None, ctx: ProbeContext, E: RolloutBatch,
              U: RolloutBatch) -> dict:
    """Everything the job's Stage 1-2 numbers depend on except the lr (module docstring)."""
    c = dataclasses.asdict(cfg)
    for k in ("run_dir", "logging"):
        c.pop(k)
    c["optimizer"].pop("lr")
    for k in ("save", "load", "lock_timeout_s", "share_across_lr"):  # the batches: by content
        c["batch"].pop(k)
    return _json({"format": FORMAT, "config": c, "identity": {k: v for k, v in identity.items() if k != "before"},
                  "optimizer_files": state_files_digest(optimizer_file),
                  "batches": batches_digest(E, U), "device": str(ctx.device.type),
                  "autocast": str(ctx.autocast_dtype), "buffers": [str(ctx.buffers_device.type),
                                                                    str(ctx.buffers_dtype)],
                  "objective": ctx.objective.name, "world": D.world(), "source": source_digest()})


def why_not_shared(cfg, batch_cache: Path | None, geo, icfg) -> str | None:
    """None when this job can share its Stages 1-2 with the sweep's other lrs, else why not."""
    if not cfg.batch.share_across_lr:
        return "batch.share_across_lr=false"
    if batch_cache is None:
        return "not a sweep (a multirun shares through its batch cache)"
    if D.world() > 1:
        return f"{D.world()} processes (sharing is single-process only)"
    kind = step_model_kind(geo.optimizer, icfg.step_mode.value)
    if kind not in LINEAR_IN_LR:
        return (f"the update is the optimizer's own step ({type(geo.optimizer).__name__}): linear in lr only up "
                "to rounding")
    if any(float(g["lr"]) != geo.lr for g in geo.optimizer.param_groups):
        return "param groups with different lrs"
    return None


def _crc32(chunks) -> str:
    """CRC-32 of a sequence of byte buffers, as 8 hex digits."""
    c = 0
    for b in chunks:
        c = zlib.crc32(b, c)
    return f"{c:08x}"


def tensors_crc32(tensors: list[torch.Tensor]) -> str:
    """CRC-32 of the tensors' bytes in order (CPU tensors): checked after loading, so that a file
    of parameter size is read once."""
    return _crc32(t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors)


def file_crc32(path: Path) -> str:
    with open(path, "rb") as f:
        return _crc32(iter(lambda: f.read(_READ), b""))


@dataclass
class Stage12Share:
    """One entry of the Stage 1-2 cache: ``folder`` (``<batch cache>/stage12/<hash of key>``)."""
    folder: Path
    key: dict
    timeout_s: float

    @classmethod
    def in_cache(cls, batch_cache: Path, key: dict, timeout_s: float) -> "Stage12Share":
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cls(Path(batch_cache) / SUBDIR / digest, key, timeout_s)

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """The entry's lock (``batch.lock_timeout_s``): one job computes, the others wait and load."""
        with file_lock(Path(str(self.folder) + ".lock"), self.timeout_s, f"Stage 1-2 cache {self.folder}"):
            yield

    def load(self, ctx: ProbeContext) -> Stage12 | None:
        """The stored Stages 1-2 at their own lr, or None (nothing there; an entry that fails a
        check is reported: stale or corrupt, it is recomputed)."""
        if not (self.folder / ENTRY).is_file():
            return None
        try:
            st = self._read(ctx)
        except Exception as exc:  # any failure means: recompute
            warnings.warn(f"entprobe: the Stage 1-2 cache entry {self.folder} is not usable "
                          f"({type(exc).__name__}: {exc}); computing it again", stacklevel=2)
            return None
        return st

    def _read(self, ctx: ProbeContext) -> Stage12:
        entry = json.loads((self.folder / ENTRY).read_text())
        if entry.get("key") != self.key:
            diff = sorted(k for k in set(entry.get("key") or {}) | set(self.key)
                          if (entry.get("key") or {}).get(k) != self.key.get(k))
            raise ValueError(f"stale: written for another configuration (differs in {diff})")
        if file_crc32(self.folder / VALUES) != entry["crc32"][VALUES]:
            raise ValueError(f"corrupt: {VALUES} does not match its checksum in {ENTRY}")
        vals = torch.load(self.folder / VALUES, map_location="cpu", weights_only=True)
        bufs = torch.load(self.folder / BUFFERS, map_location="cpu", weights_only=True)
        if tensors_crc32([*bufs["Xbar"], *bufs["Ybar"]]) != entry["crc32"][BUFFERS]:
            raise ValueError(f"corrupt: {BUFFERS} does not match its checksum in {ENTRY}")
        shapes = [tuple(x.shape) for x in bufs["Xbar"]]
        if vals["names"] != ctx.names or shapes != [tuple(p.shape) for p in ctx.params]:
            raise ValueError("stale: its parameters are not this model's trainable parameters")

        def on_device(buf):
            return [t.to(ctx.buffers_device, ctx.buffers_dtype).contiguous() for t in buf]
        return Stage12(Ybar=on_device(bufs["Ybar"]), Xbar=on_device(bufs["Xbar"]), **vals)

    def store(self, st: Stage12) -> None:
        """Write the entry (``entry.json`` last). A failure to write costs the sharing, not the job."""
        try:
            (self.folder / ENTRY).unlink(missing_ok=True)  # a reader never pairs an old entry with new files
            self.folder.mkdir(parents=True, exist_ok=True)
            vals = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name not in ("Xbar", "Ybar")}
            bufs = {"Xbar": [x.detach().cpu() for x in st.Xbar], "Ybar": [y.detach().cpu() for y in st.Ybar]}
            torch_save_atomic(bufs, self.folder / BUFFERS)
            torch_save_atomic(vals, self.folder / VALUES)
            crc = {BUFFERS: tensors_crc32([*bufs["Xbar"], *bufs["Ybar"]]), VALUES: file_crc32(self.folder / VALUES)}
            write_json_atomic({"format": FORMAT, "key": self.key, "lr": st.lr, "crc32": crc,
                               "by": f"pid {os.getpid()} on {socket.gethostname()}"}, self.folder / ENTRY)
        except OSError as exc:
            warnings.warn(f"entprobe: could not write the Stage 1-2 cache entry {self.folder} ({exc}); "
                          "the other lrs of this sweep compute their own", stacklevel=2)


@dataclass
class ShareSource:
    """A sweep job's way to its Stage 1-2 cache: the sweep's batch-cache folder, and the checked
    inputs (``preflight.CheckedInputs``) whose file digests enter the key."""
    batch_cache: Path
    inputs: CheckedInputs


def stage12_share(cfg, source: ShareSource | None, ctx: ProbeContext, geo, E: RolloutBatch,
                  U: RolloutBatch) -> tuple[Stage12Share | None, str | None]:
    """This job's entry of the sweep's Stage 1-2 cache (``source``: None outside a sweep), or
    (None, why not)."""
    why = why_not_shared(cfg, source.batch_cache if source is not None else None, geo, cfg.importance)
    if why is not None:
        return None, why
    state = source.inputs.optimizer_state
    key = share_key(cfg, source.inputs.identity, state.file if state is not None else None, ctx, E, U)
    return Stage12Share.in_cache(source.batch_cache, key, cfg.batch.lock_timeout_s), None
