"""EntropyGuard's state (integrations/guard.py): the factor a resumed run continues with (TRL's
trainer_state.json, the built-in trainer's log history, ``state_dict`` for plain loops), the factor
taken off after an ``optimizer.step()`` that raised, param groups with different lrs refused, and the
line that says what the probes cost."""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

from entprobe.config import ConfigError
from entprobe.integrations import guard as G
from entprobe.integrations.guard_callback import EntropyGuardCallback

ROOT = Path(__file__).resolve().parents[1]


def test_guard_state_dict_round_trips_and_refuses_a_bad_factor():
    """``state_dict`` carries the factor in force; ``load_state_dict`` restores it and refuses what no
    guard could have saved, naming the key."""
    g = G.EntropyGuard.__new__(G.EntropyGuard)
    g.factor, g.decisions, g.rule = 0.3, [], G.GuardRule(max_decay=0.1, min_factor=0.05, max_factor=2.0)
    assert g.state_dict() == {"factor": 0.3, "decided_at": None}
    g.load_state_dict({"factor": 0.125, "decided_at": 7})
    assert g.factor == 0.125
    for bad in ({"factor": 0.0}, {"factor": float("nan")}, {"factor": "0.5"}, {"factor": True}, {}, None):
        with pytest.raises(ConfigError, match="'factor' must be a finite number > 0"):
            g.load_state_dict(bad)
    # every factor the guard sets is clamped to [min_factor, max_factor]: one outside was saved by a
    # guard of another range or edited (1e308 would multiply the lr by 1e308)
    for bad in (1e308, 2.5, 0.01):
        with pytest.raises(ConfigError, match=rf"'factor' {re.escape(repr(bad))} is outside this guard's \[min_factor, max_factor\] "
                                              r"= \[0\.05, 2\]"):
            g.load_state_dict({"factor": bad})
        assert g.factor == 0.125  # unchanged
    for edge in (0.05, 2.0):
        g.load_state_dict({"factor": edge})
        assert g.factor == edge


def test_trl_resume_continues_with_the_saved_factor(tmp_path, step_lrs, monkeypatch, capsys):
    """A GRPOTrainer run guarded every 2 steps, step 2's decision forced to 0.25 and checkpointed:
    checkpoint-2's trainer_state.json holds the guard's state, and ``train(resume_from_checkpoint=)``
    takes step 3 (not probed: the factor in force holds) at 0.25 x the lr, as the uninterrupted run
    would; a fresh run starts at 1."""
    pytest.importorskip("trl")
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grpo_setup import build_trainer

    real = G.decide
    monkeypatch.setattr(G, "decide", lambda *a: dataclasses.replace(real(*a), factor=0.25) if a[1] == 2 else real(*a))

    def guarded(steps):
        tr = build_trainer(str(tmp_path), steps, prompts_per_step=4)
        tr.args.save_strategy, tr.args.save_steps = "steps", 2
        cb = EntropyGuardCallback(tr, every_n_steps=2, guard={"max_decay": 0.0}, batch={"B_E": 4})
        tr.add_callback(cb)
        return tr, cb

    tr, cb = guarded(2)
    tr.train()
    assert [d.step for d in cb.decisions] == [2] and cb.guard.factor == 0.25
    assert [(s, lrs[0]) for s, lrs in cb.guard.lrs] == [(1, 1e-3), (2, pytest.approx(2.5e-4, rel=1e-12))]
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved[G.STATE_KEY] == {"factor": 0.25, "decided_at": 2}
    step_lrs.clear()
    (tmp_path / "entprobe_over_steps.csv").unlink()  # as if the first process had died before its end
    tr, cb = guarded(3)
    tr.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    out = capsys.readouterr().out
    assert "EntropyGuard resumed at step 2 with lr factor 0.25" in out
    assert re.search(r"entprobe: 1 probe\(s\) took [\d.]+ s, [\d.]+% of the [\d.]+ s of training without them "
                     r"\([\d.]+ s a probe, every 2 step\(s\), B_E = 4\)", out)  # the first run's cost line
    assert cb.decisions == [] and [s for s, _ in cb.guard.lrs] == [3]
    assert [lrs for opt, lrs in step_lrs if opt is tr.optimizer.optimizer] == [[pytest.approx(2.5e-4, rel=1e-12)] * 2]
    # the resumed run probed nothing itself: its over-steps table holds step 2's probe from the log history
    rows = (tmp_path / "entprobe_over_steps.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("2,ok,")


def test_builtin_trainer_resume_continues_with_the_logged_factor(tmp_path):
    """``python -m entprobe.train --resume``: the guard starts from the factor the checkpoint's last
    step logged (set to 0.37 in checkpoint-2's trainer_state.json), so step 3, which the probe does
    not predict (--probe-every 2), takes 0.37 x the schedule's lr."""
    import json

    from entprobe.cli.train import parse_train_args
    from entprobe.integrations.grpo_trainer import train

    opts = ["--out", str(tmp_path / "run"), "--B", "4", "--probe-every", "2", "--probe-B-E", "4",
            "--guard-max-decay", "0", "--save-every", "2"]
    train(parse_train_args(opts + ["--steps", "2"]), log=lambda s: None)
    state_file = tmp_path / "run" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert "entprobe/guard_lr_factor" in state["log_history"][-1]
    state["log_history"][-1]["entprobe/guard_lr_factor"] = 0.37
    state_file.write_text(json.dumps(state))
    lines, entries = [], []
    train(parse_train_args(opts + ["--steps", "3", "--resume", "last"]), log=lines.append, on_step=entries.append)
    assert "[entprobe] guard resumed with lr factor 0.37" in lines
    assert [e["step"] for e in entries] == [3] and entries[0]["entprobe/guard_lr_factor"] == 0.37
    assert entries[0]["entprobe/guard_lr"] == pytest.approx(0.37 * entries[0]["learning_rate"], rel=1e-12)


def test_cost_line_is_the_probes_time_over_the_rest_of_training():
    from entprobe.integrations.trl import cost_line

    h = [{"time_s": 2.0, "B_E": 8}, {"time_s": 3.0, "B_E": 8}]
    assert cost_line(h, 105.0, 10) == ("entprobe: 2 probe(s) took 5.0 s, 5.0% of the 100.0 s of training without "
                                       "them (2.5 s a probe, every 10 step(s), B_E = 8)")


class _StubProbe:
    """An OnlineProbe stand-in: predicts at every step a resolved decrease that ``max_decay=0.1``
    cuts to factor 0.25 (d -0.4 +- 0.01 at H 1)."""

    def __init__(self, optimizer):
        self.optimizer, self._due = optimizer, False

    def before_step(self, step):
        self._due = True
        return True

    @property
    def pending(self):
        from entprobe.integrations.online import PendingPrediction
        return PendingPrediction(1, -0.4, 0.01, 1.0, self.optimizer.param_groups[0]["lr"]) if self._due else None

    def rescale_pending(self, factor):
        pass

    def after_step(self):
        self._due = False
        return {}


def test_a_failed_optimizer_step_leaves_no_factor_in_the_param_groups():
    """``optimizer.step()`` raising between ``before_step`` and ``after_step``: ``restore_lr`` puts
    the scheduler's lr back in every group (two groups, different lrs); without it, the next
    ``before_step`` does it first, so the factor is not applied on top of itself (before: 0.25 x
    0.25, and the scheduler's lr lost for good); a group whose lr the scheduler rewrote meanwhile
    keeps the scheduler's value."""
    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w1], "lr": 0.1}, {"params": [w2], "lr": 0.01}], momentum=0.9)
    guard = G.EntropyGuard(_StubProbe(opt), max_decay=0.1)
    lrs = lambda: [g["lr"] for g in opt.param_groups]  # noqa: E731
    assert guard.before_step(1) == pytest.approx(0.25) and lrs() == pytest.approx([0.025, 0.0025])
    guard.restore_lr()  # as in the loop's except after optimizer.step() raised
    assert lrs() == [0.1, 0.01]
    guard.restore_lr()  # idempotent
    assert lrs() == [0.1, 0.01]
    guard.before_step(2)  # raised again: no restore_lr, no after_step
    guard.before_step(3)
    assert lrs() == pytest.approx([0.025, 0.0025])  # the factor once, on the scheduler's lr
    guard.after_step()
    assert lrs() == [0.1, 0.01]
    guard.before_step(4)
    opt.param_groups[1]["lr"] = 0.005  # the scheduler stepped after the failure
    guard.before_step(5)
    assert lrs() == pytest.approx([0.025, 0.00125])
    guard.after_step()
    assert lrs() == [0.1, 0.005]


def test_param_groups_with_different_lrs_are_refused_before_training():
    """The probe's geometry takes one lr: two param groups at 1e-3 and 3e-4 failed at the first
    probe inside the training loop, telling the user to set ``optimizer.lr``, a key the online
    probe refuses. Now: a ConfigError when the probe is made, and at a probe whose groups a
    schedule set apart, saying to give every group the same lr."""
    from entprobe.integrations import OnlineProbe

    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w1], "lr": 1e-3}, {"params": [w2], "lr": 3e-4}], momentum=0.9)
    (w1.sum() + w2.sum()).backward()
    opt.step()  # momentum state: the probe is due
    with pytest.raises(ConfigError, match=r"^OnlineProbe: the optimizer's param groups have different lrs "
                                          r"\(\[0.001, 0.0003\]\).*give every param group the same lr$"):
        OnlineProbe(torch.nn.ParameterList([w1, w2]), opt, None, lambda step: None, every=1)
    opt.param_groups[1]["lr"] = 1e-3
    probe = OnlineProbe(torch.nn.ParameterList([w1, w2]), opt, None, lambda step: None, every=1)
    opt.param_groups[1]["lr"] = 5e-4
    with pytest.raises(ConfigError, match=r"^before_step\(3\): the optimizer's param groups have different lrs"):
        probe.before_step(3)


def test_trl_callback_takes_a_failed_steps_factor_off_at_the_next_train(monkeypatch):
    """In TRL an exception in ``optimizer.step()`` leaves ``trainer.train()`` before
    ``on_optimizer_step``; the trainer keeps its optimizer, so the next ``train()`` would have started
    from the guard's lr as if it were the scheduler's. ``on_train_begin`` puts it back first."""
    from types import SimpleNamespace

    from entprobe.integrations.trl import EntropyProbeCallback

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    probe = _StubProbe(opt)
    monkeypatch.setattr(EntropyProbeCallback, "on_train_begin", lambda self, *a, **k: None)  # keeps self.probe
    cb = object.__new__(EntropyGuardCallback)
    cb.probe, cb.guard_kwargs = probe, {"max_decay": 0.1}
    cb.guard = G.EntropyGuard(probe, max_decay=0.1)
    cb.guard.before_step(1)  # then optimizer.step() raised out of trainer.train()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    cb.on_train_begin(None, SimpleNamespace(global_step=0, stateful_callbacks={}, is_world_process_zero=True), None)
    assert opt.param_groups[0]["lr"] == 0.1 and cb.guard.factor == 1.0
