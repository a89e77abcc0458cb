"""How much noise the Rao-Blackwellised X removes, where the rest of the noise lives, and what it costs.

On one checkpoint and one pair of sampled batches (E, U), the real update ``Delta theta`` of the
checkpoint's AdamW state on U is computed in closed form, and one forward-mode pass over E along it
gives every token's ``grad l_t . Delta theta`` and ``grad H_t . Delta theta``. Every functional and
estimator's per-prompt contribution to ``deltaH_pred`` (``e_n = -X_n . Delta theta``) then follows
from its coefficients, on the same responses, so the figures compare estimators, not draws. Per
(functional, estimator) it prints:

- ``pred`` and ``SE`` (``sd(e) / sqrt(B_E)``, the run's ``SE_deltaH_pred``);
- ``SE ratio``: the score form's SE over this row's, for the same functional (the gain);
- ``within``: the share of ``Var(e_n)`` from the responses of a prompt (the rest is between
  prompts: more responses G cannot remove it). Each group is split into two halves of G/2
  responses, each half's X built within it (the same coefficient functions): the halves are
  independent given the prompt, so the covariance over prompts of their contributions is the
  between-prompt variance, and ``within = 1 - cov(e_A, e_B) / Var(e_n)`` (noisy at small B_E:
  it can leave [0, 1]);
- ``pathwise``: ``Var`` of the pathwise terms ``-e grad H_t . Delta theta`` over ``Var(e_n)`` (0 for
  the score forms of sequence and token_mean, which have none; the rest is the score terms and their covariance);
- ``B_E sign``: the B_E at which the SE is half the Rao-Blackwellised prediction's size (a sign
  resolved at z = 2), ``B_E (2 SE / |pred|)^2``;
- the X pass's time with each estimator (the pipeline's default projection path, median of
  ``--reps``) in training-step units (one forward+backward over E ∪ U), and its peak memory over
  its start (``_common.PeakMemory``);
- after the real step, ESS/N of the whole-response weights and of the per-decision weights the
  Rao-Blackwellised measured change uses (whole-response weights degrade with length).

    python benchmarks/bench_rao_blackwell.py                                    # built-in model, ~1 min
    python benchmarks/bench_rao_blackwell.py --model smollm2 --ckpt DIR --max-new 32 256

Runs with ``OMP_NUM_THREADS=1`` (``_common.reexec_with_bench_env``): times are one thread's work.

``--ckpt``: a SmolLM2 folder with a real AdamW state (``benchmarks/smollm2_checkpoint.py --out DIR``).
Exits 0 whatever the figures (a measurement).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import PeakMemory, compose, reexec_with_bench_env, training_unit

CASES = [("sequence", "score"), ("sequence", "rao_blackwell"), ("token_mean", "score"),
         ("token_mean", "rao_blackwell"), ("seq_mean_token_mean", "score"), ("per_token_avg", "score"),
         ("dr_grpo", "score")]
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin", choices=["builtin", "smollm2"])
    ap.add_argument("--ckpt", default=None, help="SmolLM2 checkpoint folder with optimizer.pt (smollm2_checkpoint.py)")
    ap.add_argument("--max-new", type=int, nargs="+", default=[32])
    ap.add_argument("--B", type=int, default=8, help="prompts in E and in U")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions of the X passes (0: no timing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", default=None, help="folder to save / load the sampled batches (batch.save)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args()


def overrides(a: argparse.Namespace, max_new: int) -> list[str]:
    out = COMMON + [f"batch.B_E={a.B}", f"batch.B_U={a.B}", f"batch.G={a.G}", f"optimizer.lr={a.lr}",
                    f"sampling.max_new_tokens={max_new}", f"batch.seed_E={a.seed}", f"batch.seed_U={a.seed + 1}"]
    if a.model == "smollm2":
        if not a.ckpt:
            sys.exit("--model smollm2 needs --ckpt DIR (benchmarks/smollm2_checkpoint.py --out DIR)")
        out += ["model=hf", f"model.path={a.ckpt}", f"optimizer.state_path={a.ckpt}", "task=arithmetic",
                "probe.mb_size_prompts=1"]
    if a.batches:
        folder = Path(a.batches) / f"{a.model}-T{max_new}-B{a.B}-G{a.G}-s{a.seed}"
        out.append(f"batch.load={folder}" if (folder / "batches.json").is_file() else f"batch.save={folder}")
    return out + list(a.overrides)


def coefficients(mode: str, estimator: str, S, lp, H, m, L, Lmax, token_mean_stats):
    """Per-token coefficients (a, e) of X in this functional and estimator (response weights on
    every token of their response for the score forms); token_mean's constants from the whole
    batch ``token_mean_stats = (H, m)``."""
    from entprobe.math import estimators as est
    from entprobe.math import token_functionals as tf

    if mode == "seq_mean_token_mean":
        return tf.seq_mean_token_mean_coeffs(H, m)
    kappa = scale = 0.0
    if mode == "token_mean":
        _, D, kappa = tf.token_mean_stats(*token_mean_stats)
        scale = 1.0 / D
    if estimator == "rao_blackwell":
        return tf.rao_blackwell_coeffs(H, m, kappa, scale if mode == "token_mean" else 1.0)
    w = tf.score_token_mean_weights(S, L, kappa, scale) if mode == "token_mean" else est.x_unit_coeffs(S, L, Lmax, mode)
    return tf.TokenCoeffs(w.double().unsqueeze(-1) * m, torch.zeros_like(m))


def estimator_rows(ctx, E, U, geo, cases=CASES) -> dict:
    """Per (functional, estimator) of ``cases``, on the same responses: ``pred`` (the mean over E's
    prompts of ``e_n = -X_n . Delta theta``), ``SE`` (``sd(e) / sqrt(B_E)``), ``SE_ratio`` (the score
    form's SE over this row's), ``within_share``, ``path_share`` and ``B_E_sign`` (module docstring),
    from one Y pass over U (``Delta theta``, the AdamW update in closed form), one no-grad forward
    over E and one forward-mode pass over E along ``Delta theta``. Also returns ``delta``, ``lp``,
    ``m`` (for the ESS after the step), ``parts`` (the directions) and ``tangent_pass_s``."""
    from entprobe.pipeline.stages.accumulate import accumulate, global_mean, y_loss_of
    from entprobe.pipeline.stages.prediction import build_step_model, directions
    from entprobe.pipeline.stages.variance import token_tangents

    accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
    Ybar, _ = global_mean(accY.sum_buf, accY.B)
    step = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, "optimizer", None)
    parts = directions(ctx, [], step, ctx.device)
    delta = [sum(parts.column(j)[i] for j in range(parts.k)) for i in range(len(ctx.params))]
    with torch.no_grad():
        fwd = [ctx.forward_S(mb, "E at theta", with_entropy=True) for _, mb in E.microbatches(ctx.mb_size)]
    S = torch.cat([f.S for f in fwd]).double()
    lp, H = torch.cat([f.lp for f in fwd]).double(), torch.cat([f.ent for f in fwd]).double()
    t0 = time.perf_counter()
    dl, dH = token_tangents(ctx, E, delta, "tangents along Delta theta")
    t_tan = time.perf_counter() - t0
    m, L = E.response_mask.double(), E.gen_lengths.double()
    rows = {}

    def contributions(mode, estimator, sl, part: str = "all") -> torch.Tensor:
        """-X_n . Delta theta per prompt [B] from the responses ``sl`` of each group (``part``: the
        score terms ``a dl`` or the pathwise terms ``e dH`` only)."""
        c = coefficients(mode, estimator, S[:, sl], lp[:, sl], H[:, sl], m[:, sl], L[:, sl], L[:, sl].amax(-1),
                         token_mean_stats=(H, m))
        score, path = -(c.a * dl[:, sl]).sum((-1, -2)), -(c.e * dH[:, sl]).sum((-1, -2))
        return {"all": score + path, "score": score, "path": path}[part]

    half = E.G // 2
    for mode, estimator in cases:
        e = contributions(mode, estimator, slice(None))  # [B]
        var_e = float(e.var())
        between = math.nan  # halves of G // 2 responses need G >= 4 (a leave-one-out baseline in each)
        if half >= 2:
            eA, eB = contributions(mode, estimator, slice(0, half)), contributions(mode, estimator, slice(half, None))
            between = float(((eA - eA.mean()) * (eB - eB.mean())).sum() / (e.numel() - 1))
        path = contributions(mode, estimator, slice(None), "path")
        rows[(mode, estimator)] = {"pred": float(e.mean()), "SE": math.sqrt(var_e / e.numel()),
                                   "within_share": 1.0 - between / var_e if var_e > 0 else math.nan,
                                   "path_share": float(path.var()) / var_e if var_e > 0 else math.nan}
    for (mode, estimator), r in rows.items():
        base, rb = rows[(mode, "score")], rows.get((mode, "rao_blackwell"), rows[(mode, "score")])
        r["SE_ratio"] = base["SE"] / r["SE"] if r["SE"] > 0 else math.nan
        r["B_E_sign"] = E.B * (2 * r["SE"] / abs(rb["pred"])) ** 2 if rb["pred"] else math.inf
    return {"rows": rows, "delta": delta, "lp": lp, "m": m, "L": L, "parts": parts, "tangent_pass_s": t_tan}


def one_length(a: argparse.Namespace, max_new: int) -> dict:
    from entprobe.cli.probe_job import load_from_disk
    from entprobe.math import token_importance as ti
    from entprobe.math import importance as im
    from entprobe.pipeline.stages.accumulate import accumulate, prepare_x, x_loss_of
    from entprobe.pipeline.stages.x_spec import x_spec

    cfg = compose(overrides(a, max_new))
    t0 = time.perf_counter()
    held, E, U, source = load_from_disk(cfg)
    ctx, geo = held.ctx, held.geo
    print(f"[bench] {a.model} T={max_new}: batches {source} in {time.perf_counter() - t0:.0f} s; "
          f"mean length E {float(E.gen_lengths.double().mean()):.1f}", flush=True)
    t = estimator_rows(ctx, E, U, geo)
    rows, delta, lp, m, L, parts, t_tan = (t[k] for k in ("rows", "delta", "lp", "m", "L", "parts", "tangent_pass_s"))
    # time of the X pass (the pipeline's default path) for each estimator of token_mean
    times = {"train": [], "score": [], "rao_blackwell": []}
    peaks: dict[str, float] = {}
    for _ in range(a.reps):
        t0 = time.perf_counter()
        training_unit(ctx, E, U)
        times["train"].append(time.perf_counter() - t0)
        for estimator in ("score", "rao_blackwell"):
            ctx.x = x_spec("token_mean", estimator)
            prepare_x(ctx, E)
            with PeakMemory(ctx.device) as mem:
                t0 = time.perf_counter()
                accumulate(ctx, E, x_loss_of(ctx), "X over E", directions=parts, with_entropy=ctx.x.entropy,
                           unit_backward="vmap" if sum(p.numel() for p in ctx.params) < 10_000_000 else "loop")
                times[estimator].append(time.perf_counter() - t0)
            peaks[estimator] = max(peaks.get(estimator, 0.0), mem.mib)
    med = {k: statistics.median(v) if v else math.nan for k, v in times.items()}  # --reps 0: not timed
    # ESS/N after the real step: whole responses vs per-decision
    with torch.no_grad():
        saved = [p.detach().clone() for p in ctx.params]
        for p, d in zip(ctx.params, delta):
            p.add_(d.to(p.dtype))
        try:
            lp1 = torch.cat([ctx.forward_S(mb, "E at theta+").lp for _, mb in E.microbatches(ctx.mb_size)]).double()
        finally:
            for p, s in zip(ctx.params, saved):
                p.copy_(s)
    rho = (lp1 - lp) * m
    ess_seq = float(im.stratified_ess(rho.sum(-1)).mean()) / E.G
    ess_pd = ti.per_decision_ess_frac(rho, m)
    return {"max_new": max_new, "mean_length": float(L.mean()), "rows": {f"{k[0]}/{k[1]}": v for k, v in rows.items()},
            "time_units": {k: med[k] / med["train"] for k in ("score", "rao_blackwell")},
            "time_s": med, "tangent_pass_s": t_tan, "x_pass_peak_mib": peaks, "ESS_frac_sequence": ess_seq, "ESS_frac_per_decision": ess_pd}


def main() -> None:
    a = parse_args()
    out = []
    for T in a.max_new:
        r = one_length(a, T)
        out.append(r)
        print(f"\n{a.model}, {T} new tokens (mean length {r['mean_length']:.1f}), B_E = B_U = {a.B}, G = {a.G}, lr {a.lr:g}")
        print(f"{'functional/estimator':34s} {'pred':>11s} {'SE':>10s} {'SE ratio':>9s} {'within':>7s} "
              f"{'pathwise':>9s} {'B_E sign':>9s}")
        for name, row in r["rows"].items():
            print(f"{name:34s} {row['pred']:11.3g} {row['SE']:10.3g} {row['SE_ratio']:9.2f} "
                  f"{row['within_share']:7.2f} {row['path_share']:9.2f} {row['B_E_sign']:9.0f}")
        tu = r["time_units"]
        print(f"X pass (token_mean): score {tu['score']:.2f} units, rao_blackwell {tu['rao_blackwell']:.2f} units "
              f"(1 unit = {r['time_s']['train']:.2f} s); extra {tu['rao_blackwell'] - tu['score']:+.2f} units")
        if r["x_pass_peak_mib"]:
            pk = r["x_pass_peak_mib"]
            print(f"X pass peak memory over its start: score {pk['score']:.0f} MiB, rao_blackwell "
                  f"{pk['rao_blackwell']:.0f} MiB")
        print(f"ESS/N after the step: whole responses {r['ESS_frac_sequence']:.4f}, per-decision "
              f"{r['ESS_frac_per_decision']:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    reexec_with_bench_env()  # OMP_NUM_THREADS=1: times are one thread's work, comparable across runs
    main()
