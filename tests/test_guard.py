"""EntropyGuard (integrations/guard.py): the decision rule on hand-computed cases, and the guard in a
plain loop and in TRL's GRPOTrainer on the built-in default model (docs/guard.md's snippets, verbatim):
the lr each ``optimizer.step()`` uses is the scheduler's times the factor decided, the scheduler's lr
is put back after the step, and the probe's prediction is that of the step taken."""
from __future__ import annotations

import dataclasses
import math
import numpy
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_documented_benchmark
from entprobe.config import ConfigError
from entprobe.integrations import guard as G

ROOT = Path(__file__).resolve().parents[1]


def rule(**kw) -> G.GuardRule:
    return G.GuardRule(**{"z": 2.0, "min_factor": 0.05, "recovery": 2.0, **kw})


def test_band_edge_is_the_tighter_of_floor_and_max_decay():
    assert G.band_edge(1.0, 0.8, 0.1) == pytest.approx(-0.1)    # floor 0.2 away: max_decay binds
    assert G.band_edge(0.85, 0.8, 0.1) == pytest.approx(-0.05)  # 0.05 above the floor: the floor binds
    assert G.band_edge(0.7, 0.8, 0.1) == pytest.approx(0.1)     # below the floor: must rise 0.1
    assert G.band_edge(0.7, None, 0.1) == -0.1 and G.band_edge(0.7, 0.8, None) == pytest.approx(0.1)
    assert G.band_edge(0.7, None, None) is None


def test_a_resolved_decrease_past_the_edge_is_cut_to_the_edge():
    # d + z se = -0.4 + 2 * 0.1 = -0.2 < -0.1: resolved; factor -0.1 / -0.4 = 0.25
    d = G.decide(rule(max_decay=0.1), 5, -0.4, 0.1, 1.0, 1.0)
    assert (d.action, d.factor, d.code) == ("cut", pytest.approx(0.25), -1)
    assert "max_decay edge -1.000e-01" in d.reason and "on the edge" in d.reason
    assert d.factor * -0.4 == pytest.approx(-0.1)  # the step at lr x factor is predicted on the edge
    # a cut from an earlier, stronger factor raises it: the ratio is the factor, whatever came before
    assert G.decide(rule(max_decay=0.1), 6, -0.4, 0.1, 1.0, 0.1).code == 1


def test_an_unresolved_prediction_is_not_acted_on_and_the_factor_recovers():
    # d + z se = -0.4 + 0.4 = 0.0 >= -0.1: the interval holds the edge
    held = G.decide(rule(max_decay=0.1), 5, -0.4, 0.2, 1.0, 1.0)
    assert (held.action, held.factor, held.code) == ("hold", 1.0, 0)
    assert "unresolved" in held.reason
    up = G.decide(rule(max_decay=0.1), 5, -0.4, 0.2, 1.0, 0.25)
    assert (up.action, up.factor, up.code) == ("recover", 0.5, 1)  # 0.25 x recovery 2
    assert G.decide(rule(max_decay=0.1), 5, -0.4, 0.2, 1.0, 0.75).factor == 1.0  # capped at 1
    safe = G.decide(rule(max_decay=0.1), 5, -0.01, 0.02, 1.0, 0.25)  # d - z se = -0.05 >= -0.1
    assert safe.factor == 0.5 and "inside the band" in safe.reason
    assert G.recovered(3.0, 2.0) == 1.5 and G.recovered(1.5, 2.0) == 1.0  # from above, down to 1


def test_factor_is_clamped_to_its_range():
    d = G.decide(rule(max_decay=0.1), 5, -10.0, 0.1, 1.0, 1.0)  # ratio 0.01 < min_factor 0.05
    assert d.factor == 0.05 and "as near it as allowed" in d.reason
    assert G.clamp(3.0, 0.05, 2.0) == 2.0 and G.clamp(-1.0, 0.05, 2.0) == 0.05
    assert G.ratio_factor(0.0, -0.1) == math.inf


def test_floor_against_max_decay():
    r = rule(floor=0.8, max_decay=0.1)
    near = G.decide(r, 5, -0.2, 0.01, 0.85, 1.0)  # the floor's edge -0.05: factor 0.25
    assert near.factor == pytest.approx(0.25) and "floor edge" in near.reason
    below = G.decide(r, 5, -0.2, 0.01, 0.7, 1.0)  # below the floor (edge +0.1): any resolved decrease
    assert below.action == "cut" and below.factor == 0.05
    rising = G.decide(r, 5, 0.05, 0.01, 0.7, 0.25)  # resolved rise, short of the edge: not cut
    assert rising.action == "recover" and rising.factor == 0.5 and "raises entropy" in rising.reason
    unsure = G.decide(r, 5, -0.01, 0.02, 0.7, 0.25)  # below the floor, the sign unresolved: held
    assert unsure.action == "hold" and unsure.factor == 0.25 and "unresolved" in unsure.reason


def test_target_deltaH_steers_when_resolved_and_reachable():
    r = rule(target_deltaH=-0.01, max_factor=2.0)
    steer = G.decide(r, 5, -0.04, 0.005, 1.0, 1.0)
    assert steer.action == "steer" and steer.factor == pytest.approx(0.25)
    assert G.decide(r, 5, -0.005, 0.001, 1.0, 1.0).factor == pytest.approx(2.0)  # 2x lr: clamped at max_factor
    assert G.decide(r, 5, -0.012, 0.005, 1.0, 1.0).action == "hold"  # within z SE of the target
    assert G.decide(r, 5, 0.02, 0.001, 1.0, 1.0).action == "hold"  # opposite sign: no lr > 0 reaches it
    # the target asks 5x (clamped to 4x), the band allows -0.02 / -0.01 = 2x: steered to 2x
    capped = G.decide(rule(target_deltaH=-0.05, max_decay=0.02, max_factor=4.0), 5, -0.01, 0.0005, 1.0, 1.0)
    assert capped.action == "steer" and capped.factor == pytest.approx(2.0)


def test_rule_parameters_are_checked():
    with pytest.raises(ConfigError, match="give floor, max_decay, ceiling or target_deltaH"):
        G.GuardRule()
    with pytest.raises(ConfigError, match="max_decay=-0.1"):
        G.GuardRule(max_decay=-0.1)
    with pytest.raises(ConfigError, match="min_factor=0"):
        G.GuardRule(max_decay=0.1, min_factor=0)
    with pytest.raises(ConfigError, match="recovery=1"):
        G.GuardRule(max_decay=0.1, recovery=1)
    # each of these made a guard that never acts (NaN compares False) or could multiply the lr by inf;
    # a string failed inside math.isfinite naming no parameter, a bool passed as a number, a floor
    # below 0 (entropy is never negative) never acts: each is refused naming its parameter alone
    for bad, key in ((dict(floor=math.nan), "floor=nan"), (dict(target_deltaH=math.nan), "target_deltaH=nan"),
                     (dict(max_decay=math.inf), "max_decay=inf"), (dict(target_deltaH=0.0), "target_deltaH=0"),
                     (dict(max_decay=0.1, max_factor=math.inf), "max_factor=inf: must be"),
                     (dict(floor="abc"), "floor='abc': is a str, not a number"),
                     (dict(floor=True), "floor=True: is a bool, not a number"),
                     (dict(floor=-1), "floor=-1: must be the lowest entropy to hold, in nats: a finite number >= 0"),
                     (dict(max_decay=0.1, z=False), "z=False: is a bool"),
                     (dict(max_decay=0.1, min_factor="0.5"), "min_factor='0.5': is a str"),
                     (dict(max_decay=0.1, max_factor=0.5), "max_factor=0.5: must be"),
                     (dict(max_decay=0.1, recovery=None), "recovery=None: must be")):
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}"):
            G.GuardRule(**bad)
    assert G.GuardRule(floor=0, max_decay=numpy.float32(0.5)).max_decay == 0.5  # numbers of any kind, as floats


def guard_snippets() -> tuple[str, str]:
    """docs/guard.md's two ```python blocks: the plain loop, then TRL."""
    return tuple(re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "guard.md").read_text(), re.S | re.M))




def test_plain_loop_guard_sets_the_lr_it_decided_and_the_prediction_is_the_step_taken(monkeypatch, step_lrs):
    """docs/guard.md's loop, verbatim, 3 steps on the built-in model with an ExponentialLR schedule; the
    decisions are forced to factors 0.5, 0.25 then 0.5 (step 1 is probed too; the rule is tested above): each step's lr is the
    schedule's times the factor, the schedule's lr is back in the groups after it, the gradient and
    torch's RNG are as the loop left them, and the probe's prediction is the step taken."""
    from entprobe.checkpoints.default_checkpoint import policy_loss, trainer_adamw
    from entprobe.config import SamplingConfig
    from entprobe.integrations.grpo_trainer import TrainArgs, load_policy, load_task
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    forced = {1: 0.5, 2: 0.25, 3: 0.5}
    real = G.decide
    monkeypatch.setattr(G, "decide", lambda *a: dataclasses.replace(real(*a), factor=forced[a[1]]))
    kept = []
    before = G.EntropyGuard.before_step

    def watched(self, step):
        grads = [p.grad.clone() for p in self.probe.model.parameters()]
        rng = torch.get_rng_state()
        out = before(self, step)
        kept.append(all(torch.equal(g, p.grad) for g, p in zip(grads, self.probe.model.parameters()))
                    and torch.equal(rng, torch.get_rng_state()))
        return out
    monkeypatch.setattr(G.EntropyGuard, "before_step", watched)

    model, tokenizer = load_policy(TrainArgs(out=""))
    task = load_task(TrainArgs(out=""))
    optimizer = trainer_adamw(model, 1e-3, 0.01)
    schedule = lambda s: 0.8 ** s  # noqa: E731
    # recursive (lr <- lr x gamma from the groups' lr): a factor left in the groups would compound
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.8)
    seeds = iter(range(100))

    def compute_loss(model):
        s = next(seeds)
        b = sample_batch(model, tokenizer, task, draw_prompt_indices(len(task.prompts), 4, s), 4,
                         SamplingConfig(max_new_tokens=4), s, "dr_grpo", 1e-6)
        return policy_loss(model, b, "dr_grpo")

    ns = {"model": model, "optimizer": optimizer, "tokenizer": tokenizer, "task": task, "scheduler": scheduler,
          "compute_loss": compute_loss, "num_steps": 3}
    exec(guard_snippets()[0], ns)
    guard = ns["guard"]
    used_lrs = [lrs for opt, lrs in step_lrs if opt is optimizer]
    assert [d.step for d in guard.decisions] == [1, 2, 3]  # step 1 too: AdamW's first step has a closed form
    factors = [0.5, 0.25, 0.5]
    assert len(used_lrs) == 3
    for s, (used, f) in enumerate(zip(used_lrs, factors), 1):
        assert used == [pytest.approx(1e-3 * schedule(s - 1) * f, rel=1e-12)] * 2, s
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(1e-3 * schedule(3), rel=1e-12)] * 2
    assert scheduler.get_last_lr() == [pytest.approx(1e-3 * schedule(3), rel=1e-12)] * 2
    assert kept == [True] * 3
    assert ns["metrics"]["entprobe/guard_lr_factor"] == 0.5 and "entprobe/guard_action" in ns["metrics"]
    for r, f in zip(guard.probe.history, factors[1:]):
        assert r["lr"] == pytest.approx(used_lrs[r["step"] - 1][0], rel=1e-12)
        # the rescaled prediction is the step taken (the unscaled one would be off by 1/f)
        assert r["deltaH1_step"] == pytest.approx(r["deltaH_pred"], rel=1e-3, abs=1e-9)
        assert r["ci95_pred_low"] <= r["deltaH_pred"] <= r["ci95_pred_high"]


def test_online_probe_pending_view_and_rescale():
    """``OnlineProbe.pending`` (the guard's input) shows the waiting prediction: its step, deltaH_pred
    and SE, lr, and E's entropy H, which after the step is the ``H_orig`` the probe logs;
    ``rescale_pending(f)`` makes it the prediction of the step at f x lr (deltaH_pred, SE, interval, lr
    scaled; the measured step then agrees with it); with nothing waiting it is None / refused."""
    from entprobe.checkpoints.default_checkpoint import policy_loss, trainer_adamw
    from entprobe.config import SamplingConfig
    from entprobe.integrations import OnlineProbe
    from entprobe.integrations.grpo_trainer import TrainArgs, load_policy, load_task
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    model, tokenizer = load_policy(TrainArgs(out=""))
    task = load_task(TrainArgs(out=""))
    optimizer = trainer_adamw(model, 1e-3, 0.01)
    probe = OnlineProbe(model, optimizer, tokenizer, task, every=2, batch={"B_E": 4})  # step 2 alone
    assert probe.pending is None
    with pytest.raises(RuntimeError, match="no prediction is waiting"):
        probe.rescale_pending(0.5)
    for step in (1, 2):
        b = sample_batch(model, tokenizer, task, draw_prompt_indices(len(task.prompts), 4, step), 4,
                         SamplingConfig(max_new_tokens=4), step, "dr_grpo", 1e-6)
        optimizer.zero_grad()
        policy_loss(model, b, "dr_grpo").backward()
        if probe.before_step(step):
            p = probe.pending
            assert (p.step, p.lr) == (2, pytest.approx(1e-3, rel=1e-12))
            probe.rescale_pending(0.25)
            q = probe.pending
            assert (q.deltaH_pred, q.SE, q.lr, q.H) == (pytest.approx(0.25 * p.deltaH_pred, rel=1e-12),
                                                        pytest.approx(0.25 * p.SE, rel=1e-12),
                                                        pytest.approx(0.25e-3, rel=1e-12), p.H)
            for g in optimizer.param_groups:
                g["lr"] *= 0.25
        optimizer.step()
        probe.after_step()
    assert probe.pending is None
    r = probe.history[-1]
    assert r["H_orig"] == pytest.approx(p.H, rel=1e-9)
    assert r["deltaH_pred"] == pytest.approx(q.deltaH_pred, rel=1e-12) and r["lr"] == pytest.approx(0.25e-3)
    assert r["deltaH1_step"] == pytest.approx(r["deltaH_pred"], rel=1e-3, abs=1e-9)  # the step taken
    assert r["step_mismatch"] is False  # the step checked is the rescaled one


def test_a_decision_is_one_line_with_the_prediction_and_the_limits():
    d = G.decide(rule(floor=0.2, max_decay=0.1), 16, -0.4, 0.1, 1.0, 1.0)  # cut to 0.25 (the max_decay edge)
    assert d.line(rule(floor=0.2, max_decay=0.1)) == (
        "entprobe guard: step 16: lr x0.25, cut (predicted -0.4 +- 0.1 nats at the scheduler's lr, H 1, "
        "floor 0.2, max_decay 0.1)")
    held = G.decide(rule(target_deltaH=-0.01), 3, -0.01, 0.02, 0.5, 1.0)
    assert held.line(rule(target_deltaH=-0.01)).startswith("entprobe guard: step 3: lr x1, hold (predicted -0.01 +- 0.02")
    assert held.line(rule(target_deltaH=-0.01)).endswith(", H 0.5, target_deltaH -0.01)")


def test_trl_callback_applies_the_factor_on_top_of_the_scheduler_and_logs_its_decisions(tmp_path, step_lrs,
                                                                                       monkeypatch, capsys):
    """docs/guard.md's TRL snippet, verbatim, 3 steps of GRPOTrainer with a linear schedule, the
    band ``max_decay 0, z 0`` and step 2's factor forced to 0.25 (so step 3 starts from it whichever
    way its prediction goes): the lr each step uses is the schedule's times the factor in force, the
    trainer logs the schedule's lr and the guard's factor, action and decisions."""
    pytest.importorskip("trl")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grpo_setup import trainer_parts

    real = G.decide
    monkeypatch.setattr(G, "decide", lambda *a: dataclasses.replace(real(*a), factor=0.25) if a[1] == 2 else real(*a))
    ns = trainer_parts(str(tmp_path), 3, prompts_per_step=4)
    ns["grpo_config"].lr_scheduler_type = "linear"
    snippet = guard_snippets()[1].replace('{"floor": 0.2, "max_decay": 0.05}', '{"max_decay": 0.0, "z": 0.0}')
    assert snippet != guard_snippets()[1]
    exec(snippet, ns)
    cb, trainer = ns["guard"], ns["trainer"]
    assert [d.step for d in cb.decisions] == [1, 2, 3] and all(d.reason for d in cb.decisions)
    d = cb.decisions[2]  # max_decay 0, z 0: a predicted decrease is cut to min_factor, a rise recovers
    assert d.prev == 0.25 and d.factor == (0.05 if d.deltaH_pred < 0 else 0.375)
    in_force = [d.factor for d in cb.decisions]  # step 1 decided too (AdamW's first step is probed)
    scheduled = [1e-3 * (1 - s / 3) for s in range(3)]
    used = [lrs[0] for opt, lrs in step_lrs if opt is trainer.optimizer.optimizer]
    assert [u for u in used] == [pytest.approx(lr * f, rel=1e-12) for lr, f in zip(scheduled, in_force)]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["learning_rate"] for h in logs] == [pytest.approx(x, rel=1e-12) for x in scheduled]  # the schedule's
    for h, f in zip(logs, in_force):
        assert h["entprobe/guard_lr_factor"] == f
    assert [h["entprobe/guard_action"] for h in logs] == [float(d.code) for d in cb.decisions]
    assert [h["entprobe/guard_lr"] for h in logs] == [pytest.approx(u, rel=1e-12) for u in used]
    assert [h["entprobe/lr"] for h in logs] == [pytest.approx(lr * f, rel=1e-12)
                                               for lr, f in zip(scheduled, in_force)]
    # each guarded step printed as one line (one process: the main one), in order, at the lr it used
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("entprobe: step ")]
    assert [x.split(": ")[1] for x in printed] == ["step 1", "step 2", "step 3"]
    for x, d, h in zip(printed, cb.decisions, logs):
        assert x.startswith(f"entprobe: step {d.step}: guard {d.action}: lr x{d.factor:.3g} = {h['entprobe/lr']:.3g} "
                            f"(was x{d.prev:.3g}, max_decay 0); predicted {h['entprobe/deltaH_pred']:+.3e} ± ")
        assert f"vs predicted {h['entprobe/deltaH_pred']:+.3e}: " in x and "scheduler's lr" not in x
    assert ": lr x0.25 = " in printed[1]  # step 2's forced factor


def test_benchmark_command_runs_verbatim(tmp_path):
    """docs/guard.md's command, verbatim (its paths under a scratch folder that links benchmarks/,
    so the committed figure is not overwritten): it exits 0, prints the figures and writes the plot."""
    cmd = "OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --out docs/img/entropy_guard.png"
    # the command as documented, shortened to 8 steps (the test's time; the figures are docs/guard.md's)
    proc = run_documented_benchmark(tmp_path, "guard.md", cmd, " --steps 8")
    for line in ("unguarded: entropy final", "guarded: entropy final", "sign agreement", "coverage: paired 95%"):
        assert line in proc.stdout, line
    assert (tmp_path / "docs" / "img" / "entropy_guard.png").stat().st_size > 10_000


def test_recommended_settings_benchmark_runs_verbatim(tmp_path):
    """docs/guard.md's comparison of the settings for a new run (the bonus knob on) with TRL's adaptive
    entropy and a lower lr, verbatim but shortened to 6 steps: each run prints its figures, the
    recommended run's guard probes from the step's own batch, and TRL's rule logs its coefficient."""
    cmd = ("OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs unguarded,guarded,recommended,trl_adaptive,"
           "lower_lr --out docs/img/entropy_guard_recommended.png")
    proc = run_documented_benchmark(tmp_path, "guard.md", cmd, " --steps 6 --json runs.json")
    for name in ("unguarded", "guarded", "recommended", "trl_adaptive", "lower_lr"):
        assert f"{name}: entropy final" in proc.stdout, name
    assert "mean |H - floor| from step 21 nan" in proc.stdout  # 6 steps: no step 21
    assert "online probe, recommended run: 6 probes" in proc.stdout
    assert (tmp_path / "docs" / "img" / "entropy_guard_recommended.png").stat().st_size > 10_000
    # --from-json: the same runs read back (as when each ran in its own process) report the same figures
    again = run_documented_benchmark(tmp_path, "guard.md", cmd, " --steps 6 --from-json runs.json")

    def report(out: str) -> list[str]:
        lines = out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("6 steps at lr"))
        return [line for line in lines[start:] if not line.startswith(("runs:", "figure:"))]
    assert report(again.stdout) == report(proc.stdout) and len(report(proc.stdout)) > 10


def test_builtin_trainer_guard_option(tmp_path):
    """``python -m entprobe.train --guard-max-decay``: the guard on the trainer's probe; each probed
    step's entry logs the guard's factor and the lr used (the schedule's times the factor), the
    logged ``learning_rate`` stays the schedule's; without --probe-every it is refused, naming it."""
    from entprobe.cli.train import parse_train_args
    from entprobe.integrations.grpo_trainer import check_args, train

    a = parse_train_args(["--out", str(tmp_path / "run"), "--steps", "3", "--B", "4", "--probe-every", "1",
                          "--probe-B-E", "4", "--guard-max-decay", "0", "--save-every", "3",
                          "--lr-scheduler", "linear"])
    lines, entries = [], []
    train(a, log=lines.append, on_step=entries.append)
    assert [e["step"] for e in entries if "entprobe/guard_action" in e] == [1, 2, 3]
    assert [e["learning_rate"] for e in entries] == [pytest.approx(1e-3 * (1 - s / 3), rel=1e-12) for s in range(3)]
    for e in entries:
        assert e["entprobe/guard_lr"] == pytest.approx(e["learning_rate"] * e["entprobe/guard_lr_factor"], rel=1e-12)
    assert sum(": guard " in line for line in lines) == 3  # one line per decision, step 1's too
    with pytest.raises(ConfigError, match="--guard-floor / --guard-max-decay / --guard-ceiling .* give --probe-every"):
        check_args(parse_train_args(["--out", str(tmp_path / "x"), "--guard-floor", "0.2"]))
    with pytest.raises(ConfigError, match="--guard-max-decay=-1.0"):
        check_args(parse_train_args(["--out", str(tmp_path / "x"), "--probe-every", "1", "--guard-max-decay", "-1"]))
