"""EntropyGuard on the forecast (``horizon=K``): the rule on forecasts given by hand, the refusals,
and a guarded run of ``python -m entprobe.train`` whose decisions carry the forecast they acted on,
logged with them and drawn in the over-steps plot's lr-factor panel."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from entprobe.config import ConfigError
from entprobe.integrations.guard import GuardRule, decide_with_forecast
from entprobe.integrations.grpo_trainer import TrainArgs, check_args, train
from entprobe.reporting import over_steps as OS


def pending(H: float, dH: dict[int, float], se: float):
    """A pending prediction whose forecast k steps ahead at factor f is ``H + f dH[k]`` with the
    population interval ``+- 2 se``, and the change's ``+- 2 se`` (not clipped: the rule reads dH and
    the bounds)."""
    def at(k, f):
        d = f * dH[k]
        return {"H": H + d, "dH": d, "pop_low": H + d - 2 * se, "pop_high": H + d + 2 * se,
                "dH_low": d - 2 * se, "dH_high": d + 2 * se}
    return SimpleNamespace(deltaH_pred=dH[1], SE=se, H=H, forecast=at)


def test_a_resolved_crossing_within_the_horizon_cuts_to_keep_the_forecast_on_the_floor():
    rule = GuardRule(floor=0.5, horizon=5)
    dH = {1: -0.02, 2: -0.05, 3: -0.2, 4: -0.3, 5: -0.4}  # 1.0 -> 0.6 in 5 steps at full lr
    dec = decide_with_forecast(rule, 7, pending(0.8, dH, 0.02), 1.0)
    # H + dH_5 + 2 se = 0.44 < 0.5: resolved at k = 5 (the first k whose bound is below); the factor
    # keeps H + f dH_k >= 0.5 for every k: f = min((0.5 - 0.8) / dH_k) = 0.3 / 0.4
    assert dec.action == "cut" and dec.factor == pytest.approx(0.75, rel=1e-12)
    assert dec.forecast.k == 5 and dec.forecast.resolved and dec.forecast.high == pytest.approx(0.44)
    assert "forecast 5 step(s) ahead H 0.4" in dec.line(rule) and "within horizon 5" in dec.reason
    # the same forecast with a horizon of 4 does not cross (0.5 at k = 4 is the floor's own value)
    assert decide_with_forecast(GuardRule(floor=0.5, horizon=4), 7, pending(0.8, dH, 0.02), 1.0).action != "cut"


def test_noise_is_not_acted_on_and_a_rise_into_a_crossing_is_held():
    rule = GuardRule(floor=0.5, horizon=5, recovery=2.0)
    dH = {k: -0.1 * k for k in range(1, 6)}  # the point reaches 0.3 at k = 5 ...
    wide = pending(0.8, dH, 0.2)  # ... but every interval holds the floor
    dec = decide_with_forecast(rule, 3, wide, 0.4)
    # the one-step rule would recover 0.4 -> 0.8; the point forecasts allow 0.3 / 0.5 = 0.6 at most
    assert not dec.forecast.resolved and dec.action == "recover" and dec.factor == pytest.approx(0.6)
    dec = decide_with_forecast(rule, 3, wide, 0.7)  # already above what the forecast allows: held
    assert dec.action == "hold" and dec.factor == 0.7
    rising = pending(0.8, {k: 0.01 * k for k in range(1, 6)}, 0.2)
    assert decide_with_forecast(rule, 3, rising, 0.4).factor == pytest.approx(0.8)  # nothing falls: recovery
    below = pending(0.4, {k: -0.01 * k for k in range(1, 6)}, 0.01)  # already under the floor and falling
    assert decide_with_forecast(rule, 3, below, 1.0).factor == rule.min_factor


def test_the_factor_keeps_the_forecast_from_the_level_it_starts_at():
    """The run's filter starts the forecast from its filtered level ``H0``, not the probe's batch H:
    the factor that keeps ``H0 + f dH_k`` on the floor is computed from H0."""
    rule = GuardRule(floor=0.5, horizon=5)
    dH = {1: -0.02, 2: -0.05, 3: -0.2, 4: -0.3, 5: -0.4}
    p = pending(0.8, dH, 0.02)
    at = p.forecast
    p.forecast = lambda k, f: {**at(k, f), "H0": 0.7, "H": 0.7 + f * dH[k],
                               "pop_high": 0.7 + f * dH[k] + 0.04}
    dec = decide_with_forecast(rule, 7, p, 1.0)
    # (0.5 - 0.7) / -0.4 = 0.5, where the batch's H (0.8) would give 0.75
    assert dec.action == "cut" and dec.factor == pytest.approx(0.5, rel=1e-12)


def test_refusals():
    with pytest.raises(ConfigError, match="horizon=5 keeps the forecast above the floor: give floor"):
        GuardRule(max_decay=0.1, horizon=5)
    with pytest.raises(ConfigError, match="horizon=2.5: is a float, not an integer; give the steps ahead"):
        GuardRule(floor=0.1, horizon=2.5)
    with pytest.raises(ConfigError, match="--guard-horizon=5: .* --probe-source rollouts"):
        check_args(TrainArgs(out="/nonexistent-run", probe_every=1, guard_floor=0.2, guard_horizon=5))


def test_a_guarded_run_logs_each_decision_with_its_forecast(tmp_path, monkeypatch):
    """The built-in model's entropy sits near 0.35 (token_mean), below a floor of 0.45 with a horizon of
    5: each decision carries the forecast it acted on, logged with it (a cut only on a forecast whose
    interval is below the floor; below the floor the guard cuts only a resolved fall, so whether it
    cuts depends on the run), and the plot has the factor's panel; the trainer feeds each step's
    logged entropy to the probe's forecast (OnlineProbe.observe_entropy)."""
    from entprobe.integrations.online_filter import RunFilter

    hist, observed = [], []
    real = RunFilter.observe
    monkeypatch.setattr(RunFilter, "observe", lambda self, step, H: (observed.append((step, H)), real(self, step, H)))
    train(TrainArgs(out=str(tmp_path / "run"), steps=6, save_every=6, probe_every=1, probe_source="rollouts",
                    probe_B_E=0, guard_floor=0.45, guard_horizon=5), log=lambda line: None, on_step=hist.append)
    # every step's logged entropy joined the run's forecast, in order, as logged
    assert observed == [(h["step"], h["entropy"]) for h in hist]
    decided = [h for h in hist if "entprobe/guard_action" in h]
    assert decided and all("entprobe/guard_forecast_H" in h for h in decided)
    for h in decided:
        assert 0 <= h["entprobe/guard_forecast_H"] <= h["entprobe/guard_forecast_high"] <= math.log(18)  # clipped
        if h["entprobe/guard_action"] < 0 and h["entprobe/H_orig"] < 0.45:  # below the floor: a resolved fall
            assert h["entprobe/guard_forecast_high"] < 0.45 and h["entprobe/guard_lr_factor"] == pytest.approx(0.05)
    rows = OS.read_csv(tmp_path / "run" / (OS.ONLINE_PREFIX + OS.CSV_FILE))
    factors = {r["step"]: r["guard_lr_factor"] for r in rows}
    assert all(factors[h["step"]] == pytest.approx(h["entprobe/guard_lr_factor"]) for h in decided)
    assert all(math.isfinite(r["forecast_H_k5"]) and math.isfinite(r["H_logged"]) for r in rows)
    assert (tmp_path / "run" / (OS.ONLINE_PREFIX + OS.PLOT_FILE)).stat().st_size > 10_000


def test_a_resumed_run_forecasts_as_the_uninterrupted_one(tmp_path):
    """``python -m entprobe.train`` keeps the probe's state (its forecast's filter) in each
    checkpoint's trainer_state.json: a run cut at checkpoint-6 and resumed forecasts steps 7-8 as the
    run that was never cut, once the filter has taken over (the first probes' one-batch forecast
    would differ: a restarted filter has no history)."""
    import shutil

    from entprobe.integrations.grpo_trainer import PROBE_STATE_KEY, saved_probe_state

    args = dict(steps=8, save_every=6, probe_every=1, probe_source="rollouts", probe_B_E=0)
    whole, cut = [], []
    train(TrainArgs(out=str(tmp_path / "whole"), **args), log=lambda line: None, on_step=whole.append)
    shutil.copytree(tmp_path / "whole" / "checkpoint-6", tmp_path / "cut" / "checkpoint-6")
    assert saved_probe_state(tmp_path / "cut" / "checkpoint-6")["filter"]["n_observed"] == 6  # steps 1..6 (step 1 is probed)
    train(TrainArgs(out=str(tmp_path / "cut"), resume="last", **args), log=lambda line: None, on_step=cut.append)
    keys = [k for k in whole[-1] if k.startswith("entprobe/forecast_H_k")]
    assert keys and [s["step"] for s in cut] == [7, 8]
    assert [{k: h[k] for k in keys} for h in whole[-2:]] == [{k: h[k] for k in keys} for h in cut]
    assert PROBE_STATE_KEY == "entprobe.OnlineProbe"
