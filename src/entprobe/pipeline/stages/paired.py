"""The paired test of first order: the measured change minus the predicted one on the same E
responses, its SE over E's prompts with the rounding of the two forward passes counted in it, and
the smallest lr at which that difference resolves anything beyond rounding.

    out = compare_with_prediction(res, psi, e)   # deltaH_true_minus_pred +- SE, pred_consistent, ...
"""
from __future__ import annotations

import math

import torch

from entprobe.math import estimators as est


def rounding_true_minus_pred(res: dict) -> float:
    """A bound on what rounding moves ``deltaH_true - deltaH_pred`` by: the forward passes' rounding
    of the measured change (``rounding_deltaH_true``, stages/ground_truth.py) plus the rounding of
    the step the parameters took, ``Xbar . r`` with ``|Xbar . r| <= rounding_step``; of the latter
    no more is counted than the realised step's own departure from the predicted one,
    ``|deltaH1_step - deltaH_pred|`` (both are ``-Xbar .`` a step: the rounded step and the step
    model's), so a step model that misses what the optimizer does is not excused as rounding.
    The prediction's own rounding (fp32 dots: ~eps32 relative to deltaH_pred, so it falls with the
    lr) is left out: at any lr where rounding matters it is far below the forward passes' floor."""
    r = res.get("rounding_deltaH_true", 0.0)
    step, d1, pred = res.get("rounding_step"), res.get("deltaH1_step"), res.get("deltaH_pred")
    if step is not None and d1 is not None and pred is not None and math.isfinite(d1 - pred):
        r += min(step, abs(d1 - pred))
    return float(r) if math.isfinite(r) else 0.0


def lr_floor(lr: float | None, se_sampling: float, rounding: float) -> float:
    """The smallest lr at which the paired difference resolves anything beyond rounding: its
    sampling SE is second order in the step, ``SE(lr) = SE(lr0) (lr / lr0)^2`` (the estimators
    paired to second order: ``cv``, and ``snis``/``clip`` in the separable modes), while the
    rounding bound R does not depend on the lr (a floor: eps x the values' magnitudes x their
    number), so ``SE(lr_floor) = R`` gives ``lr_floor = lr0 sqrt(R / SE(lr0))``. Above the floor
    (R < SE) this is the extrapolation; below it (R > SE, the result then exceeds lr0) it is a lower
    bound, since the sampling SE there holds rounding noise as well as the ~lr^2 difference. NaN
    without an lr or a positive SE; 0 when R is 0."""
    if not lr or not (se_sampling > 0) or not math.isfinite(se_sampling) or not math.isfinite(rounding):
        return math.nan
    return float(lr) * math.sqrt(rounding / se_sampling)


def compare_with_prediction(res: dict, psi: torch.Tensor, e: torch.Tensor | None) -> dict:
    """``deltaH_true - deltaH_pred`` on the same E responses, with its paired SE: per prompt of E
    the measured contribution psi_n minus the predicted one e_n (both for the step taken on this
    U, so the U side cancels): ``SE_sampling = sd(psi - e) / sqrt(B_E)``, Student-t with B_E - 1
    degrees of freedom. ``pred_consistent``: the difference's 95% interval contains 0 (None when
    the measurement is unmeasurable: no test is made, and the difference is NaN).

    The measured estimators are paired with the prediction by construction (math/importance.py):
    to first order in the step, ``psi_n`` and ``e_n`` are the same function of the same responses,
    so ``psi - e`` is second order and this test has power where first order holds.

    Rounding is counted in the SE: ``SE = sqrt(SE_sampling^2 + R^2)`` with R the bound
    ``rounding_true_minus_pred`` (``rounding_true_minus_pred()``), so the interval is at least
    ``+- t R`` wide and no difference that rounding can make excludes 0: at a small lr, where the
    difference (second order, ~lr^2) is below the forward passes' fp32 floor, the test says
    consistent instead of being decided by rounding. ``lr_floor_true_minus_pred``: the lr below
    which R exceeds the sampling SE (``lr_floor``); ``SE_deltaH_true_minus_pred_sampling``: the SE
    without R."""
    if res.get("measurable") is False:
        nan = math.nan
        return {"deltaH_true_minus_pred": nan, "SE_deltaH_true_minus_pred": nan, "ci95_true_minus_pred_low": nan,
                "ci95_true_minus_pred_high": nan, "z_true_minus_pred": nan, "pred_consistent": None,
                "SE_deltaH_true_minus_pred_sampling": nan, "rounding_true_minus_pred": nan,
                "lr_floor_true_minus_pred": nan}
    diff = res["deltaH_true"] - res["deltaH_pred"]
    out = {"deltaH_true_minus_pred": diff}
    if e is None:
        return out
    d = psi.double() - e.sum(1).double()
    se_s = math.sqrt(est.mean_variance(d)) if torch.isfinite(d).all() else float("nan")
    R = rounding_true_minus_pred(res)
    se = math.hypot(se_s, R)
    lo, hi = est.interval(diff, se, d.numel() - 1)
    out.update({"SE_deltaH_true_minus_pred": se, "ci95_true_minus_pred_low": lo,
                "ci95_true_minus_pred_high": hi, "z_true_minus_pred": diff / se if se > 0 else float("nan"),
                "pred_consistent": bool(lo <= 0.0 <= hi) if math.isfinite(se) else False,
                "SE_deltaH_true_minus_pred_sampling": se_s, "rounding_true_minus_pred": R,
                "lr_floor_true_minus_pred": lr_floor(res.get("lr"), se_s, R)})
    return out
