"""Importance-sampling math of Stage 3 against textbook cases and hand-computed values.

Gaussian mean shift: proposal q = N(0, 1), target p = N(mu, 1), log w = mu x - mu^2 / 2, so
E_p[x] = mu and every moment of w is finite (Pareto k = 0). Variance mismatch: p = N(0, s2),
log w = x^2 (1 - 1/s2) / 2 - log(s2) / 2; P(w > t) ~ t^(-1 / (1 - 1/s2)), a Pareto tail with
k = 1 - 1/s2 (s2 = 10: k = 0.9, infinite-variance weights). Exact Pareto: u ~ U(0, 1),
w = u^(-k) has P(w > t) = t^(-1/k).
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import fp_tol
from entprobe.math import importance as est

N = 10_000


def _normal(seed: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _psis(logw: torch.Tensor):
    """PSIS's normalised weights and k-hat (``psis_smooth`` keeps them on the raw scale)."""
    sm = est.psis_smooth(logw)
    return torch.softmax(sm.log_weights, -1), sm.khat


def _se(wn: torch.Tensor, f: torch.Tensor, estimate: float) -> float:
    """Delta-method standard error of a self-normalised estimate: sqrt(sum wn^2 (f - est)^2)."""
    return float((wn.pow(2) * (f - estimate).pow(2)).sum().sqrt())


@pytest.mark.parametrize("mu", [0.3, 0.7])
def test_snis_and_psis_recover_the_target_mean_of_a_gaussian_shift(mu):
    x = _normal(seed=1)
    logw = mu * x - mu * mu / 2
    for wn in (est.snis_weights(logw), _psis(logw)[0]):
        # N normalised fp64 weights: each within a few roundings of its share, their sum of N terms
        assert abs(float(wn.sum()) - 1.0) <= fp_tol(torch.float64, 1.0, 4 * N, worst_case=True)
        m = float((wn * x.double()).sum())
        assert abs(m - mu) < 4 * _se(wn, x, m), (m, mu)
    # Unweighted mean is ~0: the test above would fail if the weights were ignored.
    assert abs(float(x.mean()) - mu) > 0.25


def test_psis_khat_small_for_light_tails_and_large_for_heavy_tails():
    x = _normal(seed=2)
    _, k_light = _psis(0.5 * x - 0.125)
    s2 = 10.0
    _, k_heavy = _psis(0.5 * x * x * (1 - 1 / s2) - 0.5 * math.log(s2))
    assert k_light < 0.3
    assert k_heavy > 0.6  # theory 0.9; k-hat is biased low at finite N on this slowly converging tail
    # psislw negates its input internally: feeding log w un-negated would fit the bounded left
    # tail and return a strongly negative k-hat here.
    _, k_wrong = _psis(-(0.5 * x * x * (1 - 1 / s2)))
    assert k_wrong < 0


@pytest.mark.parametrize("k", [0.3, 0.8])
def test_psis_khat_on_an_exact_pareto_tail(k):
    u = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, khat = _psis(-k * u.log())  # w = u^(-k): exact Pareto with shape k
    assert abs(khat - k) < 0.25  # tail of 3 sqrt(N) = 300 draws: sd(k-hat) ~ (1 + k)/sqrt(300) ~ 0.1


def test_psis_smooths_only_the_largest_weights():
    x = _normal(seed=4)
    logw = 0.5 * x * x * 0.75  # heavy right tail of w
    wp, _ = _psis(logw)
    ws = est.snis_weights(logw)
    M = int(math.floor(3 * math.sqrt(N)))  # arviz's tail size for N * r_eff > 225
    order = logw.argsort()
    body, tail = order[:N - M], order[N - M:]
    ratio = wp[body] / ws[body]  # the body keeps its raw weights up to normalisation
    # each weight exp(logw - lse) rounds relative to its exponent's size (the normaliser is common
    # to the body): a few roundings of (1 + |logw|) relative, the ratio of two such
    slack = fp_tol(torch.float64, 1.0 + float(logw.abs().max()), 8, worst_case=True)
    assert ((ratio - ratio[0]).abs() <= slack * ratio.abs()).all()
    assert not torch.allclose(wp[tail] / ws[tail], ratio[0].expand(M), rtol=1e-3)
    # smoothed tail keeps the order of the raw weights (to the rounding of the weights themselves)
    assert (wp[tail].diff() >= -slack * float(wp[tail].max())).all()
    assert float(wp.max() / wp[body].max()) <= float(ws.max() / ws[body].max()) * (1 + 2 * slack)  # never above max


def test_psis_below_25_weights_is_undefined_never_snis():
    """Fewer than 25 weights: no PSIS estimate (None, k-hat NaN) and the reason, never SNIS's
    weights in its place; the psis estimate of ``paired_psi`` is then NaN."""
    logw = torch.linspace(-1, 1, 16, dtype=torch.float64)
    sm = est.psis_smooth(logw)
    assert sm.log_weights is None and math.isnan(sm.khat) and "needs >= 25" in sm.note and "got 16" in sm.note
    S0 = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    psi = est.paired_psi(S0, S0 + logw.view(4, 4) * 1e-3, torch.ones(4, 4), torch.ones(4), "sequence", 10.0,
                         sm.log_weights)
    assert torch.isnan(psi["psis"]).all() and torch.isfinite(psi["snis"]).all()


def test_psis_keeps_the_raw_scale_of_the_untouched_weights():
    """The smoothed log-weights are the raw ones below the tail (same scale, not renormalised)."""
    x = _normal(seed=4)
    logw = 0.3 * x
    sm = est.psis_smooth(logw)
    body = logw.argsort()[: N - int(math.floor(3 * math.sqrt(N)))]
    # the raw log-weights, shifted (by up to their logsumexp) and shifted back at most: two
    # roundings of |logw| + |logsumexp(logw)|
    shift = float(logw.abs().max()) + abs(float(torch.logsumexp(logw, 0)))
    assert ((sm.log_weights[body] - logw[body]).abs() <= fp_tol(torch.float64, shift, 2, worst_case=True)).all()
    assert sm.log_weights.shape == logw.shape and sm.note == ""


def test_clipped_weights_never_exceed_clip_c_before_normalisation():
    logw = torch.tensor([math.log(0.5), math.log(2.0), math.log(50.0), math.log(1e6), -900.0],
                        dtype=torch.float64)
    c = 10.0
    raw = est.clipped_log_weights(logw, c).exp()
    # min(w, c) by hand: [0.5, 2, 10, 10, e^-900]
    expect = torch.tensor([0.5, 2.0, 10.0, 10.0, math.exp(-900.0)], dtype=torch.float64)
    # exp of a rounded log: the exponent's rounding (u |log w|) and exp's own, relative; the
    # normalised weights one division and a 5-term sum more (fp64)
    rel64 = fp_tol(torch.float64, 1.0 + math.log(1e6), 4, worst_case=True)
    assert ((raw - expect).abs() <= rel64 * expect).all()
    assert float(raw.max()) <= c * (1 + rel64)
    wn = torch.softmax(est.clipped_log_weights(logw, c), -1)  # as the clip estimator normalises
    want = expect / expect.sum()
    assert ((wn - want).abs() <= (rel64 + fp_tol(torch.float64, 1.0, 5, worst_case=True)) * want).all()
    # Normalised in the log domain: all weights tiny (logw ~ -2000) must not give 0/0.
    wn_tiny = torch.softmax(est.clipped_log_weights(torch.tensor([-2000.0, -2001.0], dtype=torch.float64), c), -1)
    assert torch.allclose(wn_tiny, torch.tensor([1.0, math.exp(-1.0)], dtype=torch.float64) / (1 + math.exp(-1.0)))


def test_snis_is_computed_in_the_log_domain():
    # w = e^1000 * [1, e^-1, e^-2] would overflow exp(); normalised weights are softmax([0, -1, -2]).
    logw = torch.tensor([1000.0, 999.0, 998.0], dtype=torch.float64)
    wn = est.snis_weights(logw)
    expect = torch.tensor([1.0, math.exp(-1), math.exp(-2)], dtype=torch.float64)
    # softmax of exponents up to 2 (after the shift by 1000, exact here): exp, a 3-term sum and a
    # division, each side; a few fp64 roundings relative (an overflow would give NaN)
    rel64 = fp_tol(torch.float64, 1.0 + 2.0, 8, worst_case=True)
    assert ((wn - expect / expect.sum()).abs() <= rel64 * expect / expect.sum()).all()
    # H_upd = -sum wn S_upd: S_upd = [-1, -2, -4] -> (1 + 2 e^-1 + 4 e^-2) / (1 + e^-1 + e^-2)
    S_upd = torch.tensor([-1.0, -2.0, -4.0], dtype=torch.float64)
    h = (1 + 2 * math.exp(-1) + 4 * math.exp(-2)) / (1 + math.exp(-1) + math.exp(-2))
    assert abs(float((wn * -S_upd).sum()) - h) <= rel64 * h


def test_ess_formula():
    # (sum w)^2 / sum w^2: equal weights -> N; one weight -> 1; w = [2, 1, 1] -> 16 / 6.
    ess = lambda lw: float(est.stratified_ess(lw))  # noqa: E731  (one stratum)
    # (sum w)^2 / sum w^2 of a few weights exp(lw - max): exp, two short sums, a square and a
    # division, relative, after log-weights rounded on the scale of their size (the shift by 5000
    # rounds log 2 + 5000 to an ulp of 5000): a few fp64 roundings of 1 + max |lw|
    def close(got, want, lw_max=1.0):
        return abs(got - want) <= fp_tol(torch.float64, 1.0 + lw_max, 16, worst_case=True) * want
    assert close(ess(torch.zeros(7, dtype=torch.float64)), 7.0)
    assert close(ess(torch.tensor([0.0, -math.inf, -math.inf])), 1.0)
    lw = torch.tensor([math.log(2.0), 0.0, 0.0], dtype=torch.float64)
    assert close(ess(lw), 16 / 6)
    assert close(ess(lw + 5000.0), 16 / 6, 5001.0)  # shift-invariant, no overflow
    # per prompt: a [B, G] table gives one ESS per row
    rows = est.stratified_ess(torch.stack([lw, torch.zeros(3, dtype=torch.float64)])).tolist()
    assert close(rows[0], 16 / 6) and close(rows[1], 3.0)


def test_token_ratio_stats_by_hand_including_nan_old_logprobs():
    # Two sequences, T = 4; mask picks 5 tokens. old has a NaN on one response token and a NaN on
    # a masked-out position (ignored).
    new = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.1, -3.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, float("nan"), -0.1], [float("nan"), -0.5, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    # response tokens (new, old): (-1, -1) r=1; (-2, nan) -> filled, r=1; (-0.5, -0.1) r=e^-0.4=0.6703;
    # (-0.1, -0.5) r=e^0.4=1.4918; (-3, -1) r=e^-2=0.1353
    ratios = [1.0, 1.0, math.exp(-0.4), math.exp(0.4), math.exp(-2.0)]
    s = est.token_ratio_stats(new, old, mask, eps=0.2, eps_high=0.28)
    assert s["frac_old_logprobs_valid"] == pytest.approx(4 / 5)
    # fp32: each ratio exp(new - old) from a rounded difference (relative u |new - old| <= 2u) and
    # exp's rounding, the mean a 5-term sum and a division: under 5 roundings of each term
    tol32 = fp_tol(torch.float32, sum(ratios), 5, worst_case=True)
    assert abs(s["mean_importance_ratio"] - sum(ratios) / 5) <= tol32 / 5
    # outside [0.8, 1.28]: 0.6703, 1.4918, 0.1353 -> 3 of 5
    assert s["clip_fraction"] == pytest.approx(3 / 5)
    sums = est.token_ratio_sums(new, old, mask, 0.2, 0.28)
    assert sums[:2] == (5.0, 4.0) and sums[3] == 3.0 and abs(sums[2] - sum(ratios)) <= tol32  # counts exact
    # Sums add across "ranks": two halves reduced give the whole.
    a = est.token_ratio_sums(new[:1], old[:1], mask[:1], 0.2, 0.28)
    b = est.token_ratio_sums(new[1:], old[1:], mask[1:], 0.2, 0.28)
    merged = est.token_ratio_stats_from_sums(est.TokenRatioSums(*[x + y for x, y in zip(a, b)]))
    assert merged == pytest.approx(s)
    # All old log-probs missing: no importance sampling at all (seed 003's REINFORCE fallback).
    s_nan = est.token_ratio_stats(new, torch.full_like(old, float("nan")), mask, 0.2, 0.28)
    assert s_nan == {"frac_old_logprobs_valid": 0.0, "mean_importance_ratio": 1.0, "clip_fraction": 0.0}
    empty = est.token_ratio_stats(new, old, torch.zeros_like(mask), 0.2, 0.28)
    assert all(math.isnan(v) for v in empty.values())


def test_psis_with_tied_tail_weights_is_undefined_never_snis():
    # 32 weights whose 6 largest (the fitted tail) sit on a tie at the cut-off, as repeated identical
    # responses produce: arviz's tail fit degenerates (sigma <= 0) and returns NaN log-weights.
    logw = torch.tensor([-0.17, -0.16, -0.15, -0.04, -0.03, -0.024, -0.023, -0.022, -0.021, -0.018,
                         -0.0181, -0.017, -0.016, -0.015, -0.011, -0.0111, -0.0112, -0.009, -0.001,
                         0.002, 0.0021] + [0.0102] * 9 + [0.0736, 0.1304], dtype=torch.float64)
    sm = est.psis_smooth(logw)
    assert sm.log_weights is None and math.isnan(sm.khat) and "tail fit failed" in sm.note


# ---------------------------------------------------------------- no optional diagnostic can lose a run
def _repeat_first_response(batch):
    """Every prompt's G responses replaced by its first one (the low-entropy regime: a prompt
    that drew the same response G times); rewards equal within each group, advantages 0."""
    from entprobe.rollouts.sampling import RolloutBatch

    kw = {}
    for k in ("input_ids", "attention_mask", "response_mask", "sampler_logprobs", "rewards"):
        v = getattr(batch, k)
        kw[k] = v[:, :1].expand_as(v).clone()
    kw["advantages"] = torch.zeros_like(batch.advantages)
    return RolloutBatch(**kw, prompt_index=batch.prompt_index, temperature=batch.temperature)


@pytest.mark.parametrize("is_mode", ["psis", "cv"])
def test_tied_weights_and_an_empty_update_run_to_the_end(tmp_path, is_mode):
    """E with every response repeated (tied importance weights: arviz's tail fit fails) and U whose
    groups all have equal rewards (a zero gradient: the step is momentum and decay only). The run
    writes results.json; PSIS is undefined (k-hat nan, the reason in psis_khat_note): reported as
    the measured change it makes the run unmeasurable, with a warning, never SNIS's number in its
    place; as a side diagnostic it is NaN quietly. Nothing else is lost."""
    import json

    from conftest import compose_cfg
    from entprobe.cli.probe_job import run
    from entprobe.rollouts.sampling import RolloutBatch

    saved, tied = tmp_path / "saved", tmp_path / "tied"
    # B_E 8, G 4: 32 weights, enough for PSIS's tail fit, which the ties then break
    run(compose_cfg(tmp_path / "first", f"batch.save='{saved}'", "importance.enabled=false", "batch.B_E=8"))
    E, U = RolloutBatch.load(saved / "E.pt"), RolloutBatch.load(saved / "U.pt")
    _repeat_first_response(E).save(tied / "E.pt")
    _repeat_first_response(U).save(tied / "U.pt")
    out = tmp_path / "run"
    import contextlib
    # PSIS undefined warns when PSIS is the reported estimate; as a side diagnostic it stays quiet
    with pytest.warns(UserWarning, match="PSIS") if is_mode == "psis" else contextlib.nullcontext():
        res = run(compose_cfg(out, f"batch.load='{tied}'", f"importance.is_mode={is_mode}", "batch.B_E=8"))
    written = json.loads((out / "results.json").read_text())
    assert math.isnan(res["psis_khat"]) and math.isnan(res["deltaH_psis"]) and "tail fit" in res["psis_khat_note"]
    if is_mode == "psis":
        assert res["measurable"] is False and "tail fit failed" in res["unmeasurable_reason"]
        assert math.isnan(written["deltaH_true"]) and written["pred_consistent"] is None
        assert "unmeasurable" in res["flags"].split(",") and "non_finite" not in res["flags"].split(",")
    else:
        assert written["deltaH_true"] == pytest.approx(res["deltaH_true"]) and res["measurable"] is True
    assert res["batch_U/frac_zero_var_groups"] == 1.0 and res["bars_dot"] == 0.0  # Ybar = 0
    # the step is momentum + decay only, and the prediction says so: its gradient part is exactly 0
    # (Ybar = 0) and the prediction is the sum of the other two. Not asserted: deltaH_pred != 0.
    # E's responses are tied too, so every response's leave-one-out weight (x_unit_coeffs) is 0
    # in exact arithmetic: Xbar, and with it each part, is rounding noise, exactly 0 on some
    # machines and draws and not on others.
    assert res["deltaH_pred_gradient"] == 0.0
    assert res["deltaH_pred"] == res["deltaH_pred_momentum"] + res["deltaH_pred_weight_decay"]
    measured = ("deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred") if is_mode == "cv" else ()
    for k in ("deltaH_pred", "SE_deltaH_pred", "ESS_frac", *measured):
        assert math.isfinite(res[k]), k
    assert 0 < res["ESS_frac"] <= 1 and res["is/stratified_by"] == "group"  # dr_grpo: one item per prompt
    assert "empty_gradient" in res["flags"].split(",")  # and the verdict says why
