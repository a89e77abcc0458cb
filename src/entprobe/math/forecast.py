"""The entropy k optimizer steps ahead (pure math on scalars and per-prompt rows; no config, no I/O).

At a probe, the step about to be taken is step 1 of the horizon. AdamW's update of step j is
``-lr (m_j / bc1_j) / (sqrt(v_hat_j) + eps) - lr wd theta`` with ``bc1_j = 1 - beta1^(t + j)`` (t the
state's step count before step 1) and

    m_j = beta1^(j-1) m_1 + (1 - beta1) sum_{i=2..j} beta1^(j-i) g_i

m_1 (after step 1's gradient) is known now: the *carried* part of every later update. The future
gradients g_i (i >= 2) are not: their expected effect is the fresh step's gradient part. To first
order at theta (X held at theta: the change of the entropy's gradient along the path is second order),
step j changes the entropy by

    C_j + F_j + W,   C_j = beta1^(j-1) r_j (M_1 + Gamma_1),   F_j = r_j sum_{i=2..j} beta1^(j-i) Gamma_i

with ``M_1``, ``Gamma_1``, ``W`` the predicted momentum, gradient and weight-decay parts of step 1 (the
cross-prompt prediction's; W held: theta moves little), ``Gamma_i`` the gradient part of step i's fresh
batch (mean Gamma_1: the expected step's, estimated by step 1's; spread: each batch's own, the
U-statistic's Y side), and ``r_j = (bc1_1 / bc1_j) (D_1 / D_j)`` the change of the update's scale:
the bias correction (known) and the denominator ``D = sqrt(v_hat) + eps``, whose drift is bounded:
with future ``g^2 = kappa v_hat_1`` (per coordinate, on average) ``v_hat_j / v_hat_1 = nu_j(kappa) =
[beta2^(j-1) (1 - beta2^(t+1)) + kappa (1 - beta2^(j-1))] / (1 - beta2^(t+j))``: kappa = 0 (no further
gradient: the smallest v_hat, the largest steps) is a bound; kappa = 1 keeps v_hat; the central
value is the current step's ``kappa_c = sum g_1^2 / sum v_hat_1``, the band runs to ``2 max(kappa_c, 1)``.

Summed over the horizon: ``Delta H(k) = A_k (M_1 + Gamma_1) + B_k Gamma + k W`` with
``A_k = sum_{j<=k} beta1^(j-1) r_j``, ``B_k = sum_{2<=j<=k} r_j (1 - beta1^(j-1)) / (1 - beta1)``. Its
variance: the estimates' (the jackknife of the combined per-prompt rows, H's included: they share the
batch), the fresh steps' own spread ``var_fresh sum_{i=2..k} c_i^2`` with ``c_i = sum_{j=i..k} r_j
beta1^(j-i)``, and, for the *logged* entropy at step k (a batch's token mean, not the population's),
that batch's sampling noise ``var_H`` (the current batch's, same size). Every part of Delta H is
proportional to the lr: at ``factor`` x lr for the whole horizon it is ``factor`` times.

The forecast of an entropy is clipped to the range the functional can take, ``[0, H_max]`` (``ln V``
nats per token; ``max_new_tokens ln V`` per response for ``sequence``): the first-order path is not
bounded, the entropy is, and an interval clipped to the parameter space keeps its coverage.
``coefficient_series`` gives every horizon's coefficients in one O(K) pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from entprobe.math import estimators as est

HORIZONS = (1, 5, 10)


def nu(j: int, t: float, beta2: float, kappa: float) -> float:
    """``v_hat_j / v_hat_1`` when every later gradient has ``g^2 = kappa v_hat_1`` (module docstring)."""
    return (beta2 ** (j - 1) * (1 - beta2 ** (t + 1)) + kappa * (1 - beta2 ** (j - 1))) / (1 - beta2 ** (t + j))


def scales(k: int, t: float, beta1: float, beta2: float, kappa: float) -> list[float]:
    """``r_j`` for j = 1..k: ``(bc1_1 / bc1_j) / sqrt(nu_j)`` (r_1 = 1); all 1 for plain SGD
    (``beta2 = 0``: no denominator, no bias correction)."""
    if beta2 == 0:
        return [1.0] * k
    bc1 = lambda j: 1 - beta1 ** (t + j)  # noqa: E731
    return [bc1(1) / bc1(j) / math.sqrt(nu(j, t, beta2, kappa)) for j in range(1, k + 1)]


def coefficient_series(K: int, t: float, beta1: float, beta2: float, kappa: float
                       ) -> tuple[list[float], list[float], list[float]]:
    """``(A_k, B_k, sum_{i=2..k} c_i^2)`` for every k = 1..K (module docstring), in O(K) by the
    recurrences (``r = r_{k+1}``, ``b = beta1``; ``P_k = sum_{i=2..k} c_i(k) b^(k-i)``, ``Q_k =
    sum_{i=2..k} b^(2(k-i))``; at k = 1 ``A = r_1``, B, C, P and Q are 0; ``c_i(k+1) = c_i(k) + r b^(k+1-i)``):

        A_{k+1} = A_k + b^k r,   B_{k+1} = B_k + r (1 - b^k) / (1 - b),
        C_{k+1} = C_k + 2 r b P_k + r^2 b^2 Q_k + r^2,   P_{k+1} = b P_k + r b^2 Q_k + r,   Q_{k+1} = b^2 Q_k + 1

    (``(1 - b^k) / (1 - b)`` is ``sum_{i<k} b^i``: k for b = 1)."""
    r = scales(K, t, beta1, beta2, kappa)
    A, Bs, C = [r[0]], [0.0], [0.0]
    P = Q = 0.0
    geo, tail = 1.0, 0.0  # b^k and sum_{i<k} b^i once updated at the top of step k -> k+1
    for k in range(1, K):
        rk = r[k]
        tail += geo
        geo *= beta1
        A.append(A[-1] + geo * rk)
        Bs.append(Bs[-1] + rk * tail)
        C.append(C[-1] + 2 * rk * beta1 * P + rk * rk * beta1 * beta1 * Q + rk * rk)
        P, Q = beta1 * P + rk * beta1 * beta1 * Q + rk, beta1 * beta1 * Q + 1.0
    return A, Bs, C


def coefficients(k: int, t: float, beta1: float, beta2: float, kappa: float) -> tuple[float, float, float]:
    """``(A_k, B_k, sum_{i=2..k} c_i^2)`` (module docstring; ``coefficient_series``'s k-th)."""
    A, Bs, C = coefficient_series(k, t, beta1, beta2, kappa)
    return A[-1], Bs[-1], C[-1]


@dataclass
class ForecastInputs:
    """What the forecast is made of: H at theta and step 1's parts (values and per-prompt rows, the
    rows of ``rollout_ustat.cross_prompt`` / ``unit_mean_rows``: mean = value), the fresh step's
    variance ``var_fresh`` (Var of one batch's gradient part), the logged entropy's ``var_H``,
    AdamW's ``t``, ``beta1``, ``beta2`` and ``kappa_c``, and the degrees of freedom of the intervals.
    ``H_max``: the largest value the population's entropy functional can take (``ln V`` per token,
    ``max_new_tokens ln V`` for ``sequence``; inf: unknown); ``H_logged_max`` the logged batch
    value's (the same when it is a mean of token entropies; inf for the score form's sampled ``-S``,
    which a token of probability below 1/V pushes past ``ln V``)."""
    H: float
    h_rows: torch.Tensor
    grad: float
    grad_rows: torch.Tensor
    mom: float
    mom_rows: torch.Tensor
    wd: float
    wd_rows: torch.Tensor
    var_fresh: float
    var_H: float
    t: float
    beta1: float
    beta2: float
    kappa_c: float
    df: float
    H_max: float = math.inf
    H_logged_max: float = math.inf


def kappa_band(kappa_c: float) -> tuple[float, float, float]:
    """(lowest, central, highest) kappa: 0 (a bound), the current step's, ``2 max(kappa_c, 1)``."""
    return 0.0, kappa_c, 2 * max(kappa_c, 1.0)


def clip_to(v: float, hi: float) -> float:
    """``v`` clipped to an entropy's range ``[0, hi]``. An interval clipped to the parameter space
    keeps its coverage: the true value lies in ``[0, hi]``, so an interval that holds it still does."""
    return min(max(v, 0.0), hi)


_SERIES: dict[tuple, tuple[list[float], list[float], list[float]]] = {}  # the last few coefficient_series


def _series_upto(K: int, t: float, beta1: float, beta2: float, kappa: float):
    """``coefficient_series`` of at least K steps, kept for the next call with the same optimizer
    state (a rule reading k = 1..K one at a time): computed to twice the length asked before, so K
    calls cost O(K) in all."""
    key = (t, beta1, beta2, kappa)
    got = _SERIES.get(key)
    if got is None or len(got[0]) < K:
        got = coefficient_series(max(K, 2 * len(got[0]) if got else K), t, beta1, beta2, kappa)
        if len(_SERIES) >= 12:
            _SERIES.pop(next(iter(_SERIES)))
        _SERIES[key] = got
    return got


def centred_gram(rows: torch.Tensor) -> list[list[float]]:
    """``G = C C^T`` of the rows [P, M] centred on their means: ``sum_u (r_u - mean r)^2`` of any
    combination ``r = sum_p w_p rows_p`` is ``w^T G w``."""
    c = rows.double() - rows.double().mean(1, keepdim=True)
    return (c @ c.T).tolist()


def jackknife_variance(gram: list[list[float]], w: list[float], M: int) -> float:
    """The squared ``SE_jack`` of ``ustat.row_statistics`` for the rows ``sum_p w_p rows_p`` of M
    units: ``U_{-u} = (M U - 2 r_u) / (M - 2)`` deviates from its mean by ``-2 (r_u - mean r) / (M - 2)``,
    so ``Var_jack = 4 (M - 1) / (M (M - 2)^2) w^T G w`` (``centred_gram``), whatever U is."""
    if M < 3:
        raise ValueError("the U-statistic jackknife needs >= 3 units")
    quad = sum(w[i] * w[j] * gram[i][j] for i in range(len(w)) for j in range(len(w)))
    return 4 * (M - 1) / (M * (M - 2) ** 2) * max(quad, 0.0)


def forecast_series(f: ForecastInputs, K: int, factor: float = 1.0, z: float | None = None,
                    ks=None) -> list[dict]:
    """``forecast(f, k, factor, z)`` for every k in ``ks`` (default 1..K, each <= K): the
    coefficients from ``coefficient_series`` (one O(K) pass, kept for the next call), each
    jackknife variance as a quadratic form in the rows' Gram matrix (``jackknife_variance``): O(1) a k."""
    q = est.t_quantile(f.df) if z is None else z
    series = [_series_upto(K, f.t, f.beta1, f.beta2, kappa) for kappa in kappa_band(f.kappa_c)]
    M = f.h_rows.numel()
    gram = centred_gram(torch.stack([f.h_rows, f.mom_rows + f.grad_rows, f.grad_rows, f.wd_rows]))
    base = f.mom + f.grad
    out = []
    for k in (range(1, K + 1) if ks is None else ks):
        points, var_pop, var_dH = [], 0.0, 0.0
        for A_s, B_s, C_s in series:
            A, Bk, c2 = A_s[k - 1], B_s[k - 1], C_s[k - 1]
            points.append(factor * (A * base + Bk * f.grad + k * f.wd))
            w = [factor * A, factor * Bk, factor * k]
            fresh = factor ** 2 * f.var_fresh * c2
            var_pop = max(var_pop, jackknife_variance(gram, [1.0] + w, M) + fresh)
            var_dH = max(var_dH, jackknife_variance(gram, [0.0] + w, M) + fresh)
        out.append(_bounded(f, points, var_pop, var_dH, q))
    return out


def _bounded(f: ForecastInputs, points: list[float], var_pop: float, var_dH: float, q: float) -> dict:
    """One horizon step's results (``forecast``) from the kappa band's changes ``points`` (central
    second) and the largest variances over the band, the entropies clipped to their range."""
    dH, lo, hi = points[1], min(points), max(points)
    se_pop, se_log, se_dH = math.sqrt(var_pop), math.sqrt(var_pop + f.var_H), math.sqrt(var_dH)
    return {"H": clip_to(f.H + dH, f.H_max), "dH": dH, "SE": se_pop, "SE_logged": se_log,
            "low": clip_to(f.H + lo - q * se_log, f.H_logged_max), "high": clip_to(f.H + hi + q * se_log, f.H_logged_max),
            "pop_low": clip_to(f.H + lo - q * se_pop, f.H_max), "pop_high": clip_to(f.H + hi + q * se_pop, f.H_max),
            "dH_low": lo - q * se_dH, "dH_high": hi + q * se_dH}


def forecast(f: ForecastInputs, k: int, factor: float = 1.0, z: float | None = None) -> dict:
    """The entropy after k steps at ``factor`` x the lr: ``H_k`` (central kappa) with its 95% interval
    for the *logged* entropy (``low``/``high``: the kappa band's extremes -+ t SE_logged) and the SE of
    the population's entropy ``SE`` (estimates and fresh steps, no logged-batch noise: what a rule
    acting on the trend reads; ``pop_low`` / ``pop_high`` its interval), ``dH`` the change (first
    order: not bounded) with its interval ``dH_low`` / ``dH_high`` (the estimates of the parts without
    H's and the fresh steps: whether the change's sign is resolved), ``SE_logged``. H and the intervals
    of an entropy are clipped to its range: ``[0, H_max]`` (the population's), ``[0, H_logged_max]``
    (the logged value's): clipping keeps an interval's coverage (``clip_to``). ``z``: the quantile
    (default Student-t with ``df`` degrees of freedom)."""
    return forecast_series(f, k, factor, z, ks=(k,))[0]


def forecast_results(f: ForecastInputs | None, factor: float = 1.0, horizons=HORIZONS) -> dict:
    """``forecast_H_k<k>`` with ``_low`` / ``_high`` (the logged entropy's 95% interval) and
    ``SE_forecast_H_k<k>`` (the population's) for each horizon; nothing when there is no forecast
    (``f`` None: ``rollout_prediction.forecast_inputs`` found none to make)."""
    if f is None:
        return {}
    out = {}
    for k, r in zip(horizons, forecast_series(f, max(horizons), factor, ks=horizons)):
        out.update({f"forecast_H_k{k}": r["H"], f"forecast_H_k{k}_low": r["low"], f"forecast_H_k{k}_high": r["high"],
                    f"SE_forecast_H_k{k}": r["SE"]})
    return out
