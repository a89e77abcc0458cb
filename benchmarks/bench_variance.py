"""Stage 2 (variance) cost in training-step units: every projection path beside the seed's per-unit backward.

One *unit* is one forward+backward of the DR-GRPO loss over E ∪ U with the probe's microbatching
(``mb_size_prompts`` prompts per microbatch, the same teacher-forced log-prob path), no optimizer
step. In one process, on the same sampled batches, each repetition times, in this order:

- ``train``             the unit;
- ``Y_U`` / ``X_E``     the Stage 1 passes without projections (microbatched);
- ``Y_U_keep_loop``     Y over U keeping every unit's gradient, one backward per unit;
- ``Y_U_keep_vmap``     the same from one batched backward per microbatch (``is_grads_batched``);
- ``X_E_fused_loop``    X over E with the per-unit dots ``a_u = X_u . P Ybar``, one backward per unit;
- ``X_E_fused_vmap``    the same from one batched backward per microbatch;
- ``dots_U``            ``b_u = Y_u . P Xbar`` from the kept unit gradients;
- ``jvp_U`` / ``jvp_E`` one forward-mode pass per side, microbatch sized by ``nograd_memory_mb``;
- ``backward``          the seed's path: ``project_backward`` over E and over U (a backward per
  prompt and a parameter-sized copy to the buffers' device per prompt).

The *variance phase* of a path is what it adds to Stage 1 (per repetition, then the median):
``stored``: ``(Y_U_keep - Y_U) + (X_E_fused - X_E) + dots_U`` (loop or vmap per-unit backward);
``fused``: ``(X_E_fused_loop - X_E) + jvp_U``; ``jvp``: ``jvp_E + jvp_U``; ``backward``: ``backward``.
The script prints all of them and which one ``probe.projection=auto`` picks on the model,
and checks that every path gives the backward's a_u, b_u (relative differences printed). Peak memory
of each block is the increase of the high-water mark over the memory in use at the block's start
(CPU: ``VmHWM`` reset through ``/proc/self/clear_refs``, with ``MALLOC_MMAP_THRESHOLD_=131072`` so RSS
follows live tensors; CUDA: ``max_memory_allocated``). One warm-up repetition is not recorded. When
every group of a batch has tied rewards (SmolLM2 on the arithmetic task with 8 new tokens), its
advantages are replaced by seeded centred noise: the cost is the same, and Y, a_u, b_u are then not
identically zero.

    OMP_NUM_THREADS=1 python benchmarks/bench_variance.py                           # builtin, ~1 min
    OMP_NUM_THREADS=1 python benchmarks/bench_variance.py --model smollm2 --reps 3  # ~15 min on 2 cores
    python benchmarks/bench_variance.py -- probe.mb_size_prompts=1            # extra overrides

Exits 0 whatever the ratios (a measurement); ``--target`` (default 0.6) only labels the line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import PeakMemory, bench_args, compose, reexec_with_bench_env, training_unit

MODELS = {  # SmolLM2 ships no optimizer state: SGD geometry (P = identity), as experiment=smollm2_smoke
    "builtin": [],
    "smollm2": ["model=smollm2", "optimizer.preconditioner=identity", "optimizer.lr=1e-5", "batch.B_E=4",
                "batch.B_U=4", "batch.G=4", "sampling.max_new_tokens=8"],
}
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false"]
BLOCKS = ("train", "Y_U", "X_E", "Y_U_keep_loop", "Y_U_keep_vmap", "X_E_fused_loop", "X_E_fused_vmap",
          "dots_U", "jvp_U", "jvp_E", "backward")
PATHS = ("stored/loop", "stored/vmap", "fused", "jvp", "backward")


@contextlib.contextmanager
def measured(device: torch.device, out: dict, name: str):
    """Append (wall seconds, peak MiB over the start) of the block to ``out[name]``."""
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    out.setdefault(name, []).append((seconds, mem.mib))


def build(model: str, extra: list[str]):
    from entprobe.pipeline.geometry import build_geometry
    from entprobe.cli.probe_job import load_probe
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    from entprobe.checkpoints.preflight import check_inputs

    cfg = compose(COMMON + MODELS[model] + extra)
    inputs = check_inputs(cfg)  # the optimizer state (None: SGD geometry), read and checked as a run does
    torch.manual_seed(cfg.seed)
    lm, task, ctx = load_probe(cfg)
    b = cfg.batch
    geo = build_geometry(cfg, lm, ctx.params, ctx.buffers_device, inputs.optimizer_state)[0]

    def draw(B, seed):
        batch = sample_batch(lm.model, lm.tokenizer, task, draw_prompt_indices(len(task.prompts), B, seed), b.G,
                             cfg.sampling, seed, b.advantage.value, b.adv_eps, cfg.task.chat_template.value,
                             cfg.task.system_prompt)
        if (batch.advantages == 0).all():  # every group tied: Y = 0 and the a/b cross-check is vacuous
            A = torch.randn(batch.advantages.shape, generator=torch.Generator().manual_seed(seed))
            batch = dataclasses.replace(batch, advantages=A - A.mean(-1, keepdim=True))
            print(f"[bench] all rewards tied in a batch of {B} prompts: synthetic centred advantages")
        return batch
    return lm, ctx, draw(b.B_E, b.seed_E), draw(b.B_U, b.seed_U), geo


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max().clamp(min=1e-30))


def phase_units(u: dict[str, float]) -> dict[str, float]:
    """The variance phase of every path from one repetition's block units (docstring)."""
    return {"stored/loop": u["Y_U_keep_loop"] - u["Y_U"] + u["X_E_fused_loop"] - u["X_E"] + u["dots_U"],
            "stored/vmap": u["Y_U_keep_vmap"] - u["Y_U"] + u["X_E_fused_vmap"] - u["X_E"] + u["dots_U"],
            "fused": u["X_E_fused_loop"] - u["X_E"] + u["jvp_U"],
            "jvp": u["jvp_E"] + u["jvp_U"],
            "backward": u["backward"]}


def bench(model: str, reps: int, extra: list[str]) -> dict:
    from entprobe.math import paramvec as pv
    from entprobe.config import ProbeConfig
    from entprobe.pipeline.stages import variance
    from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of, y_loss_of
    from entprobe.pipeline.stages.prediction import build_step_model, directions, mul_into

    lm, ctx, E, U, geo = build(model, extra)
    dev = lm.device
    X, Y = x_loss_of(ctx), y_loss_of(ctx)
    rec: dict = {}
    out: dict = {}
    for rep in range(reps + 1):
        if rep == 1:  # drop the warm-up repetition
            rec.clear()
        with measured(dev, rec, "train"):
            training_unit(ctx, E, U)
        with measured(dev, rec, "Y_U"):
            accY = accumulate(ctx, U, Y, "Y over U")
        Ybar = pv.scale_(accY.sum_buf, 1.0 / U.B)
        # the probe's directions: E onto P Ybar and the update's parts, U onto P Xbar and J * Xbar
        step = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, "optimizer", None)
        PY = directions(ctx, [mul_into(Ybar, geo.P)], step, dev)
        with measured(dev, rec, "X_E"):
            accX = accumulate(ctx, E, X, "X over E", with_entropy=True)
        Xbar = pv.scale_(accX.sum_buf, 1.0 / E.B)
        PX = directions(ctx, [mul_into(Xbar, geo.P), lambda out: step.jacobian_times_into(Xbar, out)], None, dev)
        del accY, accX
        for how in ("loop", "vmap"):
            with measured(dev, rec, f"Y_U_keep_{how}"):
                kept = accumulate(ctx, U, Y, "Y over U", keep_unit_grads=True, unit_backward=how).unit_grads
            with measured(dev, rec, f"X_E_fused_{how}"):
                out[f"a_{how}"] = accumulate(ctx, E, X, "X over E", directions=PY, with_entropy=True,
                                             unit_backward=how).proj
            with measured(dev, rec, "dots_U"):
                out[f"b_stored_{how}"] = variance.project_stored(kept, PX)
            del kept
        with measured(dev, rec, "jvp_U"):
            out["b_jvp"] = variance.project_jvp(ctx, U, PX, "Y", "b_u over U", mb_size=ctx.nograd_mb(U, True))
        with measured(dev, rec, "jvp_E"):
            out["a_jvp"] = variance.project_jvp(ctx, E, PY, "X", "a_u over E", mb_size=ctx.nograd_mb(E, True))
        with measured(dev, rec, "backward"):
            a_ref = variance.project_backward(ctx, E, PY, "X", "a_u over E")
            b_ref = variance.project_backward(ctx, U, PX, "Y", "b_u over U")
        del PY, PX
    rec["dots_U"] = [(a[0] + b[0], max(a[1], b[1])) for a, b in zip(rec["dots_U"][::2], rec["dots_U"][1::2])]
    secs = {k: [t for t, _ in rec[k]] for k in BLOCKS}
    units = {k: [s / u for s, u in zip(secs[k], secs["train"])] for k in BLOCKS}
    units["dots_U"] = [d / 2 for d in units["dots_U"]]  # timed once per way; one is what a run pays
    per_rep = [phase_units({k: units[k][i] for k in BLOCKS}) for i in range(reps)]
    auto = variance.resolve_projection(ProbeConfig(), ctx, U.B)
    auto_path = auto if auto in ("fused", "jvp", "backward") else \
        f"stored/{variance.resolve_unit_backward(ProbeConfig(), ctx, (U, E))}"
    return {"model": model, "device": str(dev), "reps": reps, "n_params": sum(p.numel() for p in ctx.params),
            "B_E": E.B, "B_U": U.B, "G": E.G, "T_E": E.input_ids.shape[-1], "T_U": U.input_ids.shape[-1],
            "mb_size_prompts": ctx.mb_size, "jvp_mb": [ctx.nograd_mb(U, True), ctx.nograd_mb(E, True)],
            "mean_reward_U": float(U.rewards.mean()),
            "seconds": {k: statistics.median(v) for k, v in secs.items()}, "all_seconds": secs,
            "units": {k: statistics.median(v) for k, v in units.items()},
            "paths": {p: statistics.median([r[p] for r in per_rep]) for p in PATHS}, "auto": auto_path,
            "peak_mib": {k: max(m for _, m in rec[k]) for k in BLOCKS},
            "rel_diff": {"a_loop": rel(out["a_loop"], a_ref), "a_vmap": rel(out["a_vmap"], a_ref),
                         "a_jvp": rel(out["a_jvp"], a_ref), "b_stored_loop": rel(out["b_stored_loop"], b_ref),
                         "b_stored_vmap": rel(out["b_stored_vmap"], b_ref), "b_jvp": rel(out["b_jvp"], b_ref)}}


def report(r: dict, target: float) -> bool:
    print(f"\n== {r['model']} on {r['device']}: {r['n_params']:,} params; B_E={r['B_E']} B_U={r['B_U']} G={r['G']} "
          f"T_E={r['T_E']} T_U={r['T_U']} mb_size_prompts={r['mb_size_prompts']} (jvp microbatch U/E "
          f"{r['jvp_mb'][0]}/{r['jvp_mb'][1]}); mean reward on U {r['mean_reward_U']:.2f}; median of {r['reps']}")
    print(f"{'block':<16}{'seconds':>9}{'units':>8}{'peak MiB':>10}   all seconds")
    for k in BLOCKS:
        allv = " ".join(f"{x:.3f}" for x in r["all_seconds"][k])
        print(f"{k:<16}{r['seconds'][k]:>9.3f}{r['units'][k]:>8.3f}{r['peak_mib'][k]:>10.1f}   {allv}")
    print("variance phase by path (units, what it adds to Stage 1): " +
          ", ".join(f"{p} {v:.3f}" for p, v in r["paths"].items()))
    got = r["paths"][r["auto"]]
    ok = got <= target
    print(f"auto picks {r['auto']}: {got:.3f} units vs target {target}: {'within' if ok else 'over'}; "
          f"seed's per-unit backward {r['paths']['backward']:.3f} units ({r['paths']['backward'] / max(got, 1e-9):.1f}x)")
    print("max relative differences to the per-unit backward: " +
          ", ".join(f"{k} {v:.1e}" for k, v in r["rel_diff"].items()))
    return ok


def main() -> int:
    reexec_with_bench_env(omp_threads=False)
    a = bench_args(__doc__, MODELS, "builtin", 7, 0.6, "budget of the variance phase, in units")
    out = []
    for m in a.model:
        r = bench(m, a.reps, a.overrides)
        report(r, a.target)
        out.append(r)
        gc.collect()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0  # a measurement: the ratios are printed, never judged by the exit status


if __name__ == "__main__":
    sys.exit(main())
