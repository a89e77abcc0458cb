"""A state-space filter of the entropy over a run (pure math on scalars; no config, no I/O).

The one-batch forecast (math/forecast.py) starts from one batch's H and estimates the fresh steps'
expected part from one batch's gradient part. A run has more: every probe so far, and the entropy
the trainer logs at every step. This module combines them.

**State.** ``x_n = (L_n, beta)``: ``L_n`` the population's entropy after n optimizer steps, ``beta``
the gain, the fraction of the probe's predicted change that the run realises (1: the first-order
prediction is right; below 1 where the path bends away from the tangent or the prediction is mostly
noise; above 1 where it bends further). Step n + 1 moves it by ``beta`` times the predicted change
``u`` (at the factor the step is taken at):

    L_{n+1} = L_n + beta u + w,   beta_{n+1} = beta_n + eta,   w ~ N(0, q_L),  eta ~ N(0, q_beta)

``q_L``: the variance of the predicted change (its estimate and the fresh batch's spread) plus the
run's own step noise (below); ``q_beta``: the gain's random walk. In general form ``L' = L + a + b x_2``
(``a = 0, b = u``), ``F = [[1, b], [0, 1]]``: ``m' = F m + (a, 0)``, ``P' = F P F^T + diag(q_L, q_2)``
(``kalman_predict``).

**Observations.** The entropy logged at a step (a batch's mean: ``y = L_n + e``, ``e ~ N(0, R)``, R the
batch's sampling variance, the probe's ``SE_H_orig^2``): ``S = P_LL + R``, ``K = P[:, 0] / S``, ``m' = m
+ K (y - m_L)``, ``P' = P - K K^T S`` (``kalman_update``). The probe's own H is the observation of its
step (the same batch the trainer logs).

**The run's noise** (``variogram_noise``): the realised-minus-predicted changes of the observed entropy
over one and two steps have ``E e_h^2 = h q + 2 R``: q, the step noise the predictions leave out (a
jump, a bend), and R, the logged entropy's noise, from the two (their discounted medians over the
chi-square(1) median: robust to a few jumps, ``robust_square_mean``).

**The fresh part, pooled.** Each probe estimates the expected step's gradient part per unit lr,
``g_i = Gamma_i / lr_i`` with variance ``v_i``. Their pool discounts age (``lambda^age``: the expected
step drifts) and adds the spread between probes beyond their own variances, ``tau^2 = max(0, s^2 -
mean v)`` (a random effect: a batch whose advantages are all 0 has ``v = 0``, the next may not):
``w_i = lambda^age_i / (v_i + tau^2)``, ``g = sum w g_i / sum w``, ``Var g = sum w_i^2 (v_i + tau^2) /
(sum w)^2`` (``pool``; where some ``v_i + tau^2 = 0`` the discounted mean, its
variance from the estimates' spread).

**Forecast k steps ahead** (``horizon_moments``): ``L_{n+k} = L_n + beta U_k + e`` with ``U_k`` the
predicted change over k steps (the one-batch formula, the fresh part pooled: ``pooled_changes``) and
``Var e = (m_beta^2 + P_beta) V_k + k q`` (V_k the variance of U_k): mean ``m_L + m_beta U_k``,
variance ``P_LL + 2 U_k P_Lbeta + U_k^2 P_beta + Var e``.

**Calibrated on the run** (``run_scale``): what the model still leaves out shows in its own errors.
Each forecast at horizon k is compared with the entropy logged k steps later, ``z = (y - mean) / SE``;
the SE at k is multiplied by ``c_k``, ``c_k^2 = (n0 + n m) / (n0 + n)`` with m the robust mean of z^2
and n their discounted count (n0 pseudo-errors of size 1: no history, no change).
"""
from __future__ import annotations

import math

import torch

from entprobe.math import forecast as fc

Mat = list[list[float]]


def kalman_predict(m: list[float], P: Mat, a: float, b: float, q_L: float, q_2: float) -> tuple[list[float], Mat]:
    """One step of ``L' = L + a + b x_2``, ``x_2' = x_2`` (module docstring: ``a = 0, b = u`` for the
    gain on the predicted change u): ``m' = F m + (a, 0)``, ``P' = F P F^T + diag(q_L, q_2)``, ``F =
    [[1, b], [0, 1]]``."""
    (p0, p1), (_, p2) = P
    m2 = [m[0] + a + b * m[1], m[1]]
    P2 = [[p0 + 2 * b * p1 + b * b * p2 + q_L, p1 + b * p2], [p1 + b * p2, p2 + q_2]]
    return m2, P2


def kalman_update(m: list[float], P: Mat, y: float, R: float) -> tuple[list[float], Mat]:
    """The observation ``y = L + e``, ``Var e = R``: ``S = P_LL + R``, ``K = P[:, 0] / S``, ``m + K (y -
    m_L)``, ``P - K K^T S`` (R = 0: the level becomes y exactly)."""
    (a, b), (_, c) = P
    S = a + R
    if S <= 0:  # nothing uncertain and a noiseless observation: the level is known already
        return [y, m[1]], [[0.0, 0.0], [0.0, c]]
    k0, k1 = a / S, b / S
    nu = y - m[0]
    level = y if R == 0 else m[0] + k0 * nu  # R = 0: the observation itself (m + 1 (y - m) may round)
    return [level, m[1] + k1 * nu], [[0.0 if R == 0 else a - k0 * a, b - k0 * b], [b - k0 * b, c - k1 * b]]


def horizon_moments(m: list[float], P: Mat, a: float, b: float, V: float) -> tuple[float, float, float]:
    """``(mean, Var L_{n+k}, Var of the change)`` of ``L_{n+k} = L_n + a + b x_2 + e``, ``Var e = V``
    (module docstring): mean ``m_L + a + b m_2``; the change's variance ``b^2 P_22 + V``; the level's
    adds ``P_LL + 2 b P_L2``."""
    (p0, p1), (_, p2) = P
    var_change = b * b * p2 + V
    return m[0] + a + b * m[1], max(p0 + 2 * b * p1 + var_change, 0.0), max(var_change, 0.0)


def pool(x: list[float], v: list[float], age: list[float], lam: float) -> tuple[float, float, list[float], float]:
    """``(g, Var g, w, tau^2)``: the estimates ``x_i`` (variances ``v_i``, ``age_i`` steps old) pooled
    by inverse variance with a random effect ``tau^2`` and discounted by ``lam^age`` (module
    docstring), ``w`` the normalised weights (``g = sum w_i x_i``, ``Var g = sum w_i^2 (v_i + tau^2)``).
    One estimate: itself, its own variance. Some estimates without variance (a batch whose groups all
    tied: ``v_i = 0``) and no spread beyond the others' own (tau^2 = 0): the inverse-variance weights
    are undefined, so their discounted mean with the variance of its spread, ``sum a_i^2 (x_i -
    g)^2 n_eff / (n_eff - 1)`` (``a_i = lam^age_i / sum lam^age``; 0 only when every estimate is the
    same), not 0: the tied batches are not exact, and the estimates that differ from them say so."""
    if not x:
        raise ValueError("pool: no estimate")
    d = [lam ** a for a in age]
    sd = sum(d)
    mu0 = sum(di * xi for di, xi in zip(d, x)) / sd
    n_eff = sd * sd / sum(di * di for di in d)
    s2 = sum(di * (xi - mu0) ** 2 for di, xi in zip(d, x)) / sd * (n_eff / (n_eff - 1) if n_eff > 1 else 0.0)
    tau2 = max(0.0, s2 - sum(di * vi for di, vi in zip(d, v)) / sd)
    tot = [vi + tau2 for vi in v]
    if any(t <= 0 for t in tot):
        a = [di / sd for di in d]
        spread = sum(ai * ai * (xi - mu0) ** 2 for ai, xi in zip(a, x)) * (n_eff / (n_eff - 1) if n_eff > 1 else 0.0)
        return mu0, spread, a, tau2
    w = [di / t for di, t in zip(d, tot)]
    sw = sum(w)
    w = [wi / sw for wi in w]
    return sum(wi * xi for wi, xi in zip(w, x)), sum(wi * wi * t for wi, t in zip(w, tot)), w, tau2


def variogram_noise(a1: float, a2: float) -> tuple[float, float]:
    """``(q, R)``, the process noise a step and the observation noise, from the mean squared
    realised-minus-predicted changes ``a1``, ``a2`` of the observed entropy over one and two steps: for a level that
    moves by its predicted change plus a random step of variance q, observed with noise R, ``a_h = E
    (y_{t+h} - y_t - sum u)^2 = h q + 2 R``, so ``q = a2 - a1`` and ``R = (2 a1 - a2) / 2`` (each
    floored at 0)."""
    q = max(a2 - a1, 0.0)
    return q, max(a1 - q, 0.0) / 2


def discounted_quantile(x: list[float], age: list[float], lam: float, p: float, n0: float = 0.0,
                        prior: float = 0.0) -> float:
    """The p-quantile of the values ``x`` weighted ``lam^age``, with ``n0`` more of weight 1 at ``prior``:
    the smallest value whose cumulative weight reaches p of the total (``prior`` when there is nothing)."""
    pts = sorted([(xi, lam ** a) for xi, a in zip(x, age)] + ([(prior, n0)] if n0 > 0 else []))
    total = sum(w for _, w in pts)
    if total <= 0:
        return prior
    acc = 0.0
    for xi, w in pts:
        acc += w
        if acc >= p * total * (1 - 1e-12):
            return xi
    return pts[-1][0]


CHI2_1_MEDIAN = 0.454936423119572  # the median of a chi-square with 1 degree of freedom


def robust_square_mean(e2: list[float], age: list[float], lam: float) -> float:
    """``E e^2`` of normal errors from their squares, robust to a few jumps: the discounted median of
    ``e^2`` divided by the chi-square(1) median (``discounted_quantile``; 0 without any)."""
    return discounted_quantile(e2, age, lam, 0.5) / CHI2_1_MEDIAN if e2 else 0.0


def run_scale(z2: list[float], age: list[float], lam: float, n0: float) -> float:
    """``c``, the SE's factor from the squared standardized errors ``z^2`` of past forecasts:
    ``c^2 = (n0 + n m) / (n0 + n)`` with ``m`` their ``robust_square_mean`` (a rare jump moves it
    little) and n their discounted count, n0 pseudo-errors of size 1 (module docstring; 1 without any)."""
    n = sum(lam ** a for a in age)
    return math.sqrt((n0 + n * robust_square_mean(z2, age, lam)) / (n0 + n))


def pooled_changes(f: fc.ForecastInputs, ks, factor: float, gamma: float, var_rest: float, w_cur: float
                   ) -> list[tuple[list[float], float]]:
    """For each k in ``ks``: the predicted change over k steps at each kappa of the band (central
    second) and its largest variance over the band, the fresh part ``B_k Gamma`` with ``Gamma`` the
    pool's (at this probe's lr) instead of this batch's: ``Delta H(k) = A_k (M_1 + Gamma_1) + B_k Gamma
    + k W``. The pool is ``w_cur`` x this batch's estimate + the rest, whose variance ``var_rest`` is
    what this batch's rows do not show (``Var Gamma - w_cur^2 v_cur``); so the variance is the
    jackknife of this batch's rows with weights ``(A_k, w_cur B_k, k)`` (math/forecast.py; without
    H's row: the level is the filter's), plus ``B_k^2 var_rest``, plus the fresh steps' spread
    ``var_fresh sum c_i^2``; all at ``factor`` x the lr."""
    K = max(ks)
    series = [fc._series_upto(K, f.t, f.beta1, f.beta2, kap) for kap in fc.kappa_band(f.kappa_c)]
    M = f.h_rows.numel()
    gram = fc.centred_gram(torch.stack([f.mom_rows + f.grad_rows, f.grad_rows, f.wd_rows]))
    out = []
    for k in ks:
        points, var = [], 0.0
        for A_s, B_s, C_s in series:
            A, Bk, c2 = A_s[k - 1], B_s[k - 1], C_s[k - 1]
            points.append(factor * (A * (f.mom + f.grad) + Bk * gamma + k * f.wd))
            w = [factor * A, factor * Bk * w_cur, factor * k]
            other = (factor * Bk) ** 2 * var_rest
            var = max(var, fc.jackknife_variance(gram, w, M) + other + factor ** 2 * f.var_fresh * c2)
        out.append((points, var))
    return out
