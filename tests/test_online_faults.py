"""The online probe never silently skips or mispredicts (issue 39, "online"): plain SGD and
AdamW's first step are probed; an optimizer whose step is not the closed form is stepped on a
snapshot; a step that differs from the predicted one (parameters or .grad changed after
``before_step``) is flagged ``step_mismatch`` with ``pred_consistent`` None, and an honest step
never is, down to lr 1e-7; bad ``every`` / ``every_n_steps``, unusable rollouts and a frozen
parameter in the optimizer are refused early, naming what to change. Built-in model, CPU."""
from __future__ import annotations

import copy
import dataclasses
import types
import warnings

import pytest
import torch

from entprobe.config import ConfigError
from entprobe.integrations import EntropyProbeCallback, OnlineProbe


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint
    from entprobe.tasks.arithmetic import ArithmeticTask

    folder = ensure_default_checkpoint()
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tok(["12+34=46", "5*6=30"], return_tensors="pt", padding=True).input_ids
    return model, tok, ArithmeticTask(512, 9, seed=0), ids


@pytest.fixture
def model(parts):
    return copy.deepcopy(parts[0])  # each test steps its own copy


def _gradient(model, opt, ids):
    opt.zero_grad()
    model(input_ids=ids).logits.square().mean().backward()


def _probe_steps(parts, model, opt, steps, between=None, **kw) -> OnlineProbe:
    """``steps`` optimizer steps, each probed (every=1, B_E=2), AdamW's first (no state yet) too;
    ``between(step)`` runs after ``before_step`` and before ``optimizer.step()``."""
    _, tok, task, ids = parts
    probe = OnlineProbe(model, opt, tok, task, every=1, batch={"B_E": 2, "G": 2}, **kw)
    for step in range(1, steps + 1):
        _gradient(model, opt, ids)
        assert probe.before_step(step), step
        if between is not None:
            between(step)
        opt.step()
        assert probe.after_step() is not None
    return probe


def _honest(h: dict) -> None:
    assert h["step_mismatch"] is False and abs(h["step_check/diff"]) <= h["step_check/tol"]
    assert "pred_consistent_reason" not in h


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_is_probed_from_its_first_step(parts, model, momentum):
    """SGD keeps no state without momentum: every due step is probed all the same (it was never
    probed: ``due`` waited for optimizer state), with or without momentum (closed form, or the
    snapshot step); the step taken is the predicted one."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=momentum, weight_decay=0.01)
    probe = _probe_steps(parts, model, opt, 2)
    assert [h["step"] for h in probe.history] == [1, 2] and probe.skipped == []
    assert probe.history[0]["pred/step_model"] == ("sgd_closed_form" if momentum == 0 else "optimizer_step")
    for h in probe.history:
        _honest(h)
        assert h["deltaH1_step"] != 0


@pytest.mark.parametrize("lr", [1e-2, 1e-3, 1e-7])
def test_adamw_passes_the_step_check_from_its_first_step(parts, model, lr):
    """AdamW's first step (no state yet: m = v = 0, step 0) is probed like the others (it was
    skipped): its closed form ``-lr g / (|g| + eps) - lr wd theta`` is the step torch takes, so the
    check of the step taken never fires on an honest step, at step 1 and after, at tiny lr too
    (1e-7: theta's rounding, u |theta|, is what the bound holds there); nothing is skipped or warned."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: step 1 is not skipped aloud any more
        probe = _probe_steps(parts, model, opt, 3)
    assert probe.skipped == [] and [h["step"] for h in probe.history] == [1, 2, 3]
    for h in probe.history:
        assert h["pred/step_model"] == "adamw_closed_form"
        _honest(h)
    if lr >= 1e-3:  # where the step is resolved: the bound is far below the step's own dot
        assert all(h["step_check/tol"] < 1e-3 * abs(h["deltaH1_step"]) for h in probe.history)


class TwiceAdamW(torch.optim.AdamW):
    """A subclass whose step is exactly twice AdamW's."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        super().step(closure)
        for p, b in zip(params, before):
            p.add_(p - b)


class SameAdamW(torch.optim.AdamW):
    """A subclass that keeps torch's step."""


def test_a_subclass_with_its_own_step_is_stepped_on_a_snapshot(parts, model):
    """An AdamW subclass that overrides ``step`` is not predicted as AdamW (it was: 0.00701 against
    the 0.01402 it took): it is stepped on a snapshot, and the prediction is of its own step; a
    subclass that keeps torch's step keeps the closed form."""
    probe = _probe_steps(parts, model, TwiceAdamW(model.parameters(), lr=1e-3), 3)
    for h in probe.history:
        assert h["pred/step_model"] == "optimizer_step"
        _honest(h)
    m2 = copy.deepcopy(parts[0])
    probe = _probe_steps(parts, m2, SameAdamW(m2.parameters(), lr=1e-3), 2)
    assert probe.history[0]["pred/step_model"] == "adamw_closed_form"
    _honest(probe.history[0])


def _changed_step(parts, model, change) -> tuple[OnlineProbe, list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = _probe_steps(parts, model, opt, 4, between=lambda step: change(step, model))
    return probe, [w for w in caught if "not the one predicted" in str(w.message)]


def test_parameters_changed_after_the_prediction_are_flagged(parts, model):
    """0.05 added to the embedding between ``before_step`` and ``optimizer.step()`` at steps 3 and 4:
    those steps are flagged (warned once), ``pred_consistent`` is None with the reason; steps 1 and 2 not."""
    def change(step, m):
        if step >= 3:
            with torch.no_grad():
                m.get_input_embeddings().weight.add_(0.05)
    probe, warned = _changed_step(parts, model, change)
    h1, h2, h3, h4 = probe.history
    _honest(h1)
    _honest(h2)
    for h in (h3, h4):
        assert h["step_mismatch"] is True and abs(h["step_check/diff"]) > h["step_check/tol"]
        assert h["pred_consistent"] is None and "not the one predicted" in h["pred_consistent_reason"]
        assert h["step_mismatch_rel"] > 0
    assert len(warned) == 1 and "step 3" in str(warned[0].message)


def test_grad_scaled_after_the_prediction_is_flagged(parts, model):
    """``.grad`` multiplied by 3 after ``before_step`` at step 3 (AdamW with a history: the update
    changes): flagged; the steps on the gradient predicted are not."""
    def change(step, m):
        if step == 3:
            for p in m.parameters():
                p.grad.mul_(3.0)
    probe, warned = _changed_step(parts, model, change)
    h1, h2, h3, h4 = probe.history
    _honest(h1)
    _honest(h2)
    _honest(h4)
    assert h3["step_mismatch"] is True and h3["pred_consistent"] is None and len(warned) == 1


@pytest.mark.parametrize("every", [2.5, "5", True, 0, -1, None])
def test_every_must_be_an_int_of_at_least_1(parts, model, every):
    _, tok, task, _ = parts
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match=rf"^every={every!r}: .*an int >= 1"):
        OnlineProbe(model, opt, tok, task, every=every)


def test_callback_names_every_n_steps():
    with pytest.raises(ConfigError, match=r"^every_n_steps=0: .*an int >= 1"):
        EntropyProbeCallback(types.SimpleNamespace(args=None), every_n_steps=0)


def _rollout_batch(parts, model, B: int):
    from entprobe.config import SamplingConfig
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    _, tok, task, _ = parts
    return sample_batch(model, tok, task, draw_prompt_indices(len(task.prompts), B, 0), 2,
                        SamplingConfig(max_new_tokens=4), 0, "dr_grpo", 1e-6)


def test_unusable_rollouts_are_refused_before_any_pass(parts, model):
    """Advantages of the wrong shape name ``advantages``, the shape given and the one expected (a
    torch size mismatch deep in a pass before); fewer than 3 prompts are refused with the need."""
    _, tok, _, _ = parts
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # probed from step 1
    probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
    batch = _rollout_batch(parts, model, 4)
    bad = dataclasses.replace(batch, advantages=batch.advantages[:, :1])
    with pytest.raises(ValueError, match=r"before_step\(1\): rollouts: advantages has shape \(4, 1\), .* needs \(4, 2\)"):
        probe.before_step(1, rollouts=bad)
    two = _rollout_batch(parts, model, 2)
    with pytest.raises(ValueError, match=r"rollouts has 2 prompt\(s\) x 2 response\(s\); .* needs >= 3 prompts"):
        probe.before_step(1, rollouts=two)


def test_rollouts_without_a_closed_form_are_refused_up_front(parts, model):
    _, tok, _, _ = parts
    for opt in (TwiceAdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)):
        with pytest.raises(ConfigError, match=rf"source='rollouts': the optimizer \({type(opt).__name__}\) has no "
                                              r"closed form.*source='held_out'"):
            OnlineProbe(model, opt, tok, None, source="rollouts")


def test_a_frozen_parameter_in_the_optimizer_is_named(parts, model):
    """A frozen parameter left in the optimizer: refused when the probe is made, naming it, its param
    group, and the fix (it said "pass the model it trains")."""
    _, tok, task, _ = parts
    emb = model.get_input_embeddings().weight
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p is not emb]},
                             {"params": [emb]}], lr=1e-3)
    emb.requires_grad_(False)
    name = next(n for n, p in model.named_parameters() if p is emb)
    with pytest.raises(ConfigError, match=rf"^optimizer param group 1 holds '{name}' \(shape \[.*\]\), which has "
                                          r"requires_grad=False: drop it from the optimizer, or unfreeze it"):
        OnlineProbe(model, opt, tok, task, every=1)
