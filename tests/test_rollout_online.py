"""``source="rollouts"`` in training (built-in model): ``OnlineProbe`` in entprobe's own trainer
(``python -m entprobe.train --probe-source rollouts``) and ``EntropyProbeCallback(source="rollouts")``
in TRL's GRPOTrainer. The trajectory is unchanged; the probe reads the step's own batch and the
trainer's loss (checked against ``.grad``); in token_mean units its H is the entropy TRL logs for
the same step; what it cannot probe is refused with what to do.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import rollout_loop_parts
from entprobe.config import ConfigError
from entprobe.integrations import OnlineProbe
from entprobe.integrations.grpo_trainer import TrainArgs, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _run(tmp_path, name: str, **kw) -> list[dict]:
    hist = []
    train(TrainArgs(out=str(tmp_path / name), steps=3, save_every=3, B=8, **kw), log=lambda line: None,
          on_step=hist.append)
    return hist


def test_entprobe_train_with_rollouts_leaves_the_trajectory_alone(tmp_path):
    """Three steps with and without the probe (clipped at the default max_grad_norm 1.0, both
    losses): every logged number of the training is the same, the probed steps log the prediction;
    with --probe-B-E 0 nothing is measured."""
    for loss in ("dr_grpo", "grpo"):
        plain = _run(tmp_path, f"plain-{loss}", loss=loss)
        probed = _run(tmp_path, f"probed-{loss}", loss=loss, probe_every=1, probe_source="rollouts", probe_B_E=0)
        keys = ("loss", "reward", "entropy", "grad_norm")
        assert [[h[k] for k in keys] for h in plain] == [[h[k] for k in keys] for h in probed]
        logged = [h for h in probed if "entprobe/deltaH_pred" in h]
        assert [h["step"] for h in logged] == [1, 2, 3]  # step 1 too: AdamW's first step has a closed form
        for h in logged:
            assert math.isfinite(h["entprobe/deltaH_pred"]) and h["entprobe/SE_deltaH_pred"] > 0
            assert "entprobe/deltaH_true" not in h  # nothing measured


def test_refusals_say_what_to_do():
    model, tok, task, opt, step_batch = rollout_loop_parts()
    with pytest.raises(ConfigError, match="source='bogus': one of held_out, rollouts"):
        OnlineProbe(model, opt, tok, task, source="bogus")
    with pytest.raises(TypeError, match="None only with source='rollouts'"):
        OnlineProbe(model, opt, tok, None)
    probe = OnlineProbe(model, opt, tok, None, every=1, source="rollouts")
    batch = step_batch(1)
    with pytest.raises(TypeError, match="pass rollouts="):
        probe.before_step(2)
    # the loss was entprobe's dr_grpo (A / (G Lmax)); a probe told it is TRL's luspo (A / G) finds another
    wrong = OnlineProbe(model, opt, tok, None, every=1, source="rollouts", objective="trl",
                        **{"objective.loss_type": "luspo"})
    with pytest.raises(ConfigError, match="is not the objective trl/luspo's on the batch"):
        wrong.before_step(2, rollouts=batch)
    # clipped without telling the probe: the gradient is the objective's times the clip coefficient
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    assert norm > 1e-3
    with pytest.raises(ConfigError, match="objective's times .*clipped"):
        probe.before_step(2, rollouts=batch)
    clipping = OnlineProbe(model, opt, tok, None, every=1, source="rollouts", max_grad_norm=1e-3)
    with pytest.raises(ConfigError, match="pass grad_norm="):
        clipping.before_step(2, rollouts=batch)
    assert clipping.before_step(2, rollouts=batch, grad_norm=norm)
    r = clipping._pending.res
    assert r["rollouts/clip_coef"] == pytest.approx(1e-3 / (norm + 1e-6), rel=1e-12)
    # fp32 gradients summed per prompt instead of by the loss's one backward: rounding of a few eps
    # per coordinate, far below the 5% that refuses
    assert r["rollouts/grad_residual"] < 1e3 * torch.finfo(torch.float32).eps
    with pytest.raises(ConfigError, match="probe.block_size: does not apply"):
        OnlineProbe(model, opt, tok, None, source="rollouts", probe={"block_size": 2})


def test_trl_callback_reads_the_step_s_batch_and_its_entropy_is_trl_s(tmp_path):
    """The callback with source="rollouts" in token_mean units: the probe's H at each probed step is
    the ``entropy`` TRL logs for that step (the same batch at the same parameters: fp32 sums of ~100
    token entropies), the gradient it rebuilds from the batch is the trainer's (clipped: TRL's
    max_grad_norm 1.0), and the trajectory is the unprobed one. After the first probe token_mean's
    constant is TRL's logged entropy (``KAPPA_AGREES``), with no forward of the probe's own for it."""
    pytest.importorskip("trl")
    from grpo_setup import build_trainer

    from entprobe.integrations import EntropyProbeCallback

    def run(probe: bool):
        tr = build_trainer(str(tmp_path), 4, prompts_per_step=8)
        cb = EntropyProbeCallback(tr, every_n_steps=1, source="rollouts", probe={"weighting_mode": "token_mean"}) \
            if probe else None
        if cb:
            tr.add_callback(cb)
        tr.train()
        return tr, cb
    plain, _ = run(False)
    tr, cb = run(True)
    for a, b in zip(plain.model.parameters(), tr.model.parameters()):
        assert torch.equal(a, b)
    logged = {h["step"]: h for h in tr.state.log_history if "entropy" in h}
    assert [r["step"] for r in cb.history] == [1, 2, 3, 4]  # step 1 too: AdamW's first step is probed
    for r in cb.history:
        tol = 256 * torch.finfo(torch.float32).eps * logged[r["step"]]["entropy"]
        assert abs(r["H_orig"] - logged[r["step"]]["entropy"]) <= tol, (r["H_orig"], logged[r["step"]]["entropy"])
        assert r["rollouts/grad_residual"] < 1e3 * torch.finfo(torch.float32).eps and r["rollouts/B"] == 8
        assert logged[r["step"]]["entprobe/deltaH_pred"] == r["deltaH_pred"]
    assert any(r["rollouts/clip_coef"] < 1 for r in cb.history)
    # token_mean's constant: the first probe's own forward agrees with TRL's logged entropy, so later ones
    # take TRL's value and run no forward of their own for it
    first, later = cb.history[0], cb.history[1:]
    assert "time/x_constants_s" in first and all("time/x_constants_s" not in r for r in later)
    assert all(r["rollouts/kappa"] == logged[r["step"]]["entropy"] for r in later)
    assert not hasattr(tr, "__dict__") or "_generate_and_score_completions" not in tr.__dict__  # put back


def test_docs_snippets_run(tmp_path):
    """docs/rollouts.md's two ```python blocks, verbatim: the plain loop (3 steps, the built-in model,
    its DR-GRPO loss, clipped at 1.0) and the TRL callback (4 steps of GRPOTrainer)."""
    import re

    from entprobe.checkpoints.default_checkpoint import policy_loss, trainer_adamw
    from entprobe.config import SamplingConfig
    from entprobe.integrations.grpo_trainer import load_policy, load_task
    from entprobe.rollouts.sampling import draw_prompt_indices, sample_batch

    text = (Path(__file__).resolve().parents[1] / "docs" / "rollouts.md").read_text()
    loop, trl_cb = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    model, tokenizer = load_policy(TrainArgs(out=""))
    ns = {"model": model, "tokenizer": tokenizer, "optimizer": trainer_adamw(model, 1e-3, 0.01), "num_steps": 3,
          "task": load_task(TrainArgs(out="")), "sampling": SamplingConfig(max_new_tokens=4), "torch": torch,
          "sample_batch": sample_batch, "draw_prompt_indices": draw_prompt_indices, "policy_loss": policy_loss}
    exec(loop.replace("every=10", "every=1"), ns)
    assert [r["step"] for r in ns["probe"].history] == [1, 2, 3]
    assert all(math.isfinite(r["forecast_H_k10"]) for r in ns["probe"].history)
    pytest.importorskip("trl")
    from grpo_setup import trainer_parts

    p = trainer_parts(str(tmp_path), 4, prompts_per_step=4)
    ns = {"model": p["model"], "reward_fn": p["reward_fn"], "grpo_config": p["grpo_config"],
          "tokenizer": p["tokenizer"], "dataset": p["dataset"]}
    exec(trl_cb.replace("every_n_steps=10", "every_n_steps=2"), ns)
    logged = [h for h in ns["trainer"].state.log_history if "entprobe/deltaH_pred" in h]
    assert [h["step"] for h in logged] == [2, 4] and all("entprobe/forecast_H_k5" in h for h in logged)


@pytest.mark.parametrize("loss_type,scale_rewards", [("dapo", "group"), ("grpo", "batch"), ("bnpo", "none")])
def test_trl_losses_that_couple_the_prompts_are_split_as_the_trainer_computes_them(tmp_path, loss_type, scale_rewards):
    """TRL's default loss (dapo: a token mean over the whole batch), a batch reward std and bnpo: the
    gradient the probe rebuilds from the batch, its rewards and the objective's weights is the
    trainer's to fp32 rounding (2e-7 measured), so the coupled objectives' per-prompt split holds."""
    pytest.importorskip("trl")
    from grpo_setup import trainer_parts
    from trl import GRPOTrainer

    from entprobe.integrations import EntropyProbeCallback

    p = trainer_parts(str(tmp_path), 3, prompts_per_step=8)
    p["grpo_config"].loss_type, p["grpo_config"].scale_rewards = loss_type, scale_rewards
    tr = GRPOTrainer(model=p["model"], reward_funcs=p["reward_fn"], args=p["grpo_config"],
                     processing_class=p["tokenizer"], train_dataset=p["dataset"])
    cb = EntropyProbeCallback(tr, every_n_steps=1, source="rollouts")
    tr.add_callback(cb)
    tr.train()
    assert [r["step"] for r in cb.history] == [1, 2, 3]
    for r in cb.history:
        assert r["rollouts/grad_residual"] < 1e3 * torch.finfo(torch.float32).eps
        assert math.isfinite(r["deltaH_pred"]) and r["SE_deltaH_pred"] > 0
    assert cb.probe._ctx.objective.coupled  # the token mean or the batch std couples the prompts
