"""``EntropyProbeCallback(..., fused_backward=True)`` (integrations/trl_fused.py) in TRL's GRPOTrainer on
the built-in model: the first probe checks the objective against the trainer's gradient and is not
fused; a later probed step's gradient is the probe's per-prompt Y sum, the same as the trainer's own
backward gives to fp32 rounding, and not added to it (the trainer's backward reaches no parameter);
the probe then runs no pass of its own; where a condition fails the step is not fused."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from entprobe.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
EPS = torch.finfo(torch.float32).eps


def _run(tmp_path, name: str, **kw):
    """A 4-step run (8 prompts x 4, lr 1e-3), the probe every 2 steps, and the gradient the optimizer
    steps on at each step (after clipping, as ``on_pre_optimizer_step`` sees it)."""
    pytest.importorskip("trl")
    from grpo_setup import build_trainer
    from transformers import TrainerCallback

    from entprobe.integrations import EntropyProbeCallback

    class Grads(TrainerCallback):
        def __init__(self):
            self.by_step = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.by_step[state.global_step + 1] = torch.cat([p.grad.detach().flatten().clone()
                                                             for p in model.parameters() if p.requires_grad])
    tr = build_trainer(str(tmp_path / name), 4, prompts_per_step=8)
    cb = EntropyProbeCallback(tr, every_n_steps=2, source="rollouts", **kw)
    grads = Grads()
    tr.add_callback(cb)
    tr.add_callback(grads)  # after the probe's own callback, which puts .grad back as it found it
    tr.train()
    return tr, cb, grads.by_step


def test_a_fused_step_takes_the_trainers_gradient_from_the_probes_passes(tmp_path):
    plain_tr, plain, g_plain = _run(tmp_path, "plain")
    tr, cb, g = _run(tmp_path, "fused", fused_backward=True)
    assert [r.get("rollouts/fused_backward", False) for r in cb.history] == [False, True]
    assert torch.equal(g[1], g_plain[1]) and torch.equal(g[2], g_plain[2])  # before any fused step: the same run
    # step 4, fused: the per-prompt Y sum against the trainer's batched backward at the same parameters and batch,
    # to the rounding of a sum in another order (a few eps; 1.1 eps measured). Had the trainer's backward run as
    # well, the gradient would be twice its value.
    rel = float((g[4] - g_plain[4]).norm() / g_plain[4].norm())
    assert rel <= 64 * EPS, rel
    fused = cb.history[1]
    assert fused["rollouts/grad_residual"] <= 64 * EPS and "time/rollouts_fused_s" in fused
    assert "time/rollouts_units_s" in fused  # the dots, from the passes made in the trainer's step
    # the prediction is the unfused run's, but for AdamW's amplification of rounding-level gradient entries
    ref = plain.history[1]
    assert abs(fused["deltaH_pred"] - ref["deltaH_pred"]) <= 0.01 * ref["SE_deltaH_pred"]
    assert abs(fused["H_orig"] - ref["H_orig"]) <= 64 * EPS * ref["H_orig"]
    assert "compute_loss" not in tr.__dict__  # put back at the end of training


def test_steps_that_cannot_be_fused_are_not(tmp_path):
    """A subset of the prompts probed, or X_n and Y_n that do not fit ``probe.unit_grads_budget_mb``: the
    trainer's backward runs as always."""
    _, cb, _ = _run(tmp_path, "subset", fused_backward=True, probe={"rollouts_prompts": 4})
    assert len(cb.history) == 2 and not any(r.get("rollouts/fused_backward") for r in cb.history)
    _, cb, _ = _run(tmp_path, "budget", fused_backward=True, probe={"unit_grads_budget_mb": 0.1})
    assert len(cb.history) == 2 and not any(r.get("rollouts/fused_backward") for r in cb.history)


def test_fused_backward_needs_the_rollouts_source(tmp_path):
    pytest.importorskip("trl")
    from grpo_setup import build_trainer

    from entprobe.integrations import EntropyProbeCallback

    tr = build_trainer(str(tmp_path), 2, prompts_per_step=4)
    with pytest.raises(ConfigError, match="fused_backward=True: .* use source='rollouts'"):
        EntropyProbeCallback(tr, every_n_steps=2, fused_backward=True)


def test_the_guard_fuses_too(tmp_path):
    """``EntropyGuardCallback(..., fused_backward=True)`` (the guard's rate limit, no bonus knob): its
    second probe is fused, and the guard decides on it as on any other."""
    pytest.importorskip("trl")
    from grpo_setup import build_trainer

    from entprobe.integrations import EntropyGuardCallback

    tr = build_trainer(str(tmp_path), 4, prompts_per_step=8)
    cb = EntropyGuardCallback(tr, every_n_steps=2, source="rollouts", fused_backward=True, guard={"max_decay": 0.05})
    tr.add_callback(cb)
    tr.train()
    assert [r.get("rollouts/fused_backward", False) for r in cb.history] == [False, True]
    assert [d.step for d in cb.decisions] == [2, 4]
