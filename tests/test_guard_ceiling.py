"""EntropyGuard's ``ceiling`` (integrations/guard.py, guard_bonus.py): the band's upper edge, on
hand-computed cases. A resolved rise past ``ceiling - H`` is cut to the edge (to ``min_factor`` above
the ceiling), above the ceiling ``max_decay`` does not hold back a fall toward the band, a rise of
unresolved sign holds the factor and a fall of unresolved sign lets it recover, a recovery stops at
the factor that keeps a predicted rise on the edge, and the entropy bonus goes to 0 past it."""
from __future__ import annotations

import pytest

from conftest import run_documented_benchmark
from entprobe.config import ConfigError
from entprobe.integrations import guard as G
from entprobe.integrations.grpo_trainer import TrainArgs, check_args, train
from entprobe.integrations.guard_bonus import decide_coef


def rule(**kw) -> G.GuardRule:
    return G.GuardRule(**{"z": 2.0, "min_factor": 0.05, "recovery": 2.0, **kw})


def test_a_resolved_rise_past_the_ceiling_is_cut_to_its_edge():
    r = rule(floor=0.5, ceiling=2.0)
    d = G.decide(r, 7, 0.8, 0.1, 1.8, 1.0)  # lower bound 0.6 > edge 0.2: factor 0.2 / 0.8
    assert d.action == "cut" and d.factor == pytest.approx(0.25) and "ceiling edge +2.000e-01" in d.reason
    noise = G.decide(r, 7, 0.8, 0.35, 1.8, 1.0)  # lower bound 0.1 < the edge 0.2: not cut on noise
    assert noise.action == "hold" and noise.factor == 1.0
    held = G.decide(r, 7, 0.8, 0.35, 1.8, 0.5)  # a recovery to 1 would put the point prediction past the edge
    assert held.action == "hold" and held.factor == 0.5 and "no higher than the ceiling edge allows" in held.reason
    above = G.decide(r, 7, 0.3, 0.1, 2.5, 1.0)  # above the ceiling: any resolved rise, at the smallest factor
    assert above.action == "cut" and above.factor == 0.05
    assert G.decide(r, 7, 0.1, 0.1, 1.0, 1.0).action == "hold"  # a small rise well inside the band


def test_above_the_ceiling_a_fall_is_not_held_back_and_an_unsure_sign_holds():
    r = rule(floor=0.5, max_decay=0.05, ceiling=2.0)
    assert G.band_edge(3.0, 0.5, 0.05, 2.0) == pytest.approx(-2.5)  # the floor's edge only
    assert G.band_edge(1.0, 0.5, 0.05, 2.0) == pytest.approx(-0.05)  # inside the band: max_decay as before
    fall = G.decide(r, 9, -1.9, 0.3, 3.9, 0.25)  # resolved fall from above: recovers (max_decay would cut)
    assert fall.action == "recover" and fall.factor == 0.5 and "lowers entropy" in fall.reason
    assert G.decide(rule(floor=0.5, max_decay=0.05), 9, -1.9, 0.3, 3.9, 1.0).action == "cut"  # without a ceiling
    unsure = G.decide(r, 9, 0.1, 0.3, 3.9, 0.25)  # a rise of unresolved sign: held, not raised
    assert unsure.action == "hold" and unsure.factor == 0.25 and "a rise of unresolved sign" in unsure.reason
    down = G.decide(r, 9, -0.1, 0.3, 3.9, 0.25)  # a fall of unresolved sign: recovers (x recovery 2)
    assert down.action == "recover" and down.factor == 0.5 and "a fall of unresolved sign" in down.reason
    assert G.decide(r, 9, -0.1, 0.3, 3.9, 1.0).action == "hold"  # at factor 1 already


def test_a_recovery_stops_where_a_predicted_rise_meets_the_ceiling():
    r = rule(floor=0.5, ceiling=2.0)
    d = G.decide(r, 4, 0.4, 0.25, 1.9, 0.1)  # unresolved past the edge 0.1; recovery would give 0.2
    assert d.factor == pytest.approx(0.2) and d.action == "recover"
    capped = G.decide(r, 4, 0.4, 0.25, 1.9, 0.2)  # recovery 0.4 would predict 0.16 > 0.1: held at 0.25
    assert capped.factor == pytest.approx(0.25) and "no higher than the ceiling edge allows" in capped.reason
    kept = G.decide(r, 4, 0.4, 0.25, 1.9, 0.3)  # already past 0.25: the factor in force is not cut on noise
    assert kept.factor == pytest.approx(0.3) and kept.action == "hold"


def test_the_bonus_goes_to_zero_past_the_ceiling():
    c = decide_coef(0.03, 0.05, 0.1, 0.1, -0.5, 0.5, 0.1, 2.0, 1.5, past_ceiling=True)
    assert c.coef == 0.0 and c.action == "decay" and "ceiling" in c.reason
    assert decide_coef(0.03, 0.05, 0.1, 0.1, -0.5, 0.5, 0.1, 2.0, 1.5).coef == pytest.approx(0.02)  # without it
    raise_first = decide_coef(0.03, 0.05, -0.6, 0.1, -0.05, 0.5, 0.1, 2.0, 1.5, past_ceiling=True)
    assert raise_first.action == "raise"  # a resolved fall past the floor's edge: the floor comes first


def test_ceiling_is_checked_against_the_floor_and_named():
    assert G.GuardRule(ceiling=2.0).ceiling == 2.0  # a ceiling alone is a band
    with pytest.raises(ConfigError, match=r"ceiling=0.4 must be above floor=0.5"):
        G.GuardRule(floor=0.5, ceiling=0.4)
    with pytest.raises(ConfigError, match="^ceiling=-1: must be the highest entropy to hold"):
        G.GuardRule(ceiling=-1)
    line = G.decide(rule(floor=0.5, ceiling=2.0), 3, 0.8, 0.1, 1.8, 1.0).line(rule(floor=0.5, ceiling=2.0))
    assert "floor 0.5, ceiling 2" in line


def test_the_documented_ceiling_command_runs(tmp_path):
    """docs/guard.md's ceiling command, verbatim but shortened to 20 steps: the recommended run carries
    the ceiling (its printed decisions name it) and both runs report their figures."""
    cmd = "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs recommended,trl_adaptive --ceiling 0.5"
    proc = run_documented_benchmark(tmp_path, "guard.md", cmd, " --steps 20 --show 20")
    assert "recommended: entropy final" in proc.stdout and "trl_adaptive: entropy final" in proc.stdout
    assert "ceiling 0.5" in proc.stdout + proc.stderr  # the guard's printed lines name its limits


def test_entprobe_train_takes_the_ceiling(tmp_path):
    """``python -m entprobe.train --guard-ceiling``: checked before anything loads (a probe to act on,
    above the floor, in the guard's range), and a run guarded by a ceiling alone below the built-in
    model's entropy (~0.35 nats, token_mean) logs a decision per probed step that names it, never
    raising the factor past 1 and cutting exactly on a resolved rise (its lower bound above the edge)."""
    out = str(tmp_path / "run")
    for kw, match in (({"guard_ceiling": 0.5}, "--guard-ceiling set the lr .* give --probe-every"),
                      ({"guard_ceiling": 0.2, "guard_floor": 0.3, "probe_every": 1}, "--guard-ceiling=0.2 --guard-floor=0.3: "
                       "the ceiling is the band's upper edge and must be above the floor"),
                      ({"guard_ceiling": -1.0, "probe_every": 1}, "--guard-ceiling=-1.0: must be the highest entropy")):
        with pytest.raises(ConfigError, match=match):
            check_args(TrainArgs(out=out, **kw))
    lines, hist = [], []
    train(TrainArgs(out=out, steps=4, save_every=4, probe_every=1, probe_source="rollouts", probe_B_E=0,
                    guard_ceiling=0.1), log=lines.append, on_step=hist.append)
    decided = [h for h in hist if "entprobe/guard_action" in h]
    assert decided and sum(": guard " in line and "ceiling 0.1" in line for line in lines) == len(decided)
    prev = 1.0
    for h in decided:  # while the factor in force is 1, the logged prediction is the one decided on
        assert 0 < h["entprobe/guard_lr_factor"] <= 1
        if prev == 1.0:
            d, se, H = h["entprobe/deltaH_pred"], h["entprobe/SE_deltaH_pred"], h["entprobe/H_orig"]
            assert (h["entprobe/guard_action"] < 0) == (d - 1.96 * se > max(0.1 - H, 0.0)), h  # a resolved rise
        prev = h["entprobe/guard_lr_factor"]
