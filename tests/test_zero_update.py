"""An update that is exactly zero (pipeline/stages/zero_update.py): noticed right after the U pass,
it costs no E pass and no real step, and reports every change as 0 exactly with SE 0.

The case: the committed cold batches (every U group has equal rewards, so every advantage and the
gradient are 0; tests/test_cli.py has how they were drawn) probed with AdamW at beta1 = 0 and no
weight decay, whose update of a zero gradient is exactly 0. With the checkpoint's own beta1 the
same zero gradient still moves the weights (momentum): that probe runs in full.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import committed_batches, compose_cfg
from entprobe.cli.probe_job import run
from entprobe.integrations.step_lines import probe_line
from entprobe.math import paramvec as pv
from entprobe.reporting.verdict import flags, verdict_lines

B_E, B_U, G = 8, 8, 4  # the cold batches' sizes
COLD = ("sampling.temperature=0.05", "batch.seed_U=4", *committed_batches("cold"), f"batch.B_E={B_E}",
        f"batch.B_U={B_U}", f"batch.G={G}")
NO_MOMENTUM = ("optimizer.betas=[0.0,0.999]", "optimizer.weight_decay=0.0")  # a zero gradient's update is 0
ZERO_KEYS = ("deltaH_pred", "SE_deltaH_pred", "ci95_pred_low", "ci95_pred_high", "deltaH_pred_gradient",
             "deltaH_pred_momentum", "deltaH_true", "SE_deltaH_true", "ci95_true_low", "ci95_true_high",
             "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred", "norm_PYbar")


def test_two_batch_skips_the_e_pass_and_the_step_of_a_zero_update(tmp_path):
    res = run(compose_cfg(tmp_path / "zero", *COLD, *NO_MOMENTUM, "logging.report=true"))
    assert res["batch_U/frac_zero_var_groups"] == 1.0 and res["update_zero"] is True
    # the U pass alone: one forward and one backward per U response; nothing over E, no step
    assert (res["passes/forward"], res["passes/backward"]) == (B_U * G, B_U * G)
    assert [k for k in res if k.startswith("time/") and k != "time/total_s"] == ["time/accumulate_Y_U_s"]
    # theta_plus = theta: every change is 0 exactly, and so is deltaH1 (P Ybar = 0)
    for k in (*ZERO_KEYS, "deltaH1", "SE_deltaH1", "bars_dot"):
        assert res[k] == 0.0, k
    assert res["pred_consistent"] is True and res["ESS_frac"] == 1.0 and "H_orig" not in res
    assert (res["B_E"], res["B_U"], res["G"]) == (B_E, B_U, G)
    assert res["attr_pred/kind/mlp"] == 0.0 and (tmp_path / "zero" / "attribution.csv").is_file()
    # the verdict says so: the flag, the rows; report.md too
    (flag,) = [msg for code, msg in flags(res) if code == "empty_gradient"]
    assert "the update is exactly zero" in flag and "the E pass and the real step were skipped" in flag
    rows = {row[0]: row for row in verdict_lines(res)}
    assert rows["predicted"][1:] == ("+0 ± 0", "[0, 0]", "the update is exactly zero: nothing moves")
    assert rows["measured"][3].startswith("no step taken") and "0 exactly" in rows["difference"][3]
    assert "the update is exactly zero" in (tmp_path / "zero" / "report.md").read_text()

    # AdamW's momentum (the checkpoint's beta1 0.9): the same zero gradient gives a nonzero update,
    # probed in full (E pass, real step)
    full = run(compose_cfg(tmp_path / "momentum", *COLD))
    assert full["update_zero"] is False and full["deltaH_pred_gradient"] == 0.0 and full["deltaH_pred_momentum"] != 0
    assert full["passes/forward"] > B_U * G + B_E * G and "time/accumulate_X_E_s" in full


def test_single_batch_skips_the_unit_pass_the_held_out_e_and_the_step(tmp_path):
    """single_batch: every advantage is 0, so each unit's Y_u is 0 too: after pass 1 (one forward,
    the X and the Y backward per response) nothing else runs; the U-statistic is 0 exactly."""
    res = run(compose_cfg(tmp_path, *COLD, *NO_MOMENTUM, "probe.mode=single_batch"))
    assert res["update_zero"] is True
    # token_mean (the default) needs its constants (sum H / sum L) before the X backward: the cold
    # batches were saved without the sampler's entropies, so one forward without a graph per response
    assert res["entropy_functional"].startswith("token_mean") and "time/x_constants_s" in res
    assert (res["passes/forward"], res["passes/backward"]) == (2 * B_U * G, 2 * B_U * G)
    assert (res["ustat/forward_per_seq"], res["ustat/backward_per_seq"]) == (2.0, 2.0)
    for k in (*ZERO_KEYS, "U_cross", "SE_jack", "SE_plugin", "deltaH1", "SE_deltaH1"):
        assert res[k] == 0.0, k
    assert res["pred_consistent"] is True


def test_is_zero_reads_every_entry_of_either_layout(monkeypatch):
    """``paramvec.is_zero``: one [k, N] matrix or blocks per parameter (``FLAT_MAX_NUMEL``); -0.0 is
    zero, a NaN or any other value anywhere is not."""
    like = [torch.zeros(3, 2), torch.zeros(5)]
    for flat_max in (pv.FLAT_MAX_NUMEL, 0):
        monkeypatch.setattr(pv, "FLAT_MAX_NUMEL", flat_max)
        d = pv.empty_directions(3, like, "cpu", torch.float32)
        assert (d.mat is not None) == (flat_max > 0)
        for col in range(3):
            for t in d.column(col):
                t.zero_()
        d.column(2)[1][4] = -0.0
        assert pv.is_zero(d)
        for bad in (1e-45, float("nan")):
            d.column(2)[1][4] = bad
            assert not pv.is_zero(d), bad
        d.column(2)[1][4] = 0.0
        d.column(0)[0][2, 1] = -3.0
        assert not pv.is_zero(d)


@pytest.mark.parametrize("z,ok,df,said", [
    (-2.11, True, 7, "consistent: |t| 2.11 < 2.36 (7 df)"),
    (3.10, False, 7, "NOT consistent: |t| 3.10 > 2.36 (7 df)"),
    (2.3, False, 9, "NOT consistent: |t| 2.30 > 2.26 (9 df)"),  # t_9's quantile 2.262: 2.30 lies outside
    (2.3, True, None, "consistent (|t| 2.30)"),  # results without the degrees of freedom (an older run's)
    (float("nan"), True, 7, "consistent")])  # SE 0: no t
def test_the_paired_line_is_the_t_test_with_its_degrees_of_freedom(z, ok, df, said):
    from entprobe.reporting.verdict import paired_test

    r = {"z_true_minus_pred": z, "pred_consistent": ok, **({"df_true_minus_pred": df} if df else {})}
    assert paired_test(r) == said


# ---------------------------------------------------------------- the online probe (source="rollouts")
def _tied_step(make_optimizer, steps_before: int = 0, seed: int = 3):
    """The built-in model and ``make_optimizer(model)`` after ``steps_before`` real steps, and a
    batch of 8 prompts x 4 whose every group is tied (all advantages 0: the DR-GRPO gradient in
    ``.grad`` is exactly 0), plus the same batch with its own advantages (a normal step)."""

    from entprobe.checkpoints.default_checkpoint import policy_loss
    from entprobe.config import SamplingConfig
    from entprobe.integrations.grpo_trainer import TrainArgs, load_policy, load_task
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    model, tok = load_policy(TrainArgs(out=""))
    task = load_task(TrainArgs(out=""))
    opt = make_optimizer(model)

    def batch_at(s):
        return sample_batch(model, tok, task, draw_prompt_indices(len(task.prompts), 8, s), 4,
                            SamplingConfig(max_new_tokens=4), s, "dr_grpo", 1e-6)
    for s in range(steps_before):
        opt.zero_grad()
        policy_loss(model, batch_at(100 + s), "dr_grpo").backward()
        opt.step()
    normal = batch_at(seed)
    assert bool((normal.advantages != 0).any())  # the same prompts' own groups are not all tied
    tied = dataclasses.replace(normal, advantages=torch.zeros_like(normal.advantages))

    def load(batch):  # the batch's gradient into .grad, as the loop has it before optimizer.step()
        opt.zero_grad()
        policy_loss(model, batch, "dr_grpo").backward()
        return batch
    return model, tok, opt, load, normal, tied


def _probe(model, tok, opt, step, batch, between=None):
    from entprobe.integrations import OnlineProbe

    probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
    assert probe.before_step(step, rollouts=batch)
    passes = dict(probe._ctx.stats.passes)
    if between is not None:
        between()
    opt.step()
    return probe, probe.after_step(), passes


@pytest.mark.parametrize("which", ["adamw_first_step", "sgd"])
def test_a_tied_step_with_nothing_carried_is_free_and_says_so(which):
    """Every group tied (gradient exactly 0) and nothing carried (AdamW's first step: m = v = 0; SGD
    without momentum) and no weight decay: the update is exactly 0, so the probe runs no pass at all
    (H from the sampler's records), predicts 0 exactly with SE 0 (``update_zero``, the step line says
    so), and checks that the step left theta as it was; a changed parameter is flagged."""
    make = (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)) if which.startswith("adamw") \
        else (lambda m: torch.optim.SGD(m.parameters(), lr=1e-2))
    model, tok, opt, load, normal, tied = _tied_step(make, steps_before=0 if which.startswith("adamw") else 2)
    theta = [p.detach().clone() for p in model.parameters()]
    load(tied)
    assert all(not p.grad.any() for p in model.parameters())  # the gradient is exactly 0
    probe, m, passes = _probe(model, tok, opt, 1, tied)
    assert passes.get("backward", 0) == 0 and passes.get("forward", 0) == 0  # no pass at all
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), theta))  # the step moved nothing
    h = probe.history[0]
    assert h["update_zero"] is True and h["gradient_zero"] is True
    assert m["entprobe/update_zero"] == 1.0 and m["entprobe/deltaH_pred"] == 0.0 and m["entprobe/SE_deltaH_pred"] == 0.0
    assert h["ci95_pred_low"] == h["ci95_pred_high"] == 0.0 and h["deltaH1_step"] == 0.0
    assert h["step_mismatch"] is False and "pred_consistent" not in h
    # a parameter changed between before_step and optimizer.step(): not the step predicted (the
    # optimizer still carries nothing: its first step moved nothing)
    load(tied)

    def nudge():
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 0.01
    with pytest.warns(UserWarning, match="the update was exactly 0"):
        moved, _, _ = _probe(model, tok, opt, 2, tied, between=nudge)
    assert moved.history[0]["step_mismatch"] is True and moved.history[0]["pred_consistent"] is None
    with torch.no_grad():  # theta back where the batch was sampled
        for p, t in zip(model.parameters(), theta):
            p.copy_(t)
    # a batch without the sampler's records (TRL's): one forward without a graph per response, no backward
    load(tied)
    bare, _, bare_passes = _probe(model, tok, opt, 3, dataclasses.replace(tied, sampler_entropy=None))
    assert bare_passes == {"forward": tied.B * tied.G} and bare.history[0]["update_zero"] is True
    # H: the sampler's token entropies (token_mean), as a full probe's forward finds them on the same
    # batch: fp32 logits of a 4-token response, the two paths' roundings (~1e2 eps32 of H)
    load(normal)
    full, _, full_passes = _probe(model, tok, opt, 4, normal)
    tied_groups = int((normal.advantages == 0).all(-1).sum())  # a prompt of equal rewards takes no Y backward
    assert tied_groups < normal.B and full.history[0].get("update_zero") is None
    assert full_passes["backward"] == (2 * normal.B - tied_groups) * normal.G
    H0, H1 = h["H_rollouts"], full.history[0]["H_rollouts"]
    assert abs(H0 - H1) <= 1e2 * torch.finfo(torch.float32).eps * abs(H1), (H0, H1)
    assert abs(bare.history[0]["H_rollouts"] - H1) <= 1e2 * torch.finfo(torch.float32).eps * abs(H1)
    line = probe_line(1, m, "rollouts", H0)
    assert "predicted 0 exactly from the step's rollouts" in line and "the update is exactly zero" in line


@pytest.mark.parametrize("carried", ["weight_decay", "momentum"])
def test_a_tied_step_that_still_moves_takes_no_y_pass(carried):
    """Every group tied (gradient exactly 0) but something still moves theta: AdamW's first step with
    weight decay (the change is ``-Xbar . (-lr wd theta)``) or AdamW with momentum carried (two steps
    in, no decay). Only X is formed: one forward and one backward per response, no Y backward (a normal
    step: two); the prediction is all the moving part's (the gradient part 0 exactly) and equals the
    first-order change of the step taken, ``deltaH1_step``, within the step check's rounding bound."""
    wd, before = (0.1, 0) if carried == "weight_decay" else (0.0, 2)
    model, tok, opt, load, normal, tied = _tied_step(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=wd), steps_before=before)
    load(tied)
    probe, m, passes = _probe(model, tok, opt, before + 1, tied)
    B, G = tied.B, tied.G
    assert passes["backward"] == B * G and passes["forward"] == B * G  # X alone
    h = probe.history[0]
    assert h["gradient_zero"] is True and h["update_zero"] is False and m["entprobe/gradient_zero"] == 1.0
    assert h["deltaH_pred_gradient"] == 0.0
    other = "momentum" if carried == "weight_decay" else "weight_decay"
    assert h.get(f"deltaH_pred_{other}", 0.0) == 0.0 and h[f"deltaH_pred_{carried}"] != 0.0
    assert h["step_mismatch"] is False
    assert abs(h["deltaH_pred"] - h["deltaH1_step"]) <= h["step_check/tol"], (h["deltaH_pred"], h["deltaH1_step"])
    assert "every group tied: the gradient is 0" in probe_line(1, m, "rollouts", h["H_rollouts"])
