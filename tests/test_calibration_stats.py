"""benchmarks/calibration_stats.py, the statistics behind docs/calibration.md's table, on cases with
closed forms: the binomial tail, the ratio of means and its delta-method SE, the slope through the
origin, and the per-(checkpoint, lr) coverage of 0 and the breakdown lr."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import calibration_stats as cs  # noqa: E402


def test_binomial_tail():
    assert cs.binom_sf(0, 7, 0.3) == pytest.approx(1.0, rel=1e-14)
    assert cs.binom_sf(2, 3, 0.5) == pytest.approx(0.5, rel=1e-14)  # (3 + 1) / 8
    assert cs.binom_sf(3, 20, 0.05) == pytest.approx(1 - sum(math.comb(20, j) * 0.05 ** j * 0.95 ** (20 - j)
                                                                 for j in range(3)), rel=1e-12)


def test_ratio_and_slope():
    p = [1.0, 2.0, -0.5, 3.0]
    t = [2 * x for x in p]  # measured exactly twice the prediction: ratio and slope 2, no spread
    R, se, lo, hi = cs.ratio_of_means(t, p)
    assert (R, se, lo, hi) == (pytest.approx(2.0, rel=1e-14), pytest.approx(0.0, abs=1e-15),
                               pytest.approx(2.0, rel=1e-14), pytest.approx(2.0, rel=1e-14))
    t2 = [1.5, 1.0, 0.5, 4.0]
    R, se, lo, hi = cs.ratio_of_means(t2, p)
    mp = statistics.fmean(p)
    assert R == pytest.approx(statistics.fmean(t2) / mp, rel=1e-14)
    resid = [a - R * b for a, b in zip(t2, p)]
    assert se == pytest.approx(statistics.stdev(resid) / 2 / abs(mp), rel=1e-12) and lo <= R <= hi
    b, blo, bhi = cs.slope(t2, p)
    assert b == pytest.approx(sum(a * c for a, c in zip(t2, p)) / sum(c * c for c in p), rel=1e-14)
    assert blo <= b <= bhi
    assert all(math.isnan(x) for x in cs.ratio_of_means([1.0], [1.0]))  # one draw: no interval


def row(lo, hi, pred=-1.0, true=-1.0, ok="ok"):
    return {"checkpoint": "c", "lr": 1e-3, "status": ok, "measurable": True, "deltaH_pred": pred,
            "SE_deltaH_pred": 0.1, "deltaH_true": true, "SE_deltaH_true": 0.1, "ci95_true_minus_pred_low": lo,
            "ci95_true_minus_pred_high": hi, "deltaH_true_minus_pred": true - pred, "SE_deltaH_true_minus_pred": 0.05,
            "ESS_frac": 0.95, "unmeasurable_reason": "", "batch_U/frac_zero_var_groups": 0.0, "wall_s": 1.0}


def test_summary_counts_the_intervals_that_hold_zero():
    rows = [row(-0.1, 0.1)] * 17 + [row(0.05, 0.2, true=-0.9)] * 3  # 3 of 20 reject
    (s,) = cs.summarise(rows, B_E=8)
    assert (s["measurable"], s["rejections"], s["holds0"]) == (20, 3, pytest.approx(0.85))
    assert s["SE_holds0"] == pytest.approx(math.sqrt(0.85 * 0.15 / 20))
    assert s["p_excess_rejections"] == pytest.approx(cs.binom_sf(3, 20, 0.05))
    assert s["sign_resolved_n"] == 20 and s["sign_resolved_agree"] == 20
    assert cs.breakdown([s]) == {"c": "not within the lrs run"}  # p 0.075: not clearly above 5%
    (s6,) = cs.summarise([row(-0.1, 0.1)] * 14 + [row(0.05, 0.2, true=-0.9)] * 6, B_E=8)
    assert cs.breakdown([s6])["c"].startswith("lr 0.001: 6/20 rejected")
