"""Stage 2 variance (DESIGN.md §3, seed 000 Part A): calibration, scaling, jackknife (the fast paths:
test_variance_paths.py; the exact model and its simulator: variance_exact.py).

- Calibration against exact enumeration (G = 2, ``sequence`` mode, Adam P from a real state). It
  needs thousands of (E, U) draws of hundreds of prompts, far beyond what per-draw stage calls
  allow in seconds, so the draws go through an exact *simulator*: the gradient of every one of
  the 3 x 156 responses is enumerated once; a unit's X_u, Y_u are weighted sums of those rows;
  the SE comes from the same ``estimators.two_batch_variance``. ``test_simulator_is_the_pipeline``
  pins the simulator to ``accumulate`` + ``project_jvp`` on the same batches (to the fp32 rounding
  bound of each projection's terms: the softmax inside HF's eager attention is taken in fp32).
- Exact moments: with mu = E[X], E[Y], Sigma = Cov(X_u), Cov(Y_u) over units and
  T = tr(P Sigma_X P Sigma_Y), c_X = muY' P Sigma_X P muY, c_Y = muX' P Sigma_Y P muX,
      Var(Xbar.P.Ybar)   = c_X / B_E + c_Y / B_U + T / (B_E B_U)
      E[V_X] = (c_X + T / B_U) / B_E,   E[V_Y] = (c_Y + T / B_E) / B_U,
  so the delta method is conservative by T / (B_E B_U): calibrated only once B is large.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import fp_tol
from entprobe.math import estimators as est
from exact_oracle import batch_of  # the RolloutBatch of enumerated response indices (needs .setup, .K, .R)
from variance_exact import draw, fused, simulate, unit_weights, variances
from variance_exact import ex  # noqa: F401  (the exact model, a module-scoped fixture)


# ---------------------------------------------------------------- simulator == pipeline
@pytest.mark.numerics
def test_simulator_is_the_pipeline(ex):
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        fE, fU = draw(ex, 1, 5, 2, gen), draw(ex, 1, 6, 2, gen)
        a_sim, b_sim, bars_sim = simulate(ex, fE, fU)
        a, b, bars, _, _ = fused(ex.setup.ctx("sequence", mb_size=2), batch_of(ex, fE[0]), batch_of(ex, fU[0]), ex.P)
        assert (a != 0).sum() >= 3 and (b != 0).sum() >= 2  # rewards not all tied in these draws
        # the same sums over the D parameters from the enumerated per-response gradients: the
        # pipeline's passes round in fp32 inside the attention softmax (fp_tol of each unit's terms
        # |V_n,i d_i|, and of the mean's for Xbar . P Ybar)
        (cX, _), (_, cY) = unit_weights(ex, fE[0]), unit_weights(ex, fU[0])
        X, Y = (cX[..., None] * ex.J[fE[0]]).sum(1), (cY[..., None] * ex.J[fU[0]]).sum(1)
        Ma, Mb = X.abs() @ (ex.Pf * Y.mean(0)).abs(), Y.abs() @ (ex.Pf * X.mean(0)).abs()
        D = ex.J.shape[1]
        ta, tb = (torch.tensor([fp_tol(torch.float32, float(m), D) for m in M]) for M in (Ma, Mb))
        assert ((a - a_sim[0]).abs() <= ta).all() and ((b - b_sim[0]).abs() <= tb).all()
        assert abs(bars - float(bars_sim[0])) <= float(ta.mean() + tb.mean())


# ---------------------------------------------------------------- calibration against exact values
def test_calibration_against_the_exact_first_order_value(ex):
    N, B = 2000, 256
    v = variances(ex, B, B, N, seed=1)
    d1 = torch.tensor([(x.ci95_low + x.ci95_high) / 2 for x in v], dtype=torch.float64)
    se2 = torch.tensor([x.SE ** 2 for x in v], dtype=torch.float64)
    z = (d1.mean() - ex.first_order) / (d1.std() / math.sqrt(N))
    assert abs(z) < 4  # deltaH1 is unbiased: E and U independent, E[X] = -grad H exactly in sequence mode
    assert 0.8 < float(se2.mean() / d1.var()) < 1.25  # measured 1.056 (theory: 1.062, the product term)
    cover = sum(x.ci95_low <= ex.first_order <= x.ci95_high for x in v) / N
    assert 0.90 <= cover <= 0.99  # measured 0.942


def test_variance_and_its_estimate_match_the_exact_moments_at_small_B(ex):
    """At B = 8 the product term T/B^2 is most of the variance: the reported SE^2 exceeds the true
    variance by ~70%, exactly as the moments predict (mean SE^2 / var = 1.68 in theory)."""
    N, B = 2000, 8
    v = variances(ex, B, B, N, seed=2)
    d1 = torch.tensor([(x.ci95_low + x.ci95_high) / 2 for x in v], dtype=torch.float64) / ex.lr
    VX = torch.tensor([x.V_X for x in v], dtype=torch.float64)
    VY = torch.tensor([x.V_Y for x in v], dtype=torch.float64)
    var = ex.c_X / B + ex.c_Y / B + ex.T / B ** 2
    # heavy tails (rare improbable responses carry large S differences): 4 Monte-Carlo SEs
    kurt = float(((d1 - d1.mean()) ** 4).mean() / d1.var() ** 2)
    assert abs(float(d1.var()) / var - 1) < 4 * math.sqrt((kurt - 1) / N)
    for V, expect in ((VX, (ex.c_X + ex.T / B) / B), (VY, (ex.c_Y + ex.T / B) / B)):
        assert abs(float(V.mean()) / expect - 1) < 4 * float(V.std() / V.mean()) / math.sqrt(N)
    assert (var + ex.T / B ** 2) / var > 1.5  # the delta method is conservative here, by theory
    assert float((VX + VY).mean() / d1.var()) > 1.3  # ... and in the draws


# ---------------------------------------------------------------- scaling with B
def test_variance_components_halve_when_their_batch_doubles(ex):
    """E[V_X] = (c_X + T/B_U)/B_E halves exactly when B_E doubles at fixed B_U (likewise V_Y in
    B_U). Doubling both would give (c + T/2B)/(2(c + T/B)), below 1/2 by the product term. The
    tolerance is 4 Monte-Carlo SEs of the ratio of means (delta method over the draws)."""
    N, B = 2000, 64
    base = variances(ex, B, B, N, seed=3)
    twoE, twoU = variances(ex, 2 * B, B, N, seed=4), variances(ex, B, 2 * B, N, seed=5)
    for vs in (base, twoE, twoU):
        assert all(x.V_X >= 0 and x.V_Y >= 0 for x in vs)
    for key, doubled in (("V_X", twoE), ("V_Y", twoU)):
        x = torch.tensor([getattr(r, key) for r in doubled], dtype=torch.float64)
        y = torch.tensor([getattr(r, key) for r in base], dtype=torch.float64)
        ratio = float(x.mean() / y.mean())
        se = ratio * math.sqrt(float(x.var() / x.mean() ** 2 + y.var() / y.mean() ** 2) / N)
        assert se < 0.03 and abs(ratio - 0.5) < 4 * se, (key, ratio, se)
        # ... and each mean agrees with the exact moments
        B_E, B_U = (2 * B, B) if key == "V_X" else (B, 2 * B)
        expect = (ex.c_X + ex.T / B_U) / B_E if key == "V_X" else (ex.c_Y + ex.T / B_E) / B_U
        assert abs(float(x.mean()) / expect - 1) < 4 * float(x.std() / x.mean()) / math.sqrt(N), key


# ---------------------------------------------------------------- jackknife == delta method
def test_jackknife_equals_delta_method(ex):
    """Deleting unit u of E changes only Xbar: Xbar_{-u}.P.Ybar = (B m - a_u)/(B - 1), linear in
    a_u, so theta_{-u} - mean theta_{-.} = -(a_u - mean a)/(B - 1) and the delete-1 jackknife
    (B-1)/B sum (theta_{-u} - mean)^2 = sum (a_u - mean a)^2 / (B (B-1)) = V_X exactly; likewise
    for U. No linearisation is involved: the statistic is linear in each batch separately, which is
    why the jackknife is not reported as a second SE."""
    # by hand: a = [1, 2, 3, 6] (mean 3 = bars_dot) -> V_X = (4 + 1 + 0 + 9)/(4 * 3) = 7/6;
    # b = [2, 4] (mean 3) -> V_Y = (1 + 1)/(2 * 1) = 1; lr = 0.5 -> SE = 0.5 sqrt(13/6)
    v = est.two_batch_variance(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([2.0, 4.0]), 0.5, 3.0)
    assert (v.V_X, v.V_Y) == pytest.approx((7 / 6, 1.0), rel=1e-15)
    assert v.SE == pytest.approx(0.5 * math.sqrt(13 / 6), rel=1e-15)
    # Welch-Satterthwaite: (7/6 + 1)^2 / ((7/6)^2 / 3 + 1^2 / 1) = (169/36) / (49/108 + 1) = 507/157
    assert v.df == pytest.approx(507 / 157, rel=1e-14)
    # brute force on explicit unit vectors: recompute Xbar_{-u}.P.Ybar and Xbar.P.Ybar_{-v}
    gen = torch.Generator().manual_seed(6)
    fE, fU = draw(ex, 1, 7, 2, gen)[0], draw(ex, 1, 5, 2, gen)[0]
    (cX, _), (_, cY) = unit_weights(ex, fE), unit_weights(ex, fU)
    X = (cX[..., None] * ex.J[fE]).sum(1)  # [B_E, D]
    Y = (cY[..., None] * ex.J[fU]).sum(1)  # [B_U, D]
    jack = 0.0
    for M, other in ((X, Y.mean(0)), (Y, X.mean(0))):
        B = M.shape[0]
        theta = torch.stack([torch.cat([M[:u], M[u + 1:]]).mean(0) @ (ex.Pf * other) for u in range(B)])
        jack += (B - 1) / B * float(((theta - theta.mean()) ** 2).sum())
    a, b, bars = simulate(ex, fE[None], fU[None])
    v = est.two_batch_variance(a[0], b[0], ex.lr, float(bars[0]))
    assert v.SE == pytest.approx(ex.lr * math.sqrt(jack), rel=1e-10)
