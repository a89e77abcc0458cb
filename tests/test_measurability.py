"""An importance-sampled measurement the weights cannot support is reported as unmeasurable: never
a number (an exact 0, or another estimator's value) presented as the measured change."""
from __future__ import annotations

import math

import torch

from entprobe.pipeline.stages.ground_truth import importance_estimates, measurability, resampled_change, true_change
from entprobe.pipeline.stages.paired import compare_with_prediction
from entprobe.reporting.verdict import flags, verdict_lines


def _draw(spread: float, B: int = 16, G: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S = -torch.rand(B, G, generator=gen, dtype=torch.float64) * 8 - 1
    L = torch.randint(1, 6, (B, G), generator=gen)
    return S, S + spread * torch.randn(B, G, generator=gen, dtype=torch.float64), L


def test_degenerate_weights_are_unmeasurable_with_the_reason():
    """ESS/N 0.1 (log-weights of sd 3): deltaH_true and its interval NaN, measurable False, the
    reason names ESS/N; the paired test is not made (pred_consistent None); the verdict says
    'unmeasurable' and does not raise non_finite or call first order consistent."""
    S, S_upd, L = _draw(3.0)
    est_res, psi = importance_estimates(S, S_upd, L, L.amax(-1), "dr_grpo", 10.0, warn_psis=False)
    assert est_res["ESS_frac"] < 0.3 and math.isfinite(est_res["deltaH_cv"])  # a number exists...
    res = {"deltaH_pred": -0.01, "SE_deltaH_pred": 0.002, "H_orig": 2.0, **est_res,
           **true_change(est_res, psi, "cv", ess_threshold=0.3)}
    assert res["measurable"] is False and "ESS/N" in res["unmeasurable_reason"]  # ...but is not reported
    assert all(math.isnan(res[k]) for k in ("deltaH_true", "SE_deltaH_true", "ci95_true_low", "ci95_true_high"))
    e = torch.full((16, 1), -0.01, dtype=torch.float64)
    res.update(compare_with_prediction(res, psi["cv"], e))
    assert res["pred_consistent"] is None and math.isnan(res["deltaH_true_minus_pred"])
    codes = [c for c, _ in flags(res, 0.3)]
    assert "unmeasurable" in codes and "non_finite" not in codes and "inconsistent" not in codes
    rows = {r[0]: r for r in verdict_lines(res)}
    assert rows["measured"][1] == "unmeasurable" and "difference" not in rows


def test_small_steps_are_measurable_and_k_hat_is_reported_or_explained():
    S, S_upd, L = _draw(1e-3)
    est_res, psi = importance_estimates(S, S_upd, L, L.amax(-1), "sequence", 10.0, warn_psis=False)
    out = true_change(est_res, psi, "cv", ess_threshold=0.3)
    assert out["measurable"] is True and out["deltaH_true"] == est_res["deltaH_cv"]
    assert math.isfinite(est_res["psis_khat"]) and "psis_khat_note" not in est_res  # 64 weights
    small = importance_estimates(S[:4, :4][:, :2], S_upd[:4, :2], L[:4, :2], L[:4, :2].amax(-1), "sequence",
                                 10.0, warn_psis=False)[0]
    assert math.isnan(small["psis_khat"]) and "got 8" in small["psis_khat_note"] and math.isnan(small["deltaH_psis"])
    # PSIS as the reported estimate where it is undefined: unmeasurable, with PSIS's reason
    out = true_change(small, {"psis": torch.full((4,), math.nan)}, "psis", ess_threshold=0.3)
    assert out["measurable"] is False and "needs >= 25" in out["unmeasurable_reason"]


def test_heavy_tails_alone_make_it_unmeasurable_where_the_weights_spread():
    """k-hat counts where the largest weight is over twice the mean: a tail shape fitted to
    weights all within 1e-4 of 1 (a small step) says nothing about the estimate."""
    spread = {"is/w_max": 3.0, "is/mean_importance_ratio": 1.0}
    assert measurability({"ESS_frac": 0.9, "psis_khat": 0.85, **spread}, 0.3) == "k-hat 0.85 > 0.7"
    tiny = {"is/w_max": 1.0001, "is/mean_importance_ratio": 1.0}
    assert measurability({"ESS_frac": 0.9999, "psis_khat": 0.85, **tiny}, 0.3) == ""
    assert measurability({"ESS_frac": 0.9, "psis_khat": math.nan, **spread}, 0.3) == ""
    assert measurability({"ESS_frac": math.nan}, 0.3).startswith("ESS/N nan")


def test_resampled_change_by_hand():
    """mean over prompts of (mean_g f_fresh - mean_g f_orig), SE over prompts."""
    f0 = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]], dtype=torch.float64)  # means 2, 2, 2
    f1 = torch.tensor([[2.0, 2.0], [3.0, 3.0], [1.0, 1.0]], dtype=torch.float64)  # means 2, 3, 1
    r = resampled_change(f1, f0)
    assert r["deltaH_resample"] == 0.0
    assert math.isclose(r["SE_deltaH_resample"], math.sqrt(1.0 / 3))  # sd([0, 1, -1]) = 1, / sqrt(3)
    assert r["ci95_resample_low"] < 0 < r["ci95_resample_high"]
