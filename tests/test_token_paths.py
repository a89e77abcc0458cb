"""The per-token X (Rao-Blackwellised, and the token-entropy functionals) through every projection
path of the pipeline on the built-in model, against two references: the per-unit backward
(``probe.projection=backward``) and, for the prediction, one forward-mode pass that gives every
token's ``grad l_t . Delta theta`` and ``grad H_t . Delta theta`` (``variance.token_tangents``), whose
coefficients-weighted sum is ``-Xbar . Delta theta`` computed another way."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import compose_cfg
from entprobe.cli.probe_job import load_from_disk, run
from entprobe.math import paramvec as pv
from entprobe.pipeline.config_checks import to_typed
from entprobe.pipeline.stages.accumulate import accumulate, global_mean, prepare_x, y_loss_of
from entprobe.pipeline.stages.prediction import build_step_model, directions
from entprobe.pipeline.stages.variance import token_tangents

# sequence / rao_blackwell: tests/test_variance.py (its x_estimator=auto)
CASES = [("token_mean", "rao_blackwell"), ("token_mean", "score"), ("seq_mean_token_mean", "score")]
PATHS = ("stored", "fused", "jvp", "ghost", "backward")
KEYS = ("deltaH_pred", "SE_deltaH_pred", "deltaH1", "SE_deltaH1", "V_X", "V_Y")


def rel_bound(n_terms: int) -> float:
    """Relative agreement of two fp32 computations of the same sums in other orders: rounding
    errors of n terms grow like sqrt(n) ulps (random walk), times a safety factor of 8."""
    return 8 * math.sqrt(n_terms) * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {}
    for mode, est in CASES:
        for proj in PATHS:
            cfg = compose_cfg(tmp_path_factory.mktemp(f"{mode}_{est}_{proj}"), f"probe.projection={proj}",
                              f"probe.weighting_mode={mode}", f"probe.x_estimator={est}", "importance.enabled=false")
            out[mode, est, proj] = run(cfg)
    return out


@pytest.mark.parametrize("mode,est", CASES)
def test_every_path_equals_the_per_unit_backward(runs, mode, est):
    ref = runs[mode, est, "backward"]
    bound = rel_bound(76_000)  # the built-in model's parameters: each projection is a dot over them
    for proj in PATHS:
        r = runs[mode, est, proj]
        assert r["x_estimator"] == est and r["projection"] == proj
        for k in KEYS:
            assert abs(r[k] - ref[k]) <= bound * abs(ref[k]), (proj, k, r[k], ref[k])


@pytest.mark.parametrize("mode,est", CASES[:3])
def test_prediction_equals_the_forward_mode_reference(tmp_path, mode, est):
    """``-Xbar . Delta theta`` from the X pass (backward) equals ``mean_n sum_{g,t} -(a dl + e dH)``
    with the tangents from one forward-mode pass along the same Delta theta (the slow reference)."""
    from entprobe.pipeline.stages.accumulate import x_loss_of

    cfg = to_typed(compose_cfg(tmp_path, f"probe.weighting_mode={mode}", f"probe.x_estimator={est}"))
    held, E, U, _ = load_from_disk(cfg)
    ctx, geo = held.ctx, held.geo
    Ybar, _ = global_mean(accumulate(ctx, U, y_loss_of(ctx), "Y").sum_buf, U.B)
    step = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, "optimizer", None)
    parts = directions(ctx, [], step, ctx.device)
    delta = [sum(parts.column(j)[i] for j in range(parts.k)) for i in range(len(ctx.params))]
    prepare_x(ctx, E)
    Xbar, _ = global_mean(accumulate(ctx, E, x_loss_of(ctx), "X", with_entropy=ctx.x.entropy).sum_buf, E.B)
    pred = -pv.dot(Xbar, delta, dtype=torch.float64)
    dl, dH = token_tangents(ctx, E, delta, "tangents")
    with torch.no_grad():
        fwd = [ctx.forward_S(mb, "E", with_entropy=True) for _, mb in E.microbatches(ctx.mb_size)]
    S, H = torch.cat([f.S for f in fwd]).double(), torch.cat([f.ent for f in fwd]).double()
    if ctx.x.tokens:
        c = ctx.x.token_coeffs(H, E)
        terms = torch.cat([(c.a.double() * dl).flatten(), (c.e.double() * dH).flatten()])
        wrong = -(c.a.double() * dl).sum() / E.B  # without the pathwise term
    else:
        w = ctx.x.weights(S, E).double()
        terms = (w * dl.sum(-1)).flatten()
        wrong = -((w - w.mean(-1, keepdim=True) + 1e-3) * dl.sum(-1)).sum() / E.B  # another baseline
    ref = -float(terms.sum()) / E.B
    # Both sides cancel (centred weights): their rounding is relative to the magnitudes summed, the
    # products X_i Delta theta_i of the fp32 dot and the fp32 tokens' terms, a few ulps of each
    dot_mag = sum(float((x.double() * d.double()).abs().sum()) for x, d in zip(Xbar, delta))
    bound = 16 * torch.finfo(torch.float32).eps * (dot_mag + float(terms.abs().sum()) / E.B)
    assert abs(pred - ref) <= bound, (pred, ref)
    assert abs(pred - float(wrong)) > 10 * bound  # the check can tell a wrong X from rounding
