"""Peak memory of a whole probe against a training process holding the same model, gradients and
AdamW state: the ratio ``probe peak RSS / training peak RSS`` (target <= 2).

Two child processes on the same checkpoint and the same saved batches (each a fresh interpreter,
so each peak is its own):

- ``probe``: ``entprobe.main.run`` as the CLI runs it (check inputs, load, sample E and U and save
  them, the two-batch probe, the ground-truth step and restore, results.json);
- ``train``: what a trainer's process holds for one step on U: the model, the AdamW state loaded
  from the same ``optimizer.pt``, one forward+backward of the DR-GRPO loss over U with the probe's
  microbatching, ``optimizer.step()``.

Each prints its whole-process peak (``VmHWM``), its RSS after imports (the interpreter, torch,
transformers) and the peak above that. In the probe, at every phase's end, the live tensors are
counted by storage (``gc``) and printed in parameter-sized copies (bytes / the trainable
parameters' bytes): what the probe holds between its passes, phase by phase (docs/memory.md lists
each parameter-sized tensor and why it is needed), and the process's high-water mark then (the
phase that first ends at the peak is the one that reached it).

    python benchmarks/bench_footprint.py                                       # built-in default, ~1 min
    python benchmarks/bench_footprint.py --model smollm2                       # ~10 min on 2 cores
    python benchmarks/bench_footprint.py --model smollm2 -- batch.B_E=6 batch.B_U=6 sampling.max_new_tokens=32

``--model smollm2`` reads the HF folder with an AdamW state that ``benchmarks/smollm2_checkpoint.py``
writes (``--ckpt``, default /tmp/smollm2_adamw; built first when missing). Exits 0 whatever the
ratio: a measurement, not a test.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false",
          "logging.verdict=false", "logging.report=false", "model.device=cpu"]
MODELS = {
    "default": [],
    "smollm2": ["model=hf", "batch.B_E=6", "batch.B_U=6", "batch.G=4", "sampling.max_new_tokens=32",
                "optimizer.lr=1e-5"],
}


def proc_kb(key: str) -> int:
    import re
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every reachable CPU tensor (parameters, gradients, optimizer
    state, the probe's buffers, the snapshot); cyclic garbage is collected first."""
    import warnings

    import torch
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        try:
            if obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - some tensor-likes have no storage
            continue
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def counting_phases(copies: dict, sizes: dict | None = None, baseline: int = 0):
    """A replacement for ``ProbeContext.phase`` that records, at each phase's end, the live
    tensors above ``baseline`` bytes in parameter-sized copies into ``copies[phase]``."""
    import contextlib

    from entprobe.pipeline.stages import context
    original = context.ProbeContext.phase

    @contextlib.contextmanager
    def counted(self, name):
        with original(self, name):
            yield
        n = sum(p.numel() * p.element_size() for p in self.params)
        if sizes is not None:
            sizes.update(n_params=sum(p.numel() for p in self.params), param_mib=n / 2**20)
        copies[name] = round((live_tensor_bytes() - baseline) / n, 2)
    return counted


def compose(overrides: list[str]):
    sys.path.insert(0, str(HERE))
    from _common import compose as c
    return c(overrides)


def child_probe(overrides: list[str], out: Path) -> dict:
    """The CLI's run, with the live tensors counted at each phase's end."""
    from entprobe.cli.probe_job import run
    from entprobe.pipeline.stages import context

    base = proc_kb("VmRSS")
    copies: dict[str, float] = {}
    sizes: dict[str, float] = {}
    context.ProbeContext.phase = counting_phases(copies, sizes)
    cfg = compose(overrides + [f"run_dir={out}"])
    res = run(cfg)
    hwm = {k[4:-8]: v for k, v in res.items() if k.startswith("mem/") and k.endswith("_peak_mb")}
    secs = {k[5:-2]: v for k, v in res.items() if k.startswith("time/") and k.endswith("_s")}
    return {"peak_mib": proc_kb("VmHWM") / 1024, "after_imports_mib": base / 1024, **sizes,
            "copies_at_phase_end": copies, "hwm_at_phase_end": hwm, "seconds": secs,
            "deltaH_pred": res.get("deltaH_pred")}


def child_train(overrides: list[str]) -> dict:
    """One training step on U as a trainer's process holds it: model, AdamW state, gradients."""
    from entprobe.pipeline.run_batches import get_batches
    from entprobe.math.estimators import y_loss
    from entprobe.pipeline.geometry import build_geometry
    from entprobe.cli.probe_job import load_probe
    from entprobe.checkpoints.preflight import check_inputs

    base = proc_kb("VmRSS")
    cfg = compose(overrides)
    inputs = check_inputs(cfg)
    lm, task, ctx = load_probe(cfg)
    geo, _ = build_geometry(cfg, lm, ctx.params, ctx.buffers_device, inputs.optimizer_state)
    _, U, _ = get_batches(cfg, lm, task, ctx, inputs)
    ctx.zero_grad()
    for start, mb in ctx.iterate(U, ctx.mb_size, "train"):
        S, _, _ = ctx.forward_S(mb, "train")
        (-y_loss(S, mb.advantages, mb.Lmax) / U.B).backward()
    geo.optimizer.step()
    return {"peak_mib": proc_kb("VmHWM") / 1024, "after_imports_mib": base / 1024}


def launch(role: str, overrides: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = out / f"{role}.json"
    subprocess.run([sys.executable, __file__, "--child", role, "--out", str(out), "--", *overrides],
                   check=True, env=env)
    return json.loads(res.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=list(MODELS))
    ap.add_argument("--ckpt", default="/tmp/smollm2_adamw")
    ap.add_argument("--child", default=None, choices=("probe", "train"))
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.child:
        out = Path(a.out)
        fig = child_probe(a.overrides, out / "run") if a.child == "probe" else child_train(a.overrides)
        (out / f"{a.child}.json").write_text(json.dumps(fig))
        return
    extra = list(MODELS[a.model])
    if a.model == "smollm2":
        if not (Path(a.ckpt) / "optimizer.pt").is_file():
            subprocess.run([sys.executable, str(HERE / "smollm2_checkpoint.py"), "--out", a.ckpt], check=True)
        extra += [f"model.path={a.ckpt}", f"optimizer.state_path={a.ckpt}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ov = COMMON + extra + a.overrides
        probe = launch("probe", ov + [f"batch.save={out / 'batches'}"], out)
        train = launch("train", ov + [f"batch.load={out / 'batches'}"], out)
    print(f"model {a.model}: {probe['n_params']:,} trainable parameters ({probe['param_mib']:.0f} MiB fp32)")
    print(f"{'process':<8}{'peak MiB':>10}{'after imports':>15}{'above imports':>15}")
    for name, f in (("train", train), ("probe", probe)):
        print(f"{name:<8}{f['peak_mib']:>10.0f}{f['after_imports_mib']:>15.0f}"
              f"{f['peak_mib'] - f['after_imports_mib']:>15.0f}")
    ratio = probe["peak_mib"] / train["peak_mib"]
    above = (probe["peak_mib"] - probe["after_imports_mib"]) / (train["peak_mib"] - train["after_imports_mib"])
    print(f"probe peak / training-process peak: {ratio:.2f} (above imports: {above:.2f}; target <= 2.0)")
    print("live tensors at each phase's end, in parameter-sized copies: " +
          ", ".join(f"{k} {v}" for k, v in probe["copies_at_phase_end"].items()))
    if probe.get("hwm_at_phase_end"):  # where the peak was reached: the first phase that ends at it
        print("process high-water mark at each phase's end, MiB: " +
              ", ".join(f"{k} {v:.0f}" for k, v in probe["hwm_at_phase_end"].items()))
        print("phase seconds (wall): " + ", ".join(f"{k} {v:.2f}" for k, v in probe["seconds"].items()))


if __name__ == "__main__":
    main()
