"""EntropyGuard's and the forecast's faults from issue 39 (part "guard"), each on pure tensors or the
built-in model's shapes (seconds): betas per param group, the horizon's type and range and the
forecast's cost in K, the horizon rule below the floor on a resolved rise, and the forecast's bounds
clipped to the entropy's range."""
from __future__ import annotations

import math
import re
import warnings
from types import SimpleNamespace

import numpy
import pytest
import torch

from entprobe.config import ConfigError
from entprobe.integrations import guard as G
from entprobe.integrations.guard_forecast import forecast_call
from entprobe.math import estimators as est
from entprobe.math import forecast as fc
from entprobe.math.ustat import row_statistics
from entprobe.pipeline.stages import rollout_prediction as RP
from entprobe.pipeline.stages.x_spec import XSpec

EPS64 = torch.finfo(torch.float64).eps


# --- betas per param group ---------------------------------------------------------------------------

def _model_and_optimizer(groups: list[dict]):
    """Two parameters (one per group, in model order a then b) with AdamW state after 7 steps; each
    group dict gives its betas / weight_decay / eps, the first for a, the second for b."""
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(3, generator=gen, dtype=torch.float64))
    return a, b, groups, gen


def _optimizer(a, b, groups, order):
    params = {"a": a, "b": b}
    opt = torch.optim.AdamW([{"params": [params[n]], **groups[i]} for i, n in enumerate(order)], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for p in (a, b):  # the same state whatever the groups' order
        opt.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.randn(p.shape, generator=gen, dtype=torch.float64),
                        "exp_avg_sq": torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.1}
    return opt


def _rollouts(B: int = 5) -> SimpleNamespace:
    """What forecast_inputs reads of a RolloutPrediction (fixed numbers: the optimizer side is tested)."""
    gen = torch.Generator().manual_seed(2)
    rows = lambda: torch.randn(B, generator=gen, dtype=torch.float64)  # noqa: E731
    part = lambda: SimpleNamespace(U=float(rows()[0]), rows=rows())  # noqa: E731
    return SimpleNamespace(res={"H_orig": 0.4}, parts={"gradient": part(), "momentum": part(), "weight_decay": part()},
                           kt=SimpleNamespace(b=rows()), h_units=0.4 + 0.01 * rows(), B=B,
                           H_max=(math.log(18), math.log(18)))


def test_different_betas_per_group_are_refused_in_either_order_naming_the_groups():
    """The tester's groups: betas (0.0, 0.5) and (0.9, 0.999). The forecast read param_groups[0]'s
    for every parameter (0.3046 against 0.2347 by the groups' order); now no forecast is made in
    either order (a warning naming both groups' betas), and a guard with a horizon is refused at
    construction with the same words."""
    a, b, _, _ = _model_and_optimizer([])
    groups = [{"betas": (0.0, 0.5)}, {"betas": (0.9, 0.999)}]
    y = [torch.ones(5, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    for order in (("a", "b"), ("b", "a")):
        opt = _optimizer(a, b, groups, order)
        error = RP.betas_error(opt, [a, b])
        assert error == ("the optimizer's param groups have different betas (group 0 (0, 0.5), group 1 (0.9, 0.999)): "
                         "the entropy forecast k steps ahead is made for one (beta1, beta2); give every param group "
                         "the same betas")
        with pytest.warns(UserWarning, match=r"no forecast_H_k\*: the optimizer's param groups have different betas"):
            assert RP.forecast_inputs(_rollouts(), opt, [a, b], y) is None
        assert fc.forecast_results(None) == {}
        probe = SimpleNamespace(source="rollouts", optimizer=opt)
        with pytest.raises(ConfigError, match=r"^EntropyGuard: horizon=5: the optimizer's param groups have different "
                                              r"betas \(group 0 \(0, 0.5\), group 1 \(0.9, 0.999\)\)"):
            G.EntropyGuard(probe, floor=0.2, horizon=5)
        G.EntropyGuard(probe, floor=0.2)  # the one-step rule needs no forecast
        # a group holding no trainable parameter does not count
        assert RP.betas_error(opt, [a if order[0] == "a" else b]) is None
    # the guard never falls back on the one-step rule in silence when the probe made no forecast
    p = SimpleNamespace(deltaH_pred=-0.1, SE=0.01, H=0.5, forecast=None)
    with pytest.raises(ConfigError, match="horizon=5 acts on the entropy forecast and the probe made none at step 3"):
        G.decide_with_forecast(G.GuardRule(floor=0.2, horizon=5), 3, p, 1.0)


def test_same_betas_with_per_group_decay_and_eps_give_the_same_forecast_in_either_order():
    """Groups with their own weight decay and eps (in the step's parts, per group) and the same betas:
    swapping the groups changes none of the forecast's inputs (t, betas, kappa_c: the second moments
    are summed in parameter order), so the forecast is the same to the bit; and it is the one a single
    group with those betas gives (the per-group reference when the betas agree)."""
    a, b, _, _ = _model_and_optimizer([])
    groups = [{"betas": (0.8, 0.99), "weight_decay": 0.1, "eps": 1e-6}, {"betas": (0.8, 0.99), "weight_decay": 0.0}]
    y = [torch.full((5,), 0.3, dtype=torch.float64), torch.full((3,), -0.2, dtype=torch.float64)]
    ro = _rollouts()
    f_ab = RP.forecast_inputs(ro, _optimizer(a, b, groups, ("a", "b")), [a, b], y)
    f_ba = RP.forecast_inputs(ro, _optimizer(a, b, groups, ("b", "a")), [a, b], y)
    single = torch.optim.AdamW([a, b], lr=1e-3, betas=(0.8, 0.99))
    single.state.update(_optimizer(a, b, groups, ("a", "b")).state)
    f_one = RP.forecast_inputs(ro, single, [a, b], y)
    assert (f_ab.t, f_ab.beta1, f_ab.beta2) == (7.0, 0.8, 0.99)
    assert f_ab.kappa_c == f_ba.kappa_c == f_one.kappa_c
    # kappa_c by hand: sum y^2 / sum v_hat_1, v_hat_1 = (beta2 v + (1 - beta2) y^2) / (1 - beta2^8)
    v = sum(float(s["exp_avg_sq"].sum()) for s in single.state.values())
    y2 = 5 * 0.09 + 3 * 0.04
    kappa = y2 / ((0.99 * v + 0.01 * y2) / (1 - 0.99 ** 8))
    assert abs(f_ab.kappa_c - kappa) <= 16 * EPS64 * kappa  # ~8 + 8 fp64 additions of O(1) terms
    assert fc.forecast_results(f_ab) == fc.forecast_results(f_ba) == fc.forecast_results(f_one)


# --- the horizon: an int in [1, MAX_HORIZON], and a cost linear in K ---------------------------------

def test_horizon_must_be_an_integer_in_range():
    assert G.MAX_HORIZON == 100
    in_range = "must be the steps ahead the entropy forecast must stay above the floor: an integer from 1 to 100"
    for bad, says in ((10 ** 9, in_range), (101, in_range), (0, in_range), (10 ** 400, in_range),
                      (5.0, "is a float, not an integer"), (True, "is a bool, not a number"),
                      ("5", "is a str, not a number"), (float("nan"), "is a float, not an integer")):
        with pytest.raises(ConfigError, match=f"^{re.escape(f'horizon={bad!r}: {says}')}"):
            G.GuardRule(floor=0.1, horizon=bad)
    assert G.GuardRule(floor=0.1, horizon=numpy.int64(100)).horizon == 100
    assert type(G.GuardRule(floor=0.1, horizon=numpy.int64(7)).horizon) is int
    # what the train CLI calls for --guard-horizon: one line, the option's own way to leave it out
    msg = G.param_error("horizon", 10 ** 9, "leave --guard-horizon out")
    assert msg.startswith("must be the steps ahead") and msg.endswith("(or leave --guard-horizon out)")
    assert "\n" not in msg and G.param_error("horizon", 100) is None


def test_coefficient_series_is_the_direct_sums():
    """The O(K) recurrences against the sums of the module docstring written out (O(K^3)), for
    AdamW early and late and plain SGD; tolerance: fp64 rounding over ~K^2 terms of size <= max c_i^2."""
    for K, t, b1, b2, kappa in ((1, 20, .9, .999, 1.), (12, 3, .9, .999, 0.), (37, 500, .5, .99, 2.5),
                                (10, 0, 0., 0., 1.)):
        A, Bs, C = fc.coefficient_series(K, t, b1, b2, kappa)
        r = fc.scales(K, t, b1, b2, kappa)
        for k in range(1, K + 1):
            A_ref = sum(b1 ** (j - 1) * r[j - 1] for j in range(1, k + 1))
            B_ref = sum(r[j - 1] * sum(b1 ** i for i in range(j - 1)) for j in range(2, k + 1))
            C_ref = sum(sum(r[j - 1] * b1 ** (j - i) for j in range(i, k + 1)) ** 2 for i in range(2, k + 1))
            tol = 4 * EPS64 * k * k * max(1.0, C_ref)
            assert abs(A[k - 1] - A_ref) <= tol and abs(Bs[k - 1] - B_ref) <= tol and abs(C[k - 1] - C_ref) <= tol
        assert fc.coefficients(K, t, b1, b2, kappa) == (A[-1], Bs[-1], C[-1])


def test_jackknife_variance_is_row_statistics():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    w = [1.0, -2.5, 0.3, 7.0]
    combo = sum(wi * r for wi, r in zip(w, rows))
    ref = row_statistics(0.123, combo)[3] ** 2
    got = fc.jackknife_variance(fc.centred_gram(rows), w, 9)
    assert abs(got - ref) <= 64 * EPS64 * ref  # 9 units x 16 products, each rounded once


def _inputs(H=0.4, grad=-0.002, mom=0.001, spread=0.01, B=16, H_max=math.inf, logged_max=math.inf, t=200.0):
    gen = torch.Generator().manual_seed(4)
    r = lambda: spread * torch.randn(B, generator=gen, dtype=torch.float64)  # noqa: E731
    return fc.ForecastInputs(H, H + r(), grad, grad + r(), mom, mom + r(), -1e-5, 0 * r(), 1e-6, 1e-4, t, 0.9, 0.999,
                             1.2, B - 1, H_max, logged_max)


def test_a_decision_over_the_longest_horizon_computes_the_coefficients_a_few_times_not_once_per_k(monkeypatch):
    """K = 1000 took 68 s a step: the coefficients were recomputed for every k (O(k^2) each). Now the
    series is kept and extended by doubling: the guard's K forecasts cost O(K) coefficient work. Counted,
    not timed (a shared machine's clock): ``scales`` (O(K) each) runs at most 3 kappas x (log2 K + 1) times."""
    calls = []
    real = fc.scales
    monkeypatch.setattr(fc, "scales", lambda *a: calls.append(a[0]) or real(*a))
    fc._SERIES.clear()
    f = _inputs(t=321.0)
    K = G.MAX_HORIZON
    call = forecast_call(lambda k, factor: fc.forecast(f, k, factor), f.H, 0.3, K)
    assert call.k >= 1 and len(calls) <= 3 * (math.ceil(math.log2(K)) + 1), calls
    assert sum(calls) <= 3 * 4 * K  # doubling: the lengths sum to < 2 x the largest (< 2K) per kappa
    # and the results are those of a fresh computation at each k
    fc._SERIES.clear()
    assert fc.forecast(f, 37) == fc.forecast_series(f, 37)[-1]


# --- the horizon rule below the floor: a resolved rise recovers --------------------------------------

def _pending(H, dH, se):
    """``H + f dH[k]`` k steps ahead at factor f, the population's and the change's intervals +- 2 se
    (the entropy's bounds clipped at 0, as the forecast clips them)."""
    def at(k, f):
        d = f * dH[k]
        return {"H": max(H + d, 0.0), "dH": d, "pop_low": max(H + d - 2 * se, 0.0), "pop_high": max(H + d + 2 * se, 0.0),
                "dH_low": d - 2 * se, "dH_high": d + 2 * se}
    return SimpleNamespace(deltaH_pred=dH[1], SE=se, H=H, forecast=at)


def test_below_the_floor_a_resolved_rise_recovers_and_a_resolved_fall_is_cut():
    """The tester's case: H below the floor, the step predicted (resolved) to raise entropy, every
    forecast interval still below the floor. The horizon rule cut it to x0.05 at 10 of 11 decisions;
    now, as the one-step rule, it recovers (0.05 -> 0.1 at recovery 2)."""
    rule = G.GuardRule(floor=0.5, horizon=5, recovery=2.0)
    rising = _pending(0.3, {k: 0.02 * k for k in range(1, 6)}, 0.005)  # 0.3 -> 0.4 in 5 steps, resolved
    dec = G.decide_with_forecast(rule, 4, rising, 0.05)
    assert dec.forecast.high < 0.5 and not dec.forecast.resolved
    assert (dec.action, dec.factor) == ("recover", pytest.approx(0.1))
    assert "the step raises entropy" in dec.reason and "no resolved fall below the floor 0.5" in dec.line(rule)
    falling = _pending(0.3, {k: -0.02 * k for k in range(1, 6)}, 0.005)  # resolved fall: cut, as before
    dec = G.decide_with_forecast(rule, 4, falling, 1.0)
    assert (dec.action, dec.factor, dec.forecast.resolved) == ("cut", 0.05, True)
    assert "a resolved fall below the floor 0.5" in dec.line(rule)
    flat = _pending(0.3, {k: 0.001 * k for k in range(1, 6)}, 0.005)  # sign unresolved: held, neither cut nor raised
    dec = G.decide_with_forecast(rule, 4, flat, 0.05)
    assert (dec.action, dec.factor) == ("hold", 0.05)


def test_a_bound_below_zero_clipped_to_zero_is_still_a_resolved_crossing():
    """Above the floor 0.2, a fall whose population interval reaches -0.5 (clipped to 0): resolved
    below the floor as the unclipped bound was; the factor keeps the point forecasts on the floor."""
    rule = G.GuardRule(floor=0.2, horizon=3)
    dec = G.decide_with_forecast(rule, 2, _pending(0.6, {1: -0.1, 2: -0.5, 3: -0.8}, 0.1), 1.0)
    assert dec.forecast.high == 0.0 and dec.forecast.resolved and dec.action == "cut"
    assert dec.factor == pytest.approx(0.4 / 0.8, rel=4 * EPS64)


# --- forecast bounds inside the entropy's range --------------------------------------------------------

def test_forecast_bounds_are_clipped_to_zero_and_ln_V():
    """A wide forecast on an 18-token vocabulary (ln 18 = 2.89): the tester saw [-2.745, 2.271] in a
    guard line and upper bounds of 4.17 and 19.6 nats. Every entropy bound and point is in
    [0, ln 18]; the change dH is not clipped (a first-order change), and the score form's logged value
    (H_logged_max inf) keeps its upper bound."""
    lnV = math.log(18)
    f = _inputs(H=2.5, grad=0.05, mom=0.02, spread=0.3, H_max=lnV, logged_max=lnV)
    free = _inputs(H=2.5, grad=0.05, mom=0.02, spread=0.3)
    for k in (1, 5, 10):
        r, u = fc.forecast(f, k), fc.forecast(free, k)
        if k == 10:  # 10 steps out the interval leaves the range on both sides: its lower bound is at
            # most H + dH - q SE (the kappa band's lowest change is <= the central one), below 0
            assert u["high"] > lnV and f.H + u["dH"] - est.t_quantile(f.df) * u["SE"] < 0 == r["pop_low"]
        assert (r["low"], r["high"]) == (max(u["low"], 0.0), min(u["high"], lnV))
        assert (r["pop_low"], r["pop_high"]) == (max(u["pop_low"], 0.0), min(u["pop_high"], lnV))
        assert r["H"] == min(max(u["H"], 0.0), lnV) and r["dH"] == u["dH"]
    out = fc.forecast_results(f)
    assert all(0.0 <= out[f"forecast_H_k{k}{s}"] <= lnV for k in (1, 5, 10) for s in ("", "_low", "_high"))
    score = fc.forecast(_inputs(H=2.5, grad=0.05, mom=0.02, spread=0.3, H_max=lnV), 10)
    assert score["high"] > lnV and score["pop_high"] == lnV  # logged -S: above ln V; the population: not
    line = G.Decision(3, 1.0, "hold", "", H=2.5, deltaH_pred=0.07, SE=0.3,
                      forecast=forecast_call(lambda k, a: fc.forecast(f, k, a), 2.5, 0.5, 10)).line(G.GuardRule(floor=0.5))
    lo, hi = (float(v) for v in line.split("[")[1].split("]")[0].split(", "))
    assert 0.0 <= lo <= hi <= lnV, line


def test_entropy_range_by_functional():
    """ln V per token for the per-token functionals, max_new_tokens ln V per response for sequence;
    the logged value's bound is the same when it is made of token entropies, none for the score form's -S."""
    lnV = math.log(18)
    assert RP.entropy_range(XSpec("token_mean", "score"), 18, 8) == (lnV, lnV)
    assert RP.entropy_range(XSpec("seq_mean_token_mean", "score"), 18, 8) == (lnV, lnV)
    assert RP.entropy_range(XSpec("sequence", "rao_blackwell"), 18, 8) == (8 * lnV, 8 * lnV)
    assert RP.entropy_range(XSpec("sequence", "score"), 18, 8) == (8 * lnV, math.inf)
    assert RP.entropy_range(XSpec("per_token_avg", "score"), 18, 8) == (lnV, math.inf)
    assert RP.entropy_range(XSpec("token_mean", "score"), None, 8) == (math.inf, math.inf)


def test_the_probe_knows_the_vocabulary_from_the_model():
    from entprobe.checkpoints.builtin import build_tiny_llama
    model = build_tiny_llama(18, hidden=16, layers=1, heads=2)
    assert RP.logit_count(model) == 18
    assert RP.logit_count(SimpleNamespace(config=SimpleNamespace(vocab_size=49152))) == 49152
    assert RP.logit_count(torch.nn.Linear(3, 3)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RP.logit_count(SimpleNamespace(module=model)) == 18  # DDP's wrapper


def _probed_forecast(order: tuple[int, int], betas: list[tuple[float, float]]) -> tuple[dict, list[str]]:
    """One probe (source="rollouts", step 2) on the built-in model with its decay / no-decay groups
    in ``order`` with ``betas``: the logged forecast keys and the forecast's warnings."""
    from conftest import rollout_loop_parts
    from entprobe.checkpoints.default_checkpoint import trainer_adamw
    from entprobe.integrations import OnlineProbe

    def grouped(model):  # the decay / no-decay groups in ``order``, each with its betas
        groups = trainer_adamw(model, 1e-3, 0.01).param_groups
        return torch.optim.AdamW([{"params": groups[i]["params"], "weight_decay": groups[i]["weight_decay"],
                                   "betas": betas[i]} for i in order], lr=1e-3, eps=1e-8)
    model, tok, task, opt, step_batch = rollout_loop_parts(grouped)
    probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
    batch = step_batch(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert probe.before_step(2, rollouts=batch)
    opt.step()
    out = probe.after_step()
    return ({k: v for k, v in out.items() if "forecast" in k},
            [str(w.message) for w in caught if "forecast" in str(w.message)])


def test_a_probe_s_forecast_does_not_depend_on_the_groups_order():
    """The built-in model's decay / no-decay groups, same betas: the logged forecasts are the same in
    either order (to the rounding of fp64 sums over its ~20 tensors; they agree to the bit here); with
    the tester's betas, none is logged and the warning names both groups."""
    same = [(0.9, 0.999), (0.9, 0.999)]
    ab, warned = _probed_forecast((0, 1), same)
    ba, _ = _probed_forecast((1, 0), same)
    assert not warned and set(ab) == set(ba) and "entprobe/forecast_H_k10_high" in ab
    assert all(abs(ab[k] - ba[k]) <= 32 * EPS64 * max(1.0, abs(ab[k])) for k in ab)
    assert all(0.0 <= v <= math.log(18) for k, v in ab.items() if not k.startswith("entprobe/SE_"))
    none, warned = _probed_forecast((0, 1), [(0.0, 0.5), (0.9, 0.999)])
    assert none == {} and len(warned) == 1
    assert "group 0 (0, 0.5), group 1 (0.9, 0.999)" in warned[0]
