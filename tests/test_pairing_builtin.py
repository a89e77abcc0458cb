"""The measured change pairs with the prediction on the built-in model end to end: at a step small
enough for first order (lr 1e-7), the sampling ``SE(measured - predicted)`` is a small fraction of
``SE(measured)`` in every weighting mode and for each importance estimator (docs/math.md, "Paired
with the prediction by construction").

Measured on the built-in model (B_E = 16, G = 4): 0.025 in ``sequence``, ``dr_grpo`` and
``per_token_avg`` (the floor the fp32 log-probs of two forward passes set at this step size);
before the pairing it was 1.07-1.60. The property holds for every draw of E and U, so the test
samples whatever the machine draws.
"""
from __future__ import annotations

import math

import pytest

from conftest import compose_cfg
from entprobe.cli.probe_job import run


@pytest.mark.parametrize("mode,is_mode", [("sequence", "cv"), ("dr_grpo", "cv"), ("per_token_avg", "cv"),
                                          ("sequence", "snis"), ("per_token_avg", "clip"),
                                          ("sequence", "psis")])
def test_measured_minus_predicted_is_a_small_fraction_of_the_measurement(tmp_path, mode, is_mode):
    res = run(compose_cfg(tmp_path, "optimizer.lr=1e-7", "batch.B_E=8", f"probe.weighting_mode={mode}",
                          f"importance.is_mode={is_mode}"))
    if is_mode == "psis" and not res["measurable"]:  # tied weights (repeated responses): PSIS undefined
        assert "tail fit failed" in res["unmeasurable_reason"] and math.isnan(res["deltaH_true"])
        pytest.skip(f"PSIS undefined on this draw: {res['unmeasurable_reason']}")
    assert res["measurable"] is True and res["ESS_frac"] > 0.999
    # the pairing's own SE (sampling); the reported SE adds the forward passes' rounding bound, which
    # at this lr is most of it (the verdict then says the test is below its rounding floor)
    ratio = res["SE_deltaH_true_minus_pred_sampling"] / res["SE_deltaH_true"]
    assert res["SE_deltaH_true_minus_pred"] >= res["SE_deltaH_true_minus_pred_sampling"]
    # psis: smoothing replaces the largest fifth of the weights by fitted quantiles, a first-order
    # change, so its pairing leaves a first-order residual (measured 0.32 here, 0.08-0.11 on the
    # exact model); the others are second order (measured 0.025)
    assert ratio <= (0.6 if is_mode == "psis" else 0.1), (ratio, res["SE_deltaH_true_minus_pred"], res["SE_deltaH_true"])
    assert res["pred_consistent"] is True
