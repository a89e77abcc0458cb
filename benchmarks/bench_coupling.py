"""How much coupled draws within a prompt (``sampling.coupling``) narrow the prediction's spread.

Built-in model: U fixed, R draws of E with coupling off and on (same seeds, same B_E and G): the
spread over draws of ``deltaH_pred = -Xbar . Delta theta(U)`` (the run's default functional and
estimator, X built by the pipeline's XSpec, cross-fitted under coupling) and the mean of its SE;
then E fixed, R draws of U (``coupling_U``): the spread of the prediction from the step's noise.
Exact model (tests/exact_model.py): the per-prompt spread of ``X_n . d`` along a fixed direction d
for several functionals, on 900 prompts a setting, and of ``Y_n . d`` (the step's per-prompt
gradient, DR-GRPO advantages).

    nice -n 10 .venv/bin/python benchmarks/bench_coupling.py            # ~2 min on 2 cores; --R 40 --G 8 --skip-exact ~6 min

Exits 0 whatever the figures (a measurement).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import compose  # noqa: E402

COUPLINGS = [("none", None), ("stratified", ("stratified", 0, "probability")),
             ("stratified, vocab order", ("stratified", 0, "vocab")), ("antithetic", ("antithetic", 2, "probability"))]


def builtin(a) -> list[tuple]:
    from entprobe.cli.probe_job import load_from_disk
    from entprobe.pipeline.stages.accumulate import accumulate, global_mean, prepare_x, y_loss_of
    from entprobe.pipeline.stages.prediction import build_step_model, directions
    from entprobe.pipeline.stages.variance import token_tangents
    from entprobe.rollouts.coupled_uniforms import Coupling, block_size
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch
    from entprobe.tasks.prompt_ids import prompt_kwargs

    cfg = compose(["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false",
                   "importance.enabled=false", f"batch.B_E={a.B}", f"batch.B_U={a.B}", f"batch.G={a.G}"])
    held, E0, U0, _ = load_from_disk(cfg)
    ctx, geo, lm, b = held.ctx, held.geo, held.lm, cfg.batch

    def draw(seed, c):
        spec = None if c is None else Coupling(c[0], block_size(c[0], c[1], b.G), c[2])
        idx = draw_prompt_indices(len(held.task.prompts), a.B, seed)
        return sample_batch(lm.model, lm.tokenizer, held.task, idx, b.G, cfg.sampling, seed, b.advantage.value,
                            b.adv_eps, coupling=spec, **prompt_kwargs(cfg, lm.source))

    def step(U):
        acc = accumulate(ctx, U, y_loss_of(ctx), "Y over U")
        Ybar, _ = global_mean(acc.sum_buf, acc.B)
        parts = directions(ctx, [], build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, "optimizer", None),
                           ctx.device)
        return [sum(parts.column(j)[i] for j in range(parts.k)) for i in range(len(ctx.params))]

    def e_units(E, delta):
        prepare_x(ctx, E)
        dl, dH = token_tangents(ctx, E, delta, "tangents")
        with torch.no_grad():
            H = torch.cat([ctx.forward_S(mb, "E", with_entropy=True).ent for _, mb in E.microbatches(ctx.mb_size)])
        c = ctx.x.token_coeffs(H.double(), E)
        return -(c.a.double() * dl + c.e.double() * dH).sum((-1, -2))

    rows, delta0 = [], step(U0)
    for name, c in COUPLINGS:
        preds, ses = [], []
        for r in range(a.R):
            e = e_units(draw(1000 + r, c), delta0)
            preds.append(float(e.mean()))
            ses.append(float(e.std()) / math.sqrt(e.numel()))
        rows.append(("built-in", "E", name, statistics.stdev(preds), statistics.mean(ses)))
        print(rows[-1], flush=True)
    for name, c in COUPLINGS:
        preds = [float(e_units(E0, step(draw(5000 + r, c))).mean()) for r in range(a.R)]
        rows.append(("built-in", "U", name, statistics.stdev(preds), math.nan))
        print(rows[-1], flush=True)
    return rows


def exact(a) -> list[tuple]:
    from entprobe.rollouts.coupled_uniforms import Coupling
    from entprobe.rollouts.sampling import sample_batch
    from tests.coupled_helpers import _tangent, copies, direction, stratified_mean_se, x_projections
    from tests.exact_model import make_setup

    s = make_setup()
    d, idx = direction(s), copies(s, 300)
    rows = []
    for G, k in ((4, 2), (8, 4)):
        for name, c in (("none", None), ("stratified", Coupling("stratified", k)),
                        ("stratified, vocab order", Coupling("stratified", k, "vocab")),
                        ("antithetic", Coupling("antithetic", 2))):
            bt = sample_batch(s.model, s.tokenizer, s.task, idx, G, s.sampling, 11, "dr_grpo", 1e-6, "never",
                              coupling=c)
            ids, att, rm = bt.flat("cpu")
            out = {}
            for mode, est in (("sequence", "score"), ("sequence", "rao_blackwell"), ("token_mean", "rao_blackwell")):
                out[f"{mode}/{est}"] = stratified_mean_se(x_projections(s, bt, d, mode, est), idx)[1] * math.sqrt(len(idx))
            from entprobe.rollouts.logprobs import token_logprobs
            dS = _tangent(s, d, lambda: [token_logprobs(s.model, ids, att, rm).logp.detach().sum(-1)])[0]
            y = (bt.advantages.double() * dS.view(bt.B, G)).sum(-1)
            out["Y (dr_grpo step)"] = stratified_mean_se(y, idx)[1] * math.sqrt(len(idx))
            rows.append(("exact", f"G={G}", name, out))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=12, help="draws per setting on the built-in model")
    ap.add_argument("--skip-exact", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = builtin(a)
    print(f"\nbuilt-in model, B_E = B_U = {a.B}, G = {a.G}, {a.R} draws: sd over draws of deltaH_pred (mean SE)")
    for r in rows:
        print(f"  {r[1]} drawn, coupling {r[2]:24s} sd {r[3]:.3g}" + ("" if math.isnan(r[4]) else f"  (SE {r[4]:.3g})"))
    if not a.skip_exact:
        for r in exact(a):
            print("  exact", r[1], r[2], {k: round(v, 4) for k, v in r[3].items()})


if __name__ == "__main__":
    main()
