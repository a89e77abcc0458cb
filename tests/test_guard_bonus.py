"""EntropyGuard's second knob, the entropy bonus's coefficient (integrations/guard_bonus.py): the rule on
hand-computed numbers, its parameters' refusals, and in TRL's GRPOTrainer on the built-in model: the
probe accepts a step whose loss holds the bonus, and TRL's loss uses the coefficient the guard set."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from entprobe.config import ConfigError
from entprobe.integrations import guard as G
from entprobe.integrations.guard_callback import EntropyGuardCallback
from entprobe.integrations import guard_bonus as GB

ROOT = Path(__file__).resolve().parents[1]


def call(**kw):
    args = {"c_now": 0.1, "c_max": 1.0, "d": -0.3, "se": 0.05, "edge": -0.1, "b": 0.5, "b_se": 0.1, "z": 2.0,
            "recovery": 2.0, **kw}
    return GB.decide_coef(**args)


def test_a_resolved_fall_past_the_edge_raises_the_coefficient_to_put_the_step_on_the_edge():
    c = call()  # d + z se = -0.2 < -0.1; b - z SE = 0.3 > 0: c = 0.1 + (-0.1 - -0.3) / 0.5 = 0.5
    assert (c.action, c.coef, c.prev) == ("raise", pytest.approx(0.5), 0.1)
    assert -0.3 + (c.coef - 0.1) * 0.5 == pytest.approx(-0.1)  # the predicted step at c is on the edge
    assert call(c_max=0.3).coef == 0.3 and "entropy_coef_max 0.3" in call(c_max=0.3).reason  # clamped


def test_below_the_floor_a_flat_entropy_raises_it_where_the_lr_cut_cannot_help():
    # the edge is +0.2 (H 0.2 below the floor); d = 0 +- 0.01 is resolved below it, not below 0
    c = call(d=0.0, se=0.01, edge=0.2)
    assert c.action == "raise" and c.coef == pytest.approx(0.1 + 0.2 / 0.5)
    assert G.decide(G.GuardRule(floor=1.0, z=2.0), 3, 0.0, 0.01, 0.8, 1.0).factor == 1.0  # the lr rule holds


def test_an_unresolved_effect_or_interval_holds_and_a_safe_step_decays():
    held = call(b=0.1, b_se=0.1)  # b - z SE < 0: no action on noise
    assert (held.action, held.coef) == ("hold", 0.1) and "not resolved > 0" in held.reason
    assert call(d=-0.12, se=0.05).action == "hold"  # d + z se = -0.02 >= -0.1 > d - z se = -0.22
    decay = call(d=0.05, se=0.05)  # d - z se = -0.05 >= -0.1
    assert (decay.action, decay.coef) == ("decay", pytest.approx(0.05))
    assert call(c_now=1.5e-3, d=0.05, se=0.05).coef == 0.0  # below OFF_FRACTION of the max: off
    assert call(c_now=0.0, d=0.05, se=0.05).action == "hold"


def test_with_a_horizon_the_coefficient_keeps_every_point_forecast_on_the_floor():
    # H_k at factor 1: k=2 is 0.1 below the floor 1.0, k=4 is 0.3 below: increments 0.1/(2 b) = 0.1, 0.3/(4 b) = 0.15
    ahead = [(1, 1.05), (2, 0.9), (3, 1.0), (4, 0.7)]
    assert GB.horizon_increment(ahead, 1.0, 0.5) == pytest.approx(0.15)
    c = call(d=0.0, se=0.01, edge=-0.1, crossing=True, floor=1.0, H_ahead=ahead)  # d inside: the forecast decides
    assert c.action == "raise" and c.coef == pytest.approx(0.25)
    assert call(d=0.05, se=0.01, floor=1.0, H_ahead=ahead).action == "hold"  # a point forecast below: no decay


@pytest.mark.parametrize("kw, msg", [
    ({"floor": 0.5, "entropy_coef_max": 0.0}, "entropy_coef_max=0.0: must be the entropy bonus's largest"),
    ({"floor": 0.5, "entropy_coef_max": math.inf}, "entropy_coef_max=inf: must be"),
    ({"floor": 0.5, "entropy_coef_max": "0.1"}, "entropy_coef_max='0.1': is a str, not a number"),
    ({"floor": 0.5, "entropy_coef": 0.1}, "give entropy_coef_max too"),
    ({"floor": 0.5, "entropy_coef_max": 0.1, "entropy_coef": 0.2}, "above entropy_coef_max=0.1"),
    ({"floor": 0.5, "entropy_coef_max": 0.1, "entropy_coef": -0.1}, "entropy_coef=-0.1: must be"),
    ({"target_deltaH": -0.01, "entropy_coef_max": 0.1}, "give floor or max_decay"),
])
def test_the_knobs_parameters_are_refused_in_one_line_naming_them(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")) as e:
        G.GuardRule(**kw)
    assert "\n" not in str(e.value)


def test_the_decision_line_says_the_coefficient():
    d = G.decide(G.GuardRule(floor=0.5, entropy_coef_max=1.0, z=2.0), 4, -0.3, 0.05, 0.55, 1.0)
    d.coef = call()
    assert d.line(G.GuardRule(floor=0.5, entropy_coef_max=1.0)).endswith(
        "; entropy_coef 0.1 -> 0.5 (raise; bonus effect +5.00e-01 +- 1.0e-01 a unit))")


def _trainer(tmp_path, steps=3, **config):
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grpo_setup import trainer_parts
    from trl import GRPOTrainer

    ns = trainer_parts(str(tmp_path), steps, prompts_per_step=4)
    for k, v in config.items():
        setattr(ns["grpo_config"], k, v)
    return GRPOTrainer(model=ns["model"], reward_funcs=ns["reward_fn"], args=ns["grpo_config"],
                       train_dataset=ns["dataset"], processing_class=ns["tokenizer"])


def test_trl_loss_uses_the_coefficient_the_guard_set_and_the_probe_accepts_the_bonus(tmp_path, capsys):
    """A floor far above the model's entropy: every step is below it. From c = 0.1 at step 1 (TRL's bonus on
    from the start, in the loss the probe checks against .grad), the coefficient each decision sets is the
    one TRL's loss logs at the next step; every probe predicted (none refused for a gradient mismatch)."""
    trainer = _trainer(tmp_path)
    cb = EntropyGuardCallback(trainer, every_n_steps=1, source="rollouts",
                                guard={"floor": 10.0, "entropy_coef_max": 0.5, "entropy_coef": 0.1})
    trainer.add_callback(cb)
    trainer.train()
    assert [d.step for d in cb.decisions] == [1, 2, 3]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    used = [h["entropy_coef"] for h in logs]  # TRL's own metric: the coefficient its loss applied
    assert used[0] == 0.1 and used[1:] == [d.coef.coef for d in cb.decisions[:-1]]
    assert [h["entprobe/entropy_coef"] for h in logs] == used  # the probe predicted each step with it in force
    assert [h["entprobe/guard_entropy_coef"] for h in logs] == [d.coef.coef for d in cb.decisions]
    for h, d in zip(logs, cb.decisions):
        assert h["entprobe/guard_bonus_effect"] == d.coef.effect == h["entprobe/bonus_effect"]
        assert h["entprobe/SE_bonus_effect"] > 0
    assert any(d.coef.action == "raise" for d in cb.decisions)  # the knob acted in these 3 steps
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("entprobe: step ")]
    assert len(printed) == 3 and all("; entropy_coef " in x for x in printed)
    assert trainer.state.stateful_callbacks[G.STATE_KEY]["entropy_coef"] == cb.decisions[-1].coef.coef


def test_trl_probe_alone_carries_a_static_bonus_in_the_objective(tmp_path):
    """GRPOConfig.entropy_coef=0.2, no guard: the rollouts probe reads TRL's coefficient (without it, the
    objective would miss the bonus's gradient: its check against .grad refuses a 5% difference)."""
    from entprobe.integrations.trl import EntropyProbeCallback

    trainer = _trainer(tmp_path, steps=2, entropy_coef=0.2)
    cb = EntropyProbeCallback(trainer, every_n_steps=1, source="rollouts")
    trainer.add_callback(cb)
    trainer.train()
    assert [r["entropy_coef"] for r in cb.history] == [0.2, 0.2]
    assert all(r["rollouts/grad_residual"] < 1e-3 for r in cb.history)


@pytest.mark.parametrize("config, kw, msg", [
    ({"use_adaptive_entropy": True}, {}, "use_adaptive_entropy=True would both set trainer.entropy_coef"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 2}, {}, "gradient_accumulation_steps=2"),
    ({}, {"source": "held_out"}, "use source='rollouts'"),
])
def test_trl_layouts_the_knob_cannot_model_are_refused_before_training(tmp_path, config, kw, msg):
    trainer = _trainer(tmp_path, **config)
    with pytest.raises(ConfigError, match=msg) as e:
        EntropyGuardCallback(trainer, every_n_steps=1, **{"source": "rollouts", **kw},
                               guard={"floor": 1.0, "entropy_coef_max": 0.5})
    assert "\n" not in str(e.value) and str(e.value).startswith("EntropyGuard: entropy_coef_max=0.5")


def _token_mean_entropy(model, batch):
    """TRL's bonus term: the mean per-token full-vocabulary entropy over the batch's completion tokens."""
    from entprobe.rollouts.logprobs import token_logprobs

    ids, att, resp = batch.flat(next(model.parameters()).device)
    tl = token_logprobs(model, ids, att, resp, batch.temperature, with_entropy="grad")
    return tl.entropy.sum() / resp.sum()


def test_plain_loop_probe_needs_the_coefficient_in_force_and_the_guard_sets_the_next():
    """The built-in model, entprobe's DR-GRPO loss minus c H (c = 1: the bonus is most of the gradient):
    told c, the probe predicts the step (its objective reproduces .grad); told nothing, its check refuses
    the gradient as another loss's. The guard passes its own coefficient and sets the next step's."""
    from conftest import rollout_loop_parts
    from entprobe.integrations.online import OnlineProbe

    model, tok, task, opt, step_batch = rollout_loop_parts()

    def bonus_batch(seed, c):
        batch = step_batch(seed)  # the policy loss's gradient in .grad
        (-c * _token_mean_entropy(model, batch)).backward()
        return batch

    probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
    batch = bonus_batch(1, 1.0)
    with pytest.raises(ConfigError, match="is not the objective entprobe's on the batch"):
        probe.before_step(2, rollouts=batch)
    assert probe.before_step(2, rollouts=batch, entropy_coef=1.0)
    assert probe._pending.res["entropy_coef"] == 1.0 and probe._pending.res["rollouts/grad_residual"] < 1e-4
    with pytest.raises(ConfigError, match="entropy_coef=-1.0: the entropy bonus's coefficient"):
        probe.before_step(2, rollouts=batch, entropy_coef=-1.0)

    guard = G.EntropyGuard(OnlineProbe(model, opt, tok, None, every=1, source="rollouts"), floor=10.0,
                           entropy_coef_max=2.0, entropy_coef=1.0)
    batch = bonus_batch(2, guard.entropy_coef)
    guard.before_step(2, rollouts=batch)
    opt.step()
    m = guard.after_step()
    d = guard.decisions[-1]
    assert m["entprobe/entropy_coef"] == 1.0 and m["entprobe/guard_entropy_coef"] == guard.entropy_coef == d.coef.coef
    assert math.isfinite(d.coef.effect) and d.coef.SE > 0 and m["entprobe/guard_bonus_effect"] == d.coef.effect
    with pytest.raises(ConfigError, match="the guard passes its own coefficient"):
        guard.before_step(3, rollouts=batch, entropy_coef=0.5)
    state = guard.state_dict()
    assert state["entropy_coef"] == guard.entropy_coef
    with pytest.raises(ConfigError, match=r"'entropy_coef' 3.0 is not in \[0, entropy_coef_max\] = \[0, 2\]"):
        guard.load_state_dict({**state, "entropy_coef": 3.0})
    with pytest.raises(ConfigError, match="use OnlineProbe\\(..., source='rollouts'\\)"):
        G.EntropyGuard(OnlineProbe(model, opt, tok, task, every=1), floor=1.0, entropy_coef_max=1.0)
