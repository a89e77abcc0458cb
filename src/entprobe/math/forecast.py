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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from entprobe.math import estimators as est
from entprobe.math.ustat import row_statistics

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


def coefficients(k: int, t: float, beta1: float, beta2: float, kappa: float) -> tuple[float, float, float]:
    """``(A_k, B_k, sum_{i=2..k} c_i^2)`` (module docstring)."""
    r = scales(k, t, beta1, beta2, kappa)
    A = sum(beta1 ** (j - 1) * r[j - 1] for j in range(1, k + 1))
    Bk = sum(r[j - 1] * (1 - beta1 ** (j - 1)) / (1 - beta1) for j in range(2, k + 1))
    c2 = sum(sum(r[j - 1] * beta1 ** (j - i) for j in range(i, k + 1)) ** 2 for i in range(2, k + 1))
    return A, Bk, c2


@dataclass
class ForecastInputs:
    """What the forecast is made of: H at theta and step 1's parts (values and per-prompt rows, the
    rows of ``rollout_ustat.cross_prompt`` / ``unit_mean_rows``: mean = value), the fresh step's
    variance ``var_fresh`` (Var of one batch's gradient part), the logged entropy's ``var_H``,
    AdamW's ``t``, ``beta1``, ``beta2`` and ``kappa_c``, and the degrees of freedom of the intervals."""
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


def kappa_band(kappa_c: float) -> tuple[float, float, float]:
    """(lowest, central, highest) kappa: 0 (a bound), the current step's, ``2 max(kappa_c, 1)``."""
    return 0.0, kappa_c, 2 * max(kappa_c, 1.0)


def forecast(f: ForecastInputs, k: int, factor: float = 1.0, z: float | None = None) -> dict:
    """The entropy after k steps at ``factor`` x the lr: ``H_k`` (central kappa) with its 95% interval
    for the *logged* entropy (``low``/``high``: the kappa band's extremes -+ t SE_logged) and the SE of
    the population's entropy ``SE`` (estimates and fresh steps, no logged-batch noise: what a rule
    acting on the trend reads; ``pop_low`` / ``pop_high`` its interval), ``dH`` the change,
    ``SE_logged``. H, low and high are floored at 0 (an entropy; the first-order change is not bounded). ``z``: the quantile (default Student-t
    with ``df`` degrees of freedom)."""
    q = est.t_quantile(f.df) if z is None else z
    points, ses = [], []
    for kappa in kappa_band(f.kappa_c):
        A, Bk, c2 = coefficients(k, f.t, f.beta1, f.beta2, kappa)
        dH = factor * (A * (f.mom + f.grad) + Bk * f.grad + k * f.wd)
        rows = f.h_rows + factor * (A * (f.mom_rows + f.grad_rows) + Bk * f.grad_rows + k * f.wd_rows)
        _, _, _, se_est = row_statistics(f.H + dH, rows)
        points.append(dH)
        ses.append((se_est ** 2 + factor ** 2 * f.var_fresh * c2))
    dH = points[1]
    var_pop = max(ses)
    se_log = math.sqrt(var_pop + f.var_H)
    pos = lambda v: max(v, 0.0)  # noqa: E731  (every entropy functional is >= 0; first order is not)
    return {"H": pos(f.H + dH), "dH": dH, "SE": math.sqrt(var_pop), "SE_logged": se_log,
            "low": pos(f.H + min(points) - q * se_log), "high": pos(f.H + max(points) + q * se_log),
            "pop_low": f.H + min(points) - q * math.sqrt(var_pop), "pop_high": f.H + max(points) + q * math.sqrt(var_pop)}


def forecast_results(f: ForecastInputs, factor: float = 1.0, horizons=HORIZONS) -> dict:
    """``forecast_H_k<k>`` with ``_low`` / ``_high`` (the logged entropy's 95% interval) and
    ``SE_forecast_H_k<k>`` (the population's) for each horizon."""
    out = {}
    for k in horizons:
        r = forecast(f, k, factor)
        out.update({f"forecast_H_k{k}": r["H"], f"forecast_H_k{k}_low": r["low"], f"forecast_H_k{k}_high": r["high"],
                    f"SE_forecast_H_k{k}": r["SE"]})
    return out
