"""The whole probe (Stages 1-3) in training-step units, measured beside one training step.

One *unit* is one training step over E ∪ U without its sampling: a forward+backward of the DR-GRPO
loss with the probe's microbatching (``mb_size_prompts`` prompts per microbatch, the same
teacher-forced log-prob path) and the optimizer's ``step()``. The ratios without the step (the
definition before it was counted, ``fwd+bwd units``) are printed beside. In one process, on the
same sampled batches, each repetition runs, in this order:

- ``sample``: E and U drawn as the job draws them (``sample_global``, the config's seeds: the
  same batches again, which the script checks), so that the job's memory and time include its
  sampling (``--no-sample`` skips it);
- ``train``: the forward+backward;
- ``step``: the AdamW ``step()`` alone (on zero gradients; a snapshot taken before and restored
  after, outside the timed block);
- ``probe``: ``run_two_batch`` as configured (default ``projection=auto``: Stage 1 with the
  per-unit projections of the path it picks, docs/variance.md; ground truth stepping from the
  stored ``-Ybar_raw``: snapshot, AdamW step, E at theta_plus, IS, step split, restore);
- ``literal``: the spec-literal schedule, ``probe.projection=backward`` (a backward per
  unit and a parameter-sized host transfer per unit) and ``importance.reuse_probe_gradient=false``
  (a separate update pass over U).

Units are medians over ``--reps`` interleaved repetitions, taken within this run, after one
unrecorded warm-up repetition (the first probe call costs several times a later one). On CPU the clock
is the process's CPU time (``OMP_NUM_THREADS=1`` is the default here), so that other users' load on
a shared machine does not enter the ratios; wall-clock ratios are printed beside. Phase breakdowns
are the phases' shares of the probe's wall time times its units. Peak memory of each block is the increase of the process high-water mark over the RSS at
the block's start (CPU: ``VmHWM`` reset through ``/proc/self/clear_refs``, with
``MALLOC_MMAP_THRESHOLD_=131072`` so RSS follows live tensors; CUDA: ``max_memory_allocated``);
its absolute peak (the memory at its start plus that rise) is what the process held at the block's
high point. The *job's peak* is the larger of the ``sample`` and ``probe`` blocks' absolute
peaks (a job samples, then probes), printed beside a training step's (the ``train`` block's, with
the weights and AdamW state held; the ``step`` block's also holds this script's snapshot) and, with
``--trl``, beside a TRL ``GRPOTrainer`` process's whole-process peak on the same
model and batch sizes (B_U prompts x G a step, the same new tokens and lr, TRL's defaults: gradient
checkpointing on; a fresh interpreter, 2 steps; grpo_setup.py's ``build_trainer``), against the
goal of at most 1.5 times TRL's. Model loading is outside every block (the process's high-water
mark, which includes it, is printed too: ``/usr/bin/time -v`` reads only the last block's, since
the resets lower the kernel's record); no fresh-sample fallback runs (resample=None).

SmolLM2 ships without optimizer state: the script gives it a real AdamW state from one step (mean
token NLL of a separate sampled batch; lr 1e-5, weight decay 0.01), so the probe runs in Adam
geometry with a real AdamW step (taken before E and U are drawn, so they are sampled at the
weights the probe runs at). Its E/U seeds are swapped (U = seed 1) so that U holds a reward.

    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py                      # default model, ~1 min
    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py --model smollm2 --reps 3   # ~15 min on 2 cores
    python benchmarks/bench_probe.py --model default -- batch.B_E=16 batch.B_U=16  # extra overrides
    python benchmarks/bench_probe.py --model smollm2 --default-malloc   # allocation costs as a user's run
    python benchmarks/bench_probe.py --model smollm2 --compare ghost --no-literal   # auto's path beside ghost
    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py --model smollm2 --reps 2 --trl  # and TRL's process peak

Also printed: the *floor*, what any probe of this design pays whatever its per-prompt path: the
``train`` block (a forward+backward over E ∪ U: the probe's Y and X passes repeat it) plus the
probe's own ground-truth phases (snapshot, AdamW step, E at theta_plus, restore), and the probe's
excess over it.

Exits 0 whatever the ratio (a measurement); ``--target`` (default 2.0) only labels the line.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import PeakMemory, bench_args, compose, reexec_with_bench_env, training_unit

MODELS = {
    "default": [],
    "smollm2": ["model=smollm2", "batch.B_E=4", "batch.B_U=4", "batch.G=4", "sampling.max_new_tokens=8",
                "optimizer.lr=1e-5", "batch.seed_E=2", "batch.seed_U=1"],  # seed 2's U has no reward
}
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false"]


# ---------------------------------------------------------------- set-up
def adamw_state(cfg, lm, task, ctx):
    """An AdamW state from one real step on a batch disjoint from E and U (seed 3). The loss is the
    mean token NLL of the sampled responses: SmolLM2 rarely earns an arithmetic reward, and a
    DR-GRPO step on an all-zero-reward batch has a zero gradient (exp_avg_sq = 0, P = 1/eps)."""
    from entprobe.math import paramvec as pv
    from entprobe.pipeline.geometry import Geometry
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    b = cfg.batch
    lr = cfg.optimizer.lr or 1e-5
    idx = draw_prompt_indices(len(task.prompts), b.B_U, 3)
    W = sample_batch(lm.model, lm.tokenizer, task, idx, b.G, cfg.sampling, 3, b.advantage.value, b.adv_eps,
                     cfg.task.chat_template.value, cfg.task.system_prompt)
    opt = torch.optim.AdamW(ctx.params, lr=lr, weight_decay=0.01)
    n_tok = float(W.response_mask.sum())
    for _, mb in ctx.iterate(W, ctx.mb_size, "state"):
        S, _, _ = ctx.forward_S(mb, "adamw state")
        (-S.sum() / n_tok).backward()
    opt.step()
    ctx.zero_grad()
    st = [opt.state[p] for p in ctx.params]
    P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], 1, 0.999, 1e-8, ctx.buffers_device,
                               ctx.buffers_dtype)
    return Geometry(opt, lr, P)


def build(model: str, extra: list[str]):
    from entprobe.pipeline.run_batches import get_batches
    from entprobe.pipeline.geometry import build_geometry
    from entprobe.cli.probe_job import load_probe
    from entprobe.config import ConfigError
    from entprobe.checkpoints.preflight import check_inputs

    cfg = compose(COMMON + MODELS[model] + extra)
    try:
        inputs = check_inputs(cfg)
    except ConfigError:  # no optimizer state: the checks of an SGD-geometry run; adamw_state below
        inputs = check_inputs(compose(COMMON + MODELS[model] + extra + ["optimizer.preconditioner=identity"]))
    torch.manual_seed(cfg.seed)
    lm, task, ctx = load_probe(cfg)
    # a model without optimizer state (SmolLM2's GGUF, a bare HF folder) gets one from a real step,
    # taken before E and U are drawn: they are sampled at the weights the probe runs at, as in a job
    has_state = inputs.optimizer_state is not None
    geo = build_geometry(cfg, lm, ctx.params, ctx.buffers_device, inputs.optimizer_state)[0] if has_state \
        else adamw_state(cfg, lm, task, ctx)
    E, U = get_batches(cfg, lm, task, ctx, inputs)[:2]
    return cfg, lm, task, ctx, E, U, geo


def same_tokens(got, want) -> bool:
    """Whether two (E, U) pairs hold the same responses (sampling is keyed by seed: it should)."""
    return all(a.input_ids.shape == b.input_ids.shape and torch.equal(a.input_ids, b.input_ids)
               for a, b in zip(got, want))


def trl_process(model: str, r: dict, steps: int = 2) -> dict:
    """A TRL ``GRPOTrainer`` training process on the same model and batch sizes (online_probe.py's
    ``build_trainer``: B_U prompts x G responses a step, the same new tokens, lr, CPU, TRL's defaults
    otherwise: gradient checkpointing on, no reference model), ``steps`` steps in a fresh
    interpreter under this process's environment: its whole-process peak (``VmHWM``, MiB) and CPU
    seconds of ``train()``."""
    spec = {"model": model, "steps": steps, "prompts_per_step": r["B_U"], "G": r["G"],
            "max_new": r["max_new_tokens"], "lr": r["lr"]}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        proc = subprocess.run([sys.executable, __file__, "--trl-child", json.dumps(spec), str(out)],
                              capture_output=True, text=True)  # TRL's per-step logs are not this script's
        if proc.returncode != 0:
            raise RuntimeError(f"the TRL process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {**spec, **json.loads(out.read_text())}


def trl_model(model: str, overrides: list[str]) -> str:
    """What the TRL process trains: ``model.path=DIR`` among the overrides (a checkpoint folder,
    random_checkpoint.py's), else ``model`` (``default`` or ``smollm2``)."""
    paths = [o.split("=", 1)[1] for o in overrides if o.startswith("model.path=")]
    return paths[-1] if paths else model


def trl_child(spec: dict, out: str) -> None:
    """``trl_process``'s child: build the trainer, train, write the peak and CPU seconds to ``out``."""
    from _common import proc_kb
    from grpo_setup import build_trainer

    with tempfile.TemporaryDirectory() as tmp:
        tr = build_trainer(tmp, spec["steps"], model=spec["model"], prompts_per_step=spec["prompts_per_step"],
                           G=spec["G"], max_new=spec["max_new"], lr=spec["lr"])
        c0 = time.process_time()
        tr.train()
        cpu = time.process_time() - c0
    Path(out).write_text(json.dumps({"peak_mib": proc_kb("VmHWM") / 1024, "train_cpu_s": cpu}))


# ---------------------------------------------------------------- the blocks
def optimizer_step_block(ctx, geo):
    """``(fn, undo)``: the optimizer's ``step()`` on zero gradients as a timed block, and the call that puts the
    parameters and the optimizer's state back as they were before it (a snapshot taken now, on the CPU,
    outside the timed block) and clears the gradients."""
    from entprobe.pipeline.stages.snapshot import restore, take

    snap = take(ctx.params, geo.optimizer, torch.device("cpu"))
    for p in ctx.params:
        p.grad = torch.zeros_like(p)

    def undo():
        ctx.zero_grad()
        restore(ctx.params, geo.optimizer, snap)
    return geo.optimizer.step, undo


def timed(fn, device) -> tuple[float, float, tuple[float, float], object]:
    """(wall seconds, process CPU seconds, (peak MiB over the start, absolute peak MiB), result) of ``fn()``."""
    with PeakMemory(device) as mem:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, (mem.mib, mem.abs_mib), out


def bench(model: str, reps: int, extra: list[str], compare: tuple[str, ...] = (), literal: bool = True,
          sample: bool = True) -> dict:
    from entprobe.config import ProjectionMode
    from entprobe.pipeline.modes.two_batch import run_two_batch
    from entprobe.pipeline.run_batches import sample_global
    from entprobe.pipeline.stages.context import PhaseStats

    cfg, lm, task, ctx, E, U, geo = build(model, extra)
    schedules = {"probe": (cfg.probe, cfg.importance)}
    for proj in compare:  # the same probe with another projection path, in the same repetitions
        schedules[f"p:{proj}"] = (dataclasses.replace(cfg.probe, projection=ProjectionMode(proj)), cfg.importance)
    if literal:
        schedules["literal"] = (dataclasses.replace(cfg.probe, projection=ProjectionMode.backward),
                                dataclasses.replace(cfg.importance, reuse_probe_gradient=False))
    blocks = (*(("sample",) if sample else ()), "train", "step", *schedules)
    wall, cpu, mem, mem_abs = ({k: [] for k in blocks} for _ in range(4))
    phases = {k: [] for k in schedules}
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench_probe_"))
    for rep in range(reps + 1):  # interleaved, so that a change of machine load hits every block
        if rep == 1:  # the first repetition warms up (lazy initialisation, first-call allocations)
            for d in (wall, cpu, mem, mem_abs, phases):
                for v in d.values():
                    v.clear()
        for name in blocks:
            if name == "sample":  # E and U drawn as the job draws them (the same seeds: the same batches)
                c = dataclasses.replace(ctx, stats=PhaseStats())
                fn = lambda c=c: sample_global(cfg, lm, task, c)  # noqa: E731
            elif name == "train":
                fn = lambda: training_unit(ctx, E, U)  # noqa: E731
            elif name == "step":
                fn, undo = optimizer_step_block(ctx, geo)
            else:
                c = dataclasses.replace(ctx, stats=PhaseStats())
                fn = lambda c=c, pi=schedules[name]: run_two_batch(c, E, U, geo, *pi, tmp)  # noqa: E731
            w, t, (mib, abs_mib), res = timed(fn, lm.device)
            if name == "step":
                undo()
                del undo
            print(f"[bench_probe] repetition {rep}{' (warm-up)' if rep == 0 else ''}: {name} {t:.1f} CPU s, "
                  f"{w:.1f} wall s, peak +{mib:.0f} MiB ({abs_mib:.0f} MiB held at its high point)", flush=True)
            wall[name].append(w)
            cpu[name].append(t)
            mem[name].append(mib)
            mem_abs[name].append(abs_mib)
            if name == "sample":
                results[name] = same_tokens(res, (E, U))
            if name in schedules:
                phases[name].append({p: sec / w for p, sec in c.stats.seconds.items()})  # share of wall
                results[name] = res
            del res  # the sampled batches: not held into the next block
    # On CPU the process's CPU time is the clock (other users' load does not count; the runs are
    # single-threaded with OMP_NUM_THREADS=1); on CUDA the wall clock.
    clock = cpu if lm.device.type == "cpu" else wall
    fwd_bwd = statistics.median(clock["train"])
    unit = fwd_bwd + statistics.median(clock["step"])
    step_of = [t + st for t, st in zip(clock["train"], clock["step"])]  # per repetition
    wall_unit = statistics.median(wall["train"]) + statistics.median(wall["step"])
    units = {k: statistics.median(v) / unit for k, v in clock.items()}
    return {"model": model, "device": str(lm.device), "reps": reps, "clock": "cpu" if clock is cpu else "wall",
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
            "n_params": sum(p.numel() for p in ctx.params),
            "B_E": E.B, "B_U": U.B, "G": E.G, "max_new_tokens": cfg.sampling.max_new_tokens,
            "lr": cfg.optimizer.lr or 1e-5, "T_E": E.input_ids.shape[-1], "T_U": U.input_ids.shape[-1],
            "mb_size_prompts": ctx.mb_size, "optimizer_step_s": statistics.median(clock["step"]),
            "fwd_bwd_s": fwd_bwd, "unit_s": unit,
            "fwd_bwd_units": {k: statistics.median(v) / fwd_bwd for k, v in clock.items()},
            "U_frac_zero_var_groups": U.stats("U")["U/frac_zero_var_groups"],
            "units": units,
            "paired_units": {k: statistics.median(x / t for x, t in zip(v, step_of)) for k, v in clock.items()},
            "wall_units": {k: statistics.median(v) / wall_unit for k, v in wall.items()},
            "wall_s": wall, "cpu_s": cpu, "peak_mib": {k: max(v) for k, v in mem.items()},
            "peak_abs_mib": {k: max(v) for k, v in mem_abs.items()},
            "process_peak_mib": PeakMemory.process_mib(lm.device), "sampled_same_batches": results.get("sample"),
            "phase_units": {k: {p: statistics.median(r[p] for r in v) * units[k] for p in v[0]}
                            for k, v in phases.items()},
            "check": {k: {q: results[k].get(q) for q in ("deltaH1", "deltaH_true", "deltaH1_step", "ESS_frac",
                                                        "SE_deltaH1")} for k in schedules}}


def report(r: dict) -> None:
    print(f"\n== {r['model']} on {r['device']}: {r['n_params']:,} params; B_E={r['B_E']} B_U={r['B_U']} "
          f"G={r['G']} T_E={r['T_E']} T_U={r['T_U']} mb_size_prompts={r['mb_size_prompts']}; "
          f"U groups with zero reward variance {r['U_frac_zero_var_groups']:.2f}; median of {r['reps']}; "
          f"MALLOC_MMAP_THRESHOLD_ {r['malloc_mmap_threshold']}")
    print(f"1 unit (a training step over E ∪ U) = {r['unit_s']:.3f} s ({r['clock']} time): fwd+bwd "
          f"{r['fwd_bwd_s']:.3f} s + AdamW step {r['optimizer_step_s']:.3f} s")
    print(f"{'block':<11}{'units':>7}{'paired':>8}{'wall':>7}{'fwd+bwd':>9}{'peak MiB':>10}   "
          f"{r['clock']} s / wall s per repetition")
    for k in r["units"]:
        per = " ".join(f"{c:.2f}/{w:.2f}" for c, w in zip(r[f"{r['clock']}_s"][k], r["wall_s"][k]))
        print(f"{k:<11}{r['units'][k]:>7.2f}{r['paired_units'][k]:>8.2f}{r['wall_units'][k]:>7.2f}"
              f"{r['fwd_bwd_units'][k]:>9.2f}{r['peak_mib'][k]:>10.1f}   {per}")
    print(f"  units: median {r['clock']} time / (train + step medians); paired: median of per-repetition "
          "ratios; wall: the same from wall-clock medians; fwd+bwd: over the train block alone")
    for k, ph in r["phase_units"].items():
        print(f"  {k} phases (units, wall shares x total): " + ", ".join(f"{p} {u:.2f}" for p, u in ph.items()))
    for k, c in r["check"].items():
        print(f"  {k}: " + ", ".join(f"{q}={v:.4g}" for q, v in c.items() if v is not None))
    memory_report(r)


def memory_report(r: dict) -> None:
    """The whole job's peak (sampling included) beside a training step's and, when measured, a TRL
    training process's: each block's absolute peak is what the process held at the block's high
    point (its memory at the start plus the ``peak MiB`` rise)."""
    a = r["peak_abs_mib"]
    print("  process memory at each block's high point (MiB; its start plus its rise): " +
          ", ".join(f"{k} {v:.0f}" for k, v in a.items()))
    job = max(a[k] for k in ("sample", "probe") if k in a)
    train = a["train"]  # the step block's absolute peak also holds this script's snapshot: not a trainer's
    parts = "sampling E and U, then the probe" if "sample" in a else "the probe; sampling not measured, --no-sample"
    print(f"  the job's peak ({parts}): {job:.0f} MiB; a training step's (the train block, with the weights and "
          f"AdamW state held): {train:.0f} MiB; job / training step {job / train:.2f}; this process's high-water "
          f"mark (loading and set-up included) {r['process_peak_mib']:.0f} MiB")
    if r.get("sampled_same_batches") is not None:
        print(f"  the sample block drew the probe's batches again: {'yes' if r['sampled_same_batches'] else 'NO'}")
    trl = r.get("trl")
    if trl:
        print(f"  TRL GRPOTrainer process ({trl['prompts_per_step']} prompts x G={trl['G']}, {trl['max_new']} new "
              f"tokens, {trl['steps']} steps, TRL's defaults): peak {trl['peak_mib']:.0f} MiB; the job's peak / "
              f"TRL's {job / trl['peak_mib']:.2f} (goal <= 1.5)")
    else:
        print(f"  against the goal (<= 1.5x a TRL training process's peak): not measured here (--trl); against "
              f"the train block {job / train:.2f}")


def own_args() -> argparse.Namespace:
    """This script's options beside ``bench_args``' (taken out of ``sys.argv``): ``--compare PROJ``
    (also time the probe with ``probe.projection=PROJ``, e.g. ghost, in the same repetitions),
    ``--no-literal`` (skip the spec-literal schedule), ``--no-sample`` (skip the sampling block) and
    ``--trl`` (measure a TRL GRPOTrainer process's peak on the same model and batch sizes: CPU,
    ``--model default`` or ``smollm2``, or the folder of a ``model.path=DIR`` override)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--compare", nargs="+", default=[], choices=["stored", "fused", "jvp", "ghost", "backward"])
    ap.add_argument("--no-literal", action="store_true")
    ap.add_argument("--no-sample", action="store_true")
    ap.add_argument("--trl", action="store_true")
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    own, rest = ap.parse_known_args(sys.argv[1:cut])
    sys.argv[1:cut] = rest
    return own


def main() -> int:
    reexec_with_bench_env()
    if sys.argv[1:2] == ["--trl-child"]:  # trl_process's child: a TRL training process of its own
        trl_child(json.loads(sys.argv[2]), sys.argv[3])
        return 0
    own = own_args()
    a = bench_args(__doc__, MODELS, "default", 5, 2.0, "probe budget in units")
    out = []
    for m in a.model:
        r = bench(m, a.reps, a.overrides, tuple(own.compare), not own.no_literal, not own.no_sample)
        if own.trl:  # this process's model and batches freed first: the TRL process runs beside it
            gc.collect()
            r["trl"] = trl_process(trl_model(m, a.overrides), r)
        report(r)
        out.append(r)
        for k in r["units"]:
            if k == "probe" or k.startswith("p:"):
                print(f"  {k} {r['units'][k]:.2f} units vs target {a.target}: "
                      f"{'within' if r['units'][k] <= a.target else 'over'}")
        gt = sum(u for ph, u in r["phase_units"].get("probe", {}).items() if ph.startswith("gt_"))
        floor = r["units"]["train"] + gt
        print(f"  floor {floor:.2f} units: the train block's forward+backward over E ∪ U "
              f"({r['units']['train']:.2f}), which any probe repeats as its Y and X passes, plus the probe's "
              f"ground truth ({gt:.2f}: snapshot, AdamW step, E at theta_plus, restore); the probe's excess "
              f"over it {r['units']['probe'] - floor:.2f} (per-prompt projections, variance, the update's "
              "construction)")
        if "literal" in r["units"]:
            print(f"  spec-literal / probe = {r['units']['literal'] / r['units']['probe']:.2f}")
        gc.collect()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0  # a measurement, not a test: the ratio is printed, never judged by the exit status


if __name__ == "__main__":
    sys.exit(main())
