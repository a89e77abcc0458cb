"""What the benchmark scripts share: the training-step unit, peak-memory measurement, the
environment they re-execute under, and their command line."""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
from pathlib import Path

import torch


def proc_kb(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


class PeakMemory:
    """Peak increase (MiB) over the memory in use when the block starts: on CPU ``VmHWM`` reset
    to ``VmRSS`` through ``/proc/self/clear_refs``; on CUDA ``max_memory_allocated``. Also
    ``abs_mib``, the block's peak in absolute terms (the memory in use at its start plus the
    increase: what the process held at the block's high point), and, across every block of the
    process, ``PeakMemory.process_mib()``: the process's high-water mark since it started, which the
    resets would otherwise lose (what ran between blocks, model loading and sampling included)."""

    _seen_hwm = 0  # the largest high-water mark read before a reset or at a block's end (CPU kB, CUDA bytes)

    def __init__(self, device: torch.device):
        self.device, self.mib, self.abs_mib = device, float("nan"), float("nan")

    @classmethod
    def _note(cls, device: torch.device) -> None:
        hwm = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else proc_kb("VmHWM")
        cls._seen_hwm = max(cls._seen_hwm, hwm)

    @classmethod
    def process_mib(cls, device: torch.device) -> float:
        """The process's peak so far in MiB (CPU: resident set; CUDA: allocated), resets included."""
        cls._note(device)
        return cls._seen_hwm / (2**20 if device.type == "cuda" else 1024)

    def __enter__(self):
        gc.collect()
        self._note(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = proc_kb("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.mib, self.abs_mib = (peak - self.base) / 2**20, peak / 2**20
        else:
            peak = proc_kb("VmHWM")
            self.mib, self.abs_mib = (peak - self.base) / 1024, peak / 1024
        self._note(self.device)


def training_unit(ctx, E, U) -> None:
    """The unit: one forward+backward of the DR-GRPO loss over E ∪ U, microbatched like the probe."""
    from entprobe.math.estimators import y_loss

    ctx.zero_grad()
    n = E.B + U.B
    for batch in (E, U):
        for start, mb in ctx.iterate(batch, ctx.mb_size, "train"):
            S, _, _ = ctx.forward_S(mb, f"train [{start}, {start + mb.B})")
            (-y_loss(S, mb.advantages.to(S.device), mb.Lmax.to(S.device)) / n).backward()
    ctx.zero_grad()


def reexec_with_bench_env(omp_threads: bool = True) -> None:
    """Restart the interpreter once with ``MALLOC_MMAP_THRESHOLD_=131072`` (RSS follows live
    tensors) and, unless told otherwise, ``OMP_NUM_THREADS=1`` (CPU time = one thread's work);
    torch and glibc read both at start-up. Values already set are kept.

    ``--default-malloc`` on the command line keeps glibc's own threshold: with the pinned one
    every tensor above 128 KiB is a fresh mapping whose pages fault in on first touch, which a
    normal run pays only above 32 MiB. Parameter-sized temporaries then cost more than they do
    for a user, and the probe has more of them than a training step; peak memory reads looser
    (freed heap memory stays resident)."""
    malloc = "--default-malloc" not in sys.argv
    want = {**({"MALLOC_MMAP_THRESHOLD_": "131072"} if malloc else {}),
            **({"OMP_NUM_THREADS": "1"} if omp_threads else {})}
    if all(k in os.environ for k in want):
        return
    for k, v in want.items():
        os.environ.setdefault(k, v)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def bench_args(doc: str, models, default_model: str, reps: int, target: float, target_help: str):
    """The scripts' common command line: --model, --reps, --target, --json, Hydra overrides."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=[default_model], choices=list(models))
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--target", type=float, default=target, help=target_help)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's mmap threshold (times as a user's run; looser peak memory)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    return ap.parse_args()


def compose(overrides: list[str]):
    """The typed config the CLI would build from the package's conf/ and ``overrides``."""
    from importlib import resources

    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from entprobe.config import register_configs
    from entprobe.cli.probe_job import to_typed

    register_configs()
    GlobalHydra.instance().clear()
    conf = str(resources.files("entprobe") / "conf")
    try:
        with initialize_config_dir(version_base="1.3", config_dir=conf):
            return to_typed(hcompose(config_name="config", overrides=overrides))
    finally:
        GlobalHydra.instance().clear()
