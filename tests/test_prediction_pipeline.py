"""The pipeline (``run_two_batch``) gives the exact simulator's numbers on the same batches, in every
weighting mode and projection, and the other optimizers and clipping predict the step they take
(the estimators' unbiasedness and coverage: test_prediction.py; the draws: prediction_draws.py).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.config import ImportanceConfig, ProbeConfig, ProjectionMode, StepMode
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.modes.two_batch import run_two_batch
from conftest import fp_tol, recording_units
from exact_oracle import batch_of, log_probs_at, make_oracle
from two_batch_bounds import bounds
from prediction_draws import LR_GT, MODES, measured_psi, simulate_prediction


# ---------------------------------------------------------------- the pipeline is the simulator
@pytest.mark.parametrize("projection", ["stored", "jvp"])
@pytest.mark.parametrize("mode", MODES)
def test_run_two_batch_gives_the_simulators_numbers(mode, projection, tmp_path):
    """One E and U draw through run_two_batch (the real AdamW step from the stored -Ybar, the
    ground truth, the comparison) against the simulator on the same responses; G = 3."""
    o = make_oracle(mode, 3)
    o.hyper = dataclasses.replace(o.hyper, lr=LR_GT)
    gen = torch.Generator().manual_seed(11)
    fE, fU = o.draw(1, 6, gen), o.draw(1, 5, gen)
    pred, e, u, delta = simulate_prediction(o, fE, fU)
    S_plus = log_probs_at(o, o.theta + delta[0])
    psi = measured_psi(o, fE, S_plus)[0]
    d = psi - e[0]
    for grp in o.opt.param_groups:
        grp["lr"] = LR_GT
    try:
        icfg = ImportanceConfig(split_step=False, resample_on_low_ess=False)

        def probe(proj: str, run_dir):
            pcfg = ProbeConfig(projection=ProjectionMode(proj), top_k_params=0)
            return run_two_batch(o.setup.ctx(mode, mb_size=2), batch_of(o, fE[0]), batch_of(o, fU[0]),
                                 Geometry(o.opt, LR_GT, None), pcfg, icfg, run_dir)
        res = probe(projection, tmp_path)
        with recording_units() as rec:  # the per-unit sums' magnitudes, from the per-unit backward
            ref = probe("backward", tmp_path / "backward")
    finally:
        for grp in o.opt.param_groups:
            grp["lr"] = 1e-2
    B_E = 6
    expect = {"deltaH_pred": float(pred[0]), "SE_deltaH_pred": float(e[0].std() / math.sqrt(B_E)),
              "SE_deltaH_pred_U": float(u[0].std() / math.sqrt(5)),
              "deltaH_true": float(psi.mean()), "SE_deltaH_true": float(psi.std() / math.sqrt(B_E)),
              "deltaH_true_minus_pred": float(psi.mean() - pred[0]),
              "SE_deltaH_true_minus_pred": float(d.std() / math.sqrt(B_E)),
              "deltaH1_step": float(pred[0])}  # the step taken is the predicted one
    # the simulator sums the same enumerated per-response gradients in fp64; the pipeline's passes
    # round in the fp32 softmax of HF's eager attention: each number within the fp32 bound of its
    # per-unit sums (two_batch_bounds.py; the step taken is the predicted one, its measured change
    # that of the same step)
    b = bounds(ref, rec.split(B_E))
    tol = {**b, "deltaH_true_minus_pred": b["deltaH_pred"] + b["deltaH_true"], "deltaH1_step": b["deltaH_pred"],
           "SE_deltaH_true_minus_pred": b["SE_deltaH_pred"] + b["SE_deltaH_true"]}
    for k, v in expect.items():
        assert abs(res[k] - v) <= tol[k], (k, res[k], v, tol[k])
        # a wrong formula is off by more (the paired difference's SE is second order: its bound is
        # on the scale of either side's, 1e-2 of that)
        scale = res["SE_deltaH_true"] if k == "SE_deltaH_true_minus_pred" else abs(v)
        assert tol[k] < 1e-2 * scale, k
    assert res["pred/step_model"] == "adamw_closed_form" and res["is/stratified_by"] == (
        "group" if mode == "dr_grpo" else "prompt")
    assert res["measurable"] is True
    # the parts' fp64 sum and the interval's few fp64 operations: worst-case roundings of their terms
    parts = [res[f"deltaH_pred_{k}"] for k in ("gradient", "momentum", "weight_decay")]
    assert abs(sum(parts) - res["deltaH_pred"]) <= fp_tol(torch.float64, sum(map(abs, parts)), 3, worst_case=True)
    lo, hi = est.interval(res["deltaH_pred"], res["SE_deltaH_pred"], B_E - 1)
    mag = abs(res["deltaH_pred"]) + (hi - lo)
    assert abs(res["ci95_pred_low"] - lo) <= fp_tol(torch.float64, mag, 4, worst_case=True)
    assert abs(res["ci95_pred_high"] - hi) <= fp_tol(torch.float64, mag, 4, worst_case=True)


def same_sgd_step(res: dict, mags, theta: torch.Tensor) -> None:
    """A plain (preconditioned) SGD step's prediction is deltaH1 and its expected-step SE is
    SE_deltaH1: the same fp64 per-unit projections, once onto ``P Ybar`` scaled by lr and once onto
    the update ``lr P Ybar`` (its own direction, rounded apart): the fp64 bounds of
    two_batch_bounds.py. The step read off theta_plus (fp64) moves by a flip of theta's last bit
    in any coordinate, ``u |Xbar| |theta|`` at most."""
    b = bounds(res, mags, torch.float64)
    assert abs(res["deltaH_pred"] - res["deltaH1"]) <= b["deltaH1"]
    assert abs(res["SE_deltaH_pred_expected"] - res["SE_deltaH1"]) <= 2 * b["SE_deltaH1"]
    flip = fp_tol(torch.float64, res["norm_Xbar"] * float(theta.norm()), 1)
    assert abs(res["deltaH1_step"] - res["deltaH1"]) <= b["deltaH1"] + flip  # the step taken is lr P Ybar
    assert b["deltaH1"] + flip < 1e-6 * abs(res["deltaH1"])  # far below a wrong step's O(1)


def test_preconditioned_sgd_prediction_is_delta_h1(tmp_path):
    """step_mode=preconditioned_sgd takes exactly theta += lr P Ybar: its first-order change is the
    seeds' deltaH1, and the expected-step SE is SE_deltaH1 (the same a_u, b_u scaled by lr)."""
    o = make_oracle("sequence", 2)
    gen = torch.Generator().manual_seed(12)
    fE, fU = o.draw(1, 6, gen), o.draw(1, 5, gen)
    st = [o.opt.state[p] for p in o.setup.params]
    from entprobe.math import paramvec as pv
    P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], int(st[0]["step"]), 0.999, 1e-8, dtype=torch.float64)
    with recording_units() as rec:  # the per-unit backward: the magnitudes of its per-unit sums
        res = run_two_batch(o.setup.ctx("sequence", mb_size=2), batch_of(o, fE[0]), batch_of(o, fU[0]),
                            Geometry(o.opt, 1e-4, P), ProbeConfig(top_k_params=0, projection=ProjectionMode.backward),
                            ImportanceConfig(step_mode=StepMode.preconditioned_sgd, resample_on_low_ess=False), tmp_path)
    assert res["pred/step_model"] == "preconditioned_sgd"
    same_sgd_step(res, rec.split(res["B_E"]), o.theta)
    # and the measured change agrees with it to first order at this small lr
    assert abs(res["deltaH_true"] - res["deltaH_pred"]) < 0.05 * abs(res["deltaH_pred"]) + 3 * res[
        "SE_deltaH_true_minus_pred"]


def test_other_optimizers_and_clipping_predict_the_step_they_take(tmp_path):
    """Plain SGD in closed form (-lr Xbar . Ybar, the seeds' deltaH1 with P = identity); gradient
    clipping (a global rescale by a factor that does not depend on the lr) in AdamW's closed form
    at the clipped gradient, with its parts and both SEs (tests/test_clipped_step.py checks it
    against torch's clip and step); any other optimizer by its own step on a snapshot. Each
    prediction is the first-order change of exactly the step the ground truth takes."""
    o = make_oracle("sequence", 2)
    gen = torch.Generator().manual_seed(13)
    E, U = batch_of(o, o.draw(1, 6, gen)[0]), batch_of(o, o.draw(1, 5, gen)[0])
    icfg = ImportanceConfig(resample_on_low_ess=False, split_step=False)

    def probe(opt, lr, projection="auto", **kw):
        return run_two_batch(o.setup.ctx("sequence", mb_size=2), E, U, Geometry(opt, lr, None),
                             ProbeConfig(top_k_params=0, projection=ProjectionMode(projection)),
                             dataclasses.replace(icfg, **kw), tmp_path)

    with recording_units() as rec:
        sgd = probe(torch.optim.SGD(o.setup.params, lr=1e-3), 1e-3, "backward")
    assert sgd["pred/step_model"] == "sgd_closed_form"
    same_sgd_step(sgd, rec.split(sgd["B_E"]), o.theta)
    for g in o.opt.param_groups:
        g["lr"] = LR_GT
    try:
        clipped = probe(o.opt, LR_GT, max_grad_norm=1e-3)
        adam = probe(o.opt, LR_GT)
    finally:
        for g in o.opt.param_groups:
            g["lr"] = 1e-2
    assert clipped["pred/step_model"] == "adamw_closed_form" and clipped["SE_deltaH_pred_U"] > 0
    assert clipped["pred/grad_clip_factor"] < 0.1 and "pred/grad_clip_factor" not in adam  # clipping binds
    s = 1e-3 / (clipped["pred/grad_norm"] + 1e-6)  # clip_grad_norm_'s factor: two fp64 roundings
    assert abs(clipped["pred/grad_clip_factor"] - s) <= fp_tol(torch.float64, s, 2, worst_case=True)
    # the ground truth's torch clip + AdamW step against the closed form, both fp64: each coordinate
    # within 32 roundings of 2 |theta_i| + |Delta_i| (tests/test_clipped_step.py), |Delta_i| <= 10 lr
    # for AdamW here; dotted with Xbar: at most |Xbar| times the coordinates' bounds' norm
    N = o.theta.numel()
    step_tol = fp_tol(torch.float64, clipped["norm_Xbar"] * (2 * float(o.theta.norm()) + 10 * LR_GT * N ** 0.5), 32,
                      worst_case=True)
    assert abs(clipped["deltaH_pred"] - clipped["deltaH1_step"]) <= step_tol
    assert step_tol < 1e-6 * abs(clipped["deltaH_pred"])
    parts = [clipped[f"deltaH_pred_{k}"] for k in ("gradient", "momentum", "weight_decay")]
    assert clipped["SE_deltaH_pred"] > 0
    assert abs(sum(parts) - clipped["deltaH_pred"]) <= fp_tol(torch.float64, sum(map(abs, parts)), 3, worst_case=True)
    assert clipped["deltaH_pred_weight_decay"] == adam["deltaH_pred_weight_decay"]  # -lr wd theta: no gradient in it
    assert abs(clipped["deltaH_pred"] - adam["deltaH_pred"]) > 0.01 * abs(adam["deltaH_pred"])  # clipping bites
