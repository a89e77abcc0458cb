"""The prediction from the step's own batch (``source="rollouts"``, math/rollout_ustat.py and
stages/rollout_prediction.py):

- the algebra against brute force: ``kernel_terms`` + ``cross_prompt`` equal
  ``-(1/B) sum_n X_n . [Delta theta + K (Ybar_{-n} - Ybar)]`` with K the update's Jacobian in Ybar taken
  by autograd through AdamW and the clipping (not the closed form the code uses), and the jackknife
  from the kernel matrix by deleting each unit;
- Monte Carlo over the exact distribution of the enumerable policy (tests/exact_oracle.py: every
  response's gradient tabulated), B = 8 prompts per batch, AdamW at step 20: the prediction is
  unbiased for the population's change of the step taken, where the plain ``-Xbar . Delta theta`` is
  not, with and without gradient clipping; its intervals cover (the step taken: SE_step; the expected
  step: the U-statistic's jackknife);
- the stage on real sampled batches equals the same math on the enumerated gradients.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.math.adamw import AdamWHyper, adamw_update
from entprobe.math.rollout_ustat import (UnitDots, clip_coefficient, clip_projection, cross_prompt, kernel_terms,
                                         leave_one_out, pair_variance, standard_errors, unit_mean_rows)
from entprobe.math.ustat import row_statistics
from exact_oracle import make_oracle

T_975 = {7: 2.3646242510102993}  # Student t quantile, 7 degrees of freedom (B = 8)


# ---------------------------------------------------------------- the algebra, against brute force
def _update(y, m, v, theta, h):
    return sum(adamw_update(y, m, v, theta, h).values())


def _clipped(Y, max_norm):
    """torch.nn.utils.clip_grad_norm_'s step input, differentiable in Y."""
    return Y * torch.clamp(max_norm / (Y.norm() + 1e-6), max=1.0) if max_norm else Y


def brute(X, Y, k, m, v, theta, h, max_norm):
    """U and its jackknife from the kernel matrix h(n, m) = -X_n . [Dtheta - K Ybar + K Ytilde_m], K by autograd."""
    B = X.shape[0]
    Ybar = Y.mean(0)
    f = lambda yb: _update(_clipped(yb, max_norm), m, v, theta, h)  # noqa: E731
    K = torch.autograd.functional.jacobian(f, Ybar)  # [D, D]
    dtheta = f(Ybar)
    Yt = Y - k[:, None] * Ybar  # first-order influences of each unit on Ybar
    H = -((X @ (dtheta - K @ Ybar))[:, None] + X @ K @ Yt.T)  # [B, B]
    direct = -torch.stack([X[n] @ (dtheta + K @ ((B * Ybar - Yt[n]) / (B - 1) - Ybar)) for n in range(B)]).mean()
    off = ~torch.eye(B, dtype=torch.bool)
    U = H[off].mean()
    ar = torch.arange(B)
    loo = torch.stack([H[off & (ar != u)[None] & (ar != u)[:, None]].mean() for u in range(B)])
    se_jack = math.sqrt(float((B - 1) / B * ((loo - loo.mean()) ** 2).sum()))
    return float(U), float(direct), se_jack


def dots_of(X, Y, m, v, theta, h, max_norm, k=None):
    """The stage's dots, written out with the closed forms (math/adamw.py); each prompt's update
    without it from ``leave_one_out`` and the clipping."""
    from entprobe.math.adamw import adamw_jacobian
    B = X.shape[0]
    k = torch.zeros(B, dtype=X.dtype) if k is None else k
    Ybar = Y.mean(0)
    y = _clipped(Ybar, max_norm)
    parts = adamw_update(y, m, v, theta, h)
    jac = adamw_jacobian(y, m, v, h)
    J = jac["gradient"] + jac["momentum"]
    names = ("gradient", "momentum", "weight_decay")
    e = torch.stack([X @ parts[p] for p in names], 1)
    y_loo = torch.stack([_clipped(leave_one_out(Ybar, Y[n], float(k[n]), B), max_norm) for n in range(B)])
    loo = adamw_update(y_loo, m, v, theta, h)
    e_loo = torch.stack([(X * loo[p]).sum(1) for p in names], 1)
    return UnitDots(e, X @ (J * y), Y @ y, Y @ (J * X.mean(0)), (X * J * Y).sum(1), e_loo, X @ (J * Y).T), y


@pytest.mark.parametrize("max_norm", [None, 0.3], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("coupled", [False, True], ids=["uncoupled", "coupled"])
def test_cross_prompt_equals_the_leave_one_out_update_by_brute_force(max_norm, coupled):
    gen = torch.Generator().manual_seed(3)
    B, D = 7, 5
    X, Y = torch.randn(B, D, generator=gen, dtype=torch.float64), torch.randn(B, D, generator=gen, dtype=torch.float64)
    m, theta = torch.randn(D, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen, dtype=torch.float64)
    v = torch.rand(D, generator=gen, dtype=torch.float64) * 0.5
    h = AdamWHyper(1e-2, 0.1, 0.9, 0.999, 1e-8, 20.0)
    k = torch.randn(B, generator=gen, dtype=torch.float64) * 0.3 if coupled else torch.zeros(B, dtype=torch.float64)
    k = k - k.mean()  # a coupling's k_n has mean 0
    dots, y = dots_of(X, Y, m, v, theta, h, max_norm, k)
    c = clip_coefficient(float(Y.mean(0).norm()), max_norm)
    assert (c < 1) == (max_norm is not None)  # the case is what it says
    kt = kernel_terms(dots, float(y.norm()), c, clip_projection(float(Y.mean(0).norm()), max_norm),
                      k if coupled else None)
    cp = cross_prompt(dots.e_loo.sum(1), dots.e.sum(1), kt)
    U_lin, direct, se_jack = brute(X, Y, k, m, v, theta, h, max_norm)
    # fp64, B^2 kernel values of D-term dots: a few hundred eps of the largest term
    tol = 1e3 * torch.finfo(torch.float64).eps * float((X.abs() @ Y.abs().T).max() + 1)
    assert abs(U_lin - direct) <= tol, (U_lin, direct)  # the kernel matrix is the expansion
    # the kernel terms reproduce the kernel matrix's jackknife (the rows' spread)...
    assert abs(standard_errors(cp)["SE_expected"] - se_jack) <= tol, (standard_errors(cp), se_jack)
    # ...and the point estimate is the exact update without each prompt, which the expansion
    # approximates to second order in one prompt's share of the gradient
    U_exact = -float(torch.stack([X[n] @ _update(_clipped(leave_one_out(Y.mean(0), Y[n], float(k[n]), 7), max_norm),
                                                 m, v, theta, h) for n in range(7)]).mean())
    assert abs(cp.U - U_exact) <= tol and abs(float(cp.own.mean()) - cp.U) <= tol
    assert abs(cp.U - U_lin) <= 0.1 * abs(U_lin) + tol, (cp.U, U_lin)


def test_unit_mean_rows_give_the_jackknife_of_a_mean():
    """A mean of per-unit values as a U-statistic: the delete-1 jackknife SE is sd / sqrt(B)."""
    f = torch.tensor([0.3, -1.2, 2.5, 0.7, 0.1], dtype=torch.float64)
    _, _, _, se = row_statistics(float(f.mean()), unit_mean_rows(f))
    assert abs(se - math.sqrt(est.mean_variance(f))) <= 64 * torch.finfo(torch.float64).eps * float(f.abs().max())


# ---------------------------------------------------------------- Monte Carlo over the exact distribution
def simulate(o, f, max_norm):
    """The production math on enumerated gradients for draws f [N, B, G]: per draw the prediction,
    its SEs, the plain product and the population's first-order change of the step taken."""
    wX, wY = o.weights(f, "X"), o.weights(f, "Y")
    Jf = o.J[f]  # [N, B, G, D]
    X, Y = torch.einsum("nbg,nbgd->nbd", wX, Jf), torch.einsum("nbg,nbgd->nbd", wY, Jf)
    out = {k: [] for k in ("U", "SE_step", "SE_expected", "plain", "linearised", "target", "clipped")}
    for Xi, Yi in zip(X, Y):
        dots, y = dots_of(Xi, Yi, o.m, o.v, o.theta, o.hyper, max_norm)
        c = clip_coefficient(float(Yi.mean(0).norm()), max_norm)
        rho = clip_projection(float(Yi.mean(0).norm()), max_norm)
        cp = cross_prompt(dots.e_loo.sum(1), dots.e.sum(1), kernel_terms(dots, float(y.norm()), c, rho, None))
        se = standard_errors(cp, pair_variance(dots, float(y.norm()), c, rho, None))
        dtheta = sum(o.update(y).values())
        out["U"].append(cp.U)
        out["SE_step"].append(se["SE_step"])
        out["SE_expected"].append(se["SE_expected"])
        out["plain"].append(float(-(Xi.mean(0) @ dtheta)))
        kt = kernel_terms(dots, float(y.norm()), c, rho, None)  # the first-order expansion's own mean
        out["linearised"].append(float(-(dots.e.sum(1) + (kt.a - kt.d) / (Xi.shape[0] - 1)).mean()))
        out["target"].append(float(-(o.minus_grad_H @ dtheta)))  # grad H . Delta theta: the population's
        out["clipped"].append(c < 1)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def first_step(o):
    """The oracle with AdamW's state before its first step (m = v = 0, step 0: what the probe reads
    from an optimizer without state): its update is ``lr y / (|y| + eps) - lr wd theta``, ~ lr sign(y)."""
    o = copy.copy(o)  # the shared oracle keeps its step-20 state
    o.m, o.v = torch.zeros_like(o.m), torch.zeros_like(o.v)
    o.hyper = dataclasses.replace(o.hyper, step=0.0)
    return o


def _mc(max_norm, N=3000, B=8, G=2, seed=0, chunk=250, fresh=False):
    o = make_oracle("sequence", G)
    o = first_step(o) if fresh else o
    gen = torch.Generator().manual_seed(seed)
    parts = [simulate(o, o.draw(min(chunk, N - i), B, gen), max_norm) for i in range(0, N, chunk)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _z(x: torch.Tensor) -> float:
    return float(x.mean() / (x.std() / math.sqrt(x.numel())))


@pytest.mark.parametrize("max_norm", [None, 0.3], ids=["unclipped", "clipped"])
def test_unbiased_for_the_population_change_where_the_plain_product_is_not(max_norm):
    """3000 batches of B = 8 prompts x G = 2 (few responses: each prompt's own X_n . Y_n is large
    next to the change): the prediction minus the population's first-order change of the step
    taken has mean 0 (|z| < 3), the plain -Xbar . Delta theta's is resolved away from 0 (|z| > 6),
    and so is the first-order expansion of the update without each prompt (unclipped: why the
    prediction takes that update exactly); at max_norm 0.3 most steps are clipped."""
    r = _mc(max_norm)
    if max_norm:
        assert float(r["clipped"].double().mean()) > 0.9
    assert abs(_z(r["U"] - r["target"])) < 3, (float((r["U"] - r["target"]).mean()), _z(r["U"] - r["target"]))
    assert abs(_z(r["plain"] - r["target"])) > 6, _z(r["plain"] - r["target"])
    if not max_norm:  # measured: the plain product 2.4 times the change; the expansion -0.032 (z -9) off it
        assert float(r["plain"].mean()) / float(r["target"].mean()) > 1.5
        assert abs(_z(r["linearised"] - r["target"])) > 4, _z(r["linearised"] - r["target"])
    assert abs(float(r["target"].mean())) > 5 * float(r["U"].std() / math.sqrt(r["U"].numel()))  # power


@pytest.mark.parametrize("max_norm", [None, 0.3], ids=["unclipped", "clipped"])
def test_intervals_cover_at_b8(max_norm):
    """The 95% t intervals (7 df): ``SE_step`` covers the population's change of the step taken
    93-97.5% of the time (measured 96.4% and 95.8% with the pair term, 95.3% and 95.1% without;
    3000 draws: a binomial SE of 0.4%), ``SE_expected``
    (the U-statistic's jackknife) the expected step's (the mean of the targets over the draws, whose
    own error is a twentieth of an SE) 93-99%."""
    r = _mc(max_norm, seed=1)
    t = T_975[7]
    step = float(((r["U"] - r["target"]).abs() <= t * r["SE_step"]).double().mean())
    expected = float(((r["U"] - r["target"].mean()).abs() <= t * r["SE_expected"]).double().mean())
    assert 0.93 <= step <= 0.975, step
    # the delete-1 jackknife variance of a U-statistic is biased upward (Efron-Stein): measured 98.5%
    # unclipped, 95.6% clipped
    assert 0.93 <= expected <= 0.99, expected


@pytest.mark.slow
@pytest.mark.parametrize("G", [2, 4])
def test_first_step_is_unbiased_and_covers_at_b8(G):
    """AdamW's first step (no state: m = v = 0, step 0), ~ -lr sign(g): as nonlinear in the gradient
    as an update gets (its Jacobian is ~0 but near g = 0). 2000 batches of B = 8 prompts x G: the
    prediction minus the population's first-order change of the step taken has mean 0 (|z| < 3;
    measured 0.26 at G = 2, 2.28 at G = 4 on these draws; -0.27 / 0.39, -0.15 and 0.84 on others of
    3000) and ``SE_step``'s 95% t interval covers it 93-97.5% of the time (measured 95.7% and 95.2%;
    binomial SE 0.5% at 2000 draws): the
    leave-one-out update is exact (not the expansion), and X_n is independent of it, so SE_step needs
    no term for the step's curvature. The plain product is biased there as at step 20."""
    r = _mc(None, N=2000, G=G, seed=2, fresh=True)
    o = first_step(make_oracle("sequence", G))
    f = o.draw(1, 8, torch.Generator().manual_seed(0))
    y = o.means(f, o.weights(f, "Y"))[0]  # the case is what it says: a coordinate's gradient part is ~lr sign(y)
    live = y.abs() > 1e3 * o.hyper.eps  # there lr |y| / (|y| + eps) is lr to eps / |y| < 1e-3
    assert int(live.sum()) > 100 and torch.allclose(o.update(y)["gradient"][live], o.hyper.lr * y[live].sign(),
                                                     rtol=1e-3)
    err = r["U"] - r["target"]
    assert abs(_z(err)) < 3, (float(err.mean()), _z(err))
    assert abs(float(r["target"].mean())) > 5 * float(r["U"].std() / math.sqrt(r["U"].numel()))  # power
    assert abs(_z(r["plain"] - r["target"])) > 6, _z(r["plain"] - r["target"])
    step = float((err.abs() <= T_975[7] * r["SE_step"]).double().mean())
    assert 0.93 <= step <= 0.975, step


# ---------------------------------------------------------------- the stage against the enumeration
def _stage_and_reference(max_norm, budget_mb, fused=True):
    from entprobe.math import paramvec as pv
    from entprobe.math.estimators import x_unit_coeffs, y_loss, y_unit_coeffs
    from entprobe.pipeline.stages.prediction import build_step_model
    from entprobe.pipeline.stages.rollout_prediction import predict_on_rollouts

    o = make_oracle("sequence", 4)
    setup, opt = o.setup, o.opt
    batch = setup.sample(8, 4, seed=7)
    ctx = setup.ctx("sequence")
    ids, att, rm = batch.flat("cpu")
    from entprobe.rollouts.logprobs import token_logprobs
    S = token_logprobs(setup.model, ids, att, rm).logp.sum(-1).view(batch.B, batch.G)
    grads = torch.autograd.grad(-y_loss(S, batch.advantages.double(), batch.Lmax) / batch.B, setup.params)
    Ybar = [-g for g in grads]
    gn = pv.norm(Ybar)
    y = [t * clip_coefficient(gn, max_norm) for t in Ybar]
    step_at = lambda yy: build_step_model(ctx, opt, o.hyper.lr, yy, None, "optimizer", None)  # noqa: E731
    update = step_at(y)
    assert update.unit_dots is not None  # AdamW's closed form: one blocked pass a prompt (math/unit_dots.py)
    if not fused:  # the path of step models without it: the update's parts written out, then dotted
        update = dataclasses.replace(update, unit_dots=None)
    ro = predict_on_rollouts(ctx, batch, update, step_at, y, max_norm, gn if max_norm else None, budget_mb)
    zero = int((batch.advantages == 0).all(-1).sum())
    assert zero >= 1  # prompts of equal rewards (Y_n = 0) take the shortcut: one backward, a shared update
    second = 0 if budget_mb > 0 else batch.B  # the second pass: each prompt's Y again
    assert ctx.stats.passes["backward"] == (2 * batch.B - zero + second) * batch.G
    # the reference: the batch's responses in the enumeration, the production weights and math
    index = {tuple(t): i for i, t in enumerate(setup.all_responses())}
    gidx = torch.tensor([[int(batch.prompt_index[n]) * o.K + index[tuple(batch.input_ids[n, g][batch.response_mask[n, g].bool()].tolist())]
                          for g in range(batch.G)] for n in range(batch.B)])
    L = batch.gen_lengths.double()
    cx = x_unit_coeffs(o.S[gidx], L, batch.Lmax, "sequence")
    cy = y_unit_coeffs(batch.advantages.double(), batch.Lmax)
    X, Y = torch.einsum("bg,bgd->bd", cx, o.J[gidx]), torch.einsum("bg,bgd->bd", cy, o.J[gidx])
    dots, _ = dots_of(X, Y, o.m, o.v, o.theta, o.hyper, max_norm)
    if budget_mb == 0:  # the Y_n are not kept: no pairs X_n . J Y_m (rollout_passes.pair_copies)
        dots = dots._replace(pairs=None)
    c = clip_coefficient(float(Y.mean(0).norm()), max_norm)
    y_norm, rho = float((Y.mean(0) * c).norm()), clip_projection(float(Y.mean(0).norm()), max_norm)
    cp = cross_prompt(dots.e_loo.sum(1), dots.e.sum(1), kernel_terms(dots, y_norm, c, rho, None))
    return ro, cp, standard_errors(cp, pair_variance(dots, y_norm, c, rho, None)), float(-(o.S[gidx]).mean())


# AdamW's closed form on coordinates it never updated divides by eps = 1e-8: dots of terms ~1e8
# times a gradient cancel to O(1); both sides are fp64 and agree to ~1e-9 relative
REL_STAGE = 1e-6


@pytest.mark.parametrize("max_norm,budget_mb,fused", [(None, 1e4, True), (None, 0.0, True), (0.2, 1e4, True),
                                                       (None, 1e4, False), (0.2, 1e4, False)],
                         ids=["unclipped", "unclipped_second_pass", "clipped", "unfused", "clipped_unfused"])
def test_stage_matches_the_enumeration(max_norm, budget_mb, fused):
    """The passes on a real sampled batch (B = 8, G = 4) give the numbers the production math gives on
    the enumerated gradients of the same responses: the prediction, its two SEs and H; with the Y_n
    kept or taken again in a second pass; clipped at 0.2 (the batch's gradient norm is above it)."""
    ro, cp, se, H = _stage_and_reference(max_norm, budget_mb, fused)
    r = ro.res
    assert r["rollouts/kept_y"] == (budget_mb > 0)
    assert (r["rollouts/clip_coef"] < 1) == (max_norm is not None)
    for key, ref in (("deltaH_pred", cp.U), ("SE_deltaH_pred", se["SE_step"]),
                     ("SE_deltaH_pred_expected", se["SE_expected"]), ("H_orig", H)):
        assert abs(r[key] - ref) <= REL_STAGE * abs(ref), (key, r[key], ref)
    # |y - c Ybar| / |y|: the same gradient summed in two orders (fp64, ~2500 coordinates)
    assert r["rollouts/grad_residual"] <= 1e3 * torch.finfo(torch.float64).eps
    parts = sum(r[f"deltaH_pred_{p}"] for p in ("gradient", "momentum", "weight_decay"))
    assert abs(parts - r["deltaH_pred"]) <= REL_STAGE * abs(r["deltaH_pred"])


def test_pair_variance_is_unbiased_for_the_swap_covariance():
    """``pair_variance`` estimates ``tr(K C K C) / (B (B - 1))`` (C = Cov(X_n, Y_n), K diagonal) without
    bias: 3000 batches of B = 8 from a joint normal whose X and Y share a component (as a prompt's X
    and Y share its responses), means away from 0. Its mean is within 3 SE of the exact value, which
    the same statistic centred on the whole batch's means misses by more than 6 SE (it carries each
    prompt's own X_n . K Y_n)."""
    gen = torch.Generator().manual_seed(11)
    D, B, N = 3, 8, 3000
    L = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.3, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0, 0.0, 0.0],
                      [0.9, 0.1, 0.0, 0.5, 0.0, 0.0], [0.0, 0.7, 0.2, 0.1, 0.6, 0.0], [0.2, 0.0, 0.9, 0.0, 0.3, 0.4]],
                     dtype=torch.float64)
    mean = torch.tensor([0.5, -1.0, 0.8, 1.5, 0.4, -0.7], dtype=torch.float64)
    K = torch.tensor([0.7, 1.3, 0.4], dtype=torch.float64)
    C = (L @ L.T)[:D, D:]  # Cov(X, Y)
    exact = float(torch.trace(torch.diag(K) @ C @ torch.diag(K) @ C)) / (B * (B - 1))
    Z = torch.randn(N, B, 2 * D, generator=gen, dtype=torch.float64) @ L.T + mean
    est, naive = [], []
    off = ~torch.eye(B, dtype=torch.bool)
    for z in Z:
        X, Y = z[:, :D], z[:, D:]
        P = X @ (K * Y).T  # X_n . J Y_m with J = K (unclipped, uncoupled: K = J)
        dots = UnitDots(torch.zeros(B, 1), torch.zeros(B), torch.zeros(B), torch.zeros(B), P.diagonal(),
                        torch.zeros(B, 1), P)
        est.append(pair_variance(dots, 1.0, 1.0, 0.0, None))
        M = P - P.mean(0, keepdim=True) - P.mean(1, keepdim=True) + P.mean()
        naive.append(float((M * M.T)[off].mean()) / (B * (B - 1)))
    est, naive = torch.tensor(est), torch.tensor(naive)
    se = float(est.std()) / math.sqrt(N)
    assert abs(float(est.mean()) - exact) <= 3 * se, (float(est.mean()), exact, se)
    assert abs(float(naive.mean()) - exact) > 6 * float(naive.std()) / math.sqrt(N), (float(naive.mean()), exact)
