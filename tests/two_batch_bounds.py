"""Rounding bounds on the two-batch probe's numbers between two computations of the same run (another
projection path, sharding, activation checkpointing, another machine's kernels), from the per-unit
magnitudes ``recording_units`` records (conftest.py).

Every per-unit projection ``V_n . d_j`` (``a``, ``b``, the parts of ``e``, ``u`` in per_unit.json) is
a sum over the N parameters of terms ``V_n,i d_j,i`` that the two computations round on their own
paths: ``UnitMagnitudes.tol``, ``fp_tol`` of ``sum_i |V_n,i d_j,i|`` and N terms. Every reported
number is a mean or an SE of those per-unit values, bounded from them: means by the mean of the
per-unit bounds (triangle inequality), SEs by ``se_tol`` (exact: the SE is a seminorm), V = SE^2 by
``dSE (2 SE + dSE)``; the prediction also by Ybar's rounding carried through the update (the mean
of the u side's bounds: ``-Xbar . J dYbar``, to first order). The measured change is a difference
of two entropy estimates whose terms (-log p >= 0) sum to about |H_orig| each: every log-prob is a
function of the N parameters, so ``fp_tol(fp32, 2 |H_orig|, N)``, plus the step's rounding (the u
side again); per prompt (its SE) on the scale of ``B_E |H_orig|``, a bound on one prompt's entropy
when their mean is H_orig. A computation that dropped a unit, a direction, a part or a shard is
off by O(1) of the per-unit values.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from conftest import fp_tol, se_tol, welch_interval_tol
from entprobe.math import estimators as est

PARTS = ("gradient", "momentum", "weight_decay")


def per_unit(run_dir) -> dict:
    return json.loads((Path(run_dir) / "per_unit.json").read_text())


def unit_bounds(ref: dict, mags, dtype: torch.dtype = torch.float32) -> dict:
    """Per-unit bounds by per_unit.json array: ``a``, ``b``, ``u`` and each part of ``e``."""
    parts = [k for k in PARTS if f"SE_deltaH_pred_{k}" in ref or f"deltaH_pred_{k}" in ref]
    if not parts:  # one direction: the whole update (its per_unit.json name: the step model's part)
        parts = ["update" if ref.get("pred/step_model") == "optimizer_step" else "gradient"]
    out = {"a": mags.tol("E", 0, dtype), **{k: mags.tol("E", 1 + j, dtype) for j, k in enumerate(parts)},
           "b": mags.tol("U", 0, dtype)}
    if mags.U.shape[1] > 1:
        out["u"] = mags.tol("U", 1, dtype)
    return out


def bounds(ref: dict, mags, dtype: torch.dtype = torch.float32) -> dict:
    """Absolute bounds per results key for another computation of the run ``ref`` whose per-unit
    magnitudes are ``mags``; ``dtype``: the precision the two computations differ in."""
    unit = unit_bounds(ref, mags, dtype)
    parts = [k for k in unit if k not in ("a", "b", "u")]
    e_tot = sum(unit[k] for k in parts)
    step = float(unit["u"].mean()) if "u" in unit else 0.0

    def var(V, dse):  # V = SE^2 with SE moved by at most dse
        return dse * (2 * math.sqrt(V) + dse)
    sa, sb = se_tol(unit["a"]), se_tol(unit["b"])
    dVX, dVY = var(ref["V_X"], sa), var(ref["V_Y"], sb)
    dbars = float(unit["a"].mean() + unit["b"].mean())  # Xbar . P Ybar: the unit means of the same products
    dpred = float(e_tot.mean()) + step
    dse_pred = se_tol(e_tot)
    q = est.t_quantile(ref["B_E"] - 1)
    bars, lr, B_E = ref["bars_dot"], ref["lr"], ref["B_E"]
    dtrue = fp_tol(torch.float32, 2 * abs(ref["H_orig"]), mags.N) + step
    dse_true = se_tol([fp_tol(torch.float32, 2 * B_E * abs(ref["H_orig"]), mags.N) + step] * B_E)
    tol = {"bars_dot": dbars, "deltaH1": lr * dbars, "V_X": dVX, "V_Y": dVY, "SE_deltaH1": lr * math.hypot(sa, sb),
           "frac_var": (dVX + dVY) / bars ** 2 + ref["frac_var"] * 2 * dbars / abs(bars),
           "deltaH_pred": dpred, "SE_deltaH_pred": dse_pred, "SE_deltaH_pred_E": dse_pred,
           "ci95_pred_low": dpred + q * dse_pred, "ci95_pred_high": dpred + q * dse_pred,
           "deltaH_true": dtrue, "SE_deltaH_true": dse_true,
           **{f"SE_deltaH_pred_{k}": se_tol(unit[k]) for k in parts if k in PARTS},
           **{f"deltaH_pred_{k}": float(unit[k].mean()) + step for k in parts if k in PARTS}}
    if "u" in unit:
        tol["SE_deltaH_pred_U"] = se_tol(unit["u"])
    return tol


def assert_unit_values_agree(pu: dict, pu_ref: dict, unit: dict, label) -> None:
    """The per-unit projections of two computations (their per_unit.json) within ``unit``'s bounds."""
    for key, t in unit.items():
        got = pu[key] if key in ("a", "b", "u") else pu["e"][key]
        want = pu_ref[key] if key in ("a", "b", "u") else pu_ref["e"][key]
        d = (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs()
        assert (d <= t).all(), (label, key, d.tolist(), t.tolist())


def assert_runs_agree(res: dict, pu: dict, ref: dict, pu_ref: dict, mags, label, keys,
                      dtype: torch.dtype = torch.float32) -> None:
    """``res`` (and its per_unit.json ``pu``) equal ``ref``'s to the bounds above, on ``keys``."""
    assert_unit_values_agree(pu, pu_ref, unit_bounds(ref, mags, dtype), label)
    tol = bounds(ref, mags, dtype)
    for key in keys:
        assert abs(res[key] - ref[key]) <= tol[key], (label, key, res[key], ref[key], tol[key])


def variance_bounds(v, ta: torch.Tensor, tb: torch.Tensor, B_E: int, B_U: int, lr: float, dbars: float) -> dict:
    """Absolute bounds on each field of ``est.two_batch_variance`` when its per-unit a and b move by
    at most ``ta``, ``tb`` and bars_dot by ``dbars`` (``v``: one side's values): V = SE^2 from
    ``se_tol``, the SE, df and interval from ``welch_interval_tol``."""
    sa, sb = se_tol(ta), se_tol(tb)
    dVX, dVY = sa * (2 * math.sqrt(v.V_X) + sa), sb * (2 * math.sqrt(v.V_Y) + sb)
    w = welch_interval_tol(lr * dbars, [(lr ** 2 * v.V_X, B_E, lr * sa), (lr ** 2 * v.V_Y, B_U, lr * sb)])
    bars = (v.ci95_low + v.ci95_high) / 2 / -lr
    return {"V_X": dVX, "V_Y": dVY, "SE": w["SE"], "df": w["df"], "ci95_low": w["ci"], "ci95_high": w["ci"],
            "frac_var": (dVX + dVY) / bars ** 2 + v.frac_var * 2 * dbars / abs(bars)}
