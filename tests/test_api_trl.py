"""The Python API and the command line on a TRL checkpoint (docs/trl.md's run, tests/trl_readme_run.py:
one GRPOTrainer step of the built-in model, TRL's defaults, so ``max_grad_norm=1.0``).

The command line takes the run's settings from the checkpoint's ``training_args.bin``: its loss
(``objective=trl``, ``loss_type``, ...), its sampling and its gradient clipping
(``importance.max_grad_norm``). The API probes the objects it is given and reads no checkpoint
folder, so it takes them as overrides (its docstring says so); given them, on the same batches it
gives the command line's numbers bit for bit (the same passes over the same inputs in the same
order: no rounding to allow for). Without ``max_grad_norm`` it predicts the unclipped step, which
is another step (the clipping binds here).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

import entprobe  # noqa: E402
from conftest import compose_cfg  # noqa: E402
from entprobe.checkpoints.models import load_model  # noqa: E402
from entprobe.checkpoints.optim_state import load_optimizer  # noqa: E402
from entprobe.checkpoints.preflight import check_inputs  # noqa: E402
from entprobe.checkpoints.trainer_args import checkpoint_settings  # noqa: E402
from entprobe.cli.probe_job import run, to_typed  # noqa: E402
from entprobe.rollouts.saved_batches import load_batches  # noqa: E402

# docs/trl.md's probe command (tests/test_trl_inputs.py runs it verbatim), as overrides
README_COMMAND = ("model=hf", "model.path=outputs/grpo/checkpoint-500", "task=jsonl", "task.path=data/train.jsonl",
                  "task.reward_funcs=[my_rewards:accuracy,my_rewards:brevity]", "batch.B_U=2")
QUIET = {"logging": {"progress": False, "verdict": False, "report": False}}
# what the API takes from its objects instead of a setting (the optimizer's param groups, the batches)
NOT_FOR_THE_API = ("optimizer.", "batch.", "task.")
COMPARED = ("deltaH_pred", "deltaH_pred_gradient", "deltaH_pred_momentum", "SE_deltaH_pred", "SE_deltaH_pred_U",
            "pred/grad_norm", "pred/grad_clip_factor", "deltaH1", "SE_deltaH1", "deltaH_true", "SE_deltaH_true",
            "deltaH1_step", "H_orig")


@pytest.fixture(scope="module")
def trl_checkpoint(tmp_path_factory) -> Path:
    """The folder docs/trl.md's run leaves (my_rewards.py, data/, outputs/grpo/checkpoint-500)."""
    from entprobe.checkpoints.default_checkpoint import ensure_default_checkpoint

    here, folder = Path(__file__).parent, tmp_path_factory.mktemp("trl_run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(here / "trl_readme_run.py"), str(here.parent / "docs" / "trl.md"),
                           str(ensure_default_checkpoint())], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def test_the_api_given_the_runs_settings_equals_the_command_line(trl_checkpoint, monkeypatch):
    monkeypatch.chdir(trl_checkpoint)
    monkeypatch.syspath_prepend(str(trl_checkpoint))  # my_rewards.py
    given = (*README_COMMAND, f"batch.save='{trl_checkpoint / 'batches'}'")
    raw = compose_cfg(trl_checkpoint / "cli", *given)
    cfg = to_typed(raw, explicit=list(given))  # as the command line: training_args.bin read
    cli = run(cfg)
    assert cli["objective"] == "trl/grpo" and cfg.importance.max_grad_norm == 1.0
    assert cli["pred/step_model"] == "adamw_closed_form" and cli["pred/grad_clip_factor"] < 0.5  # clipping binds

    # the run's settings as API overrides: those the file gives that describe the probe, not the
    # objects the API is handed (optimizer.*: its param groups; batch.*: the batches; task.*: E, U)
    _, found, _ = checkpoint_settings(raw, list(given))
    settings = {s.key: s.value for s in found if not s.key.startswith(NOT_FOR_THE_API)}
    assert settings.pop("objective.preset") == "trl" and settings["importance.max_grad_norm"] == 1.0
    lm = load_model(cfg.model)
    opt = load_optimizer(lm.model, check_inputs(cfg).optimizer_state).optimizer
    E, U, _ = load_batches(trl_checkpoint / "batches", 60)
    api = entprobe.probe(lm.model, opt, lm.tokenizer, (E, U), objective="trl", **settings, **QUIET)
    for k in COMPARED:  # bit for bit: the same computation
        assert api[k] == cli[k], (k, api[k], cli[k])

    # Without the run's max_grad_norm the API predicts the unclipped step. On the checkpoint's own
    # state that need not be another number: after one TRL step whose gradient was zero (every
    # reward of its batch equal, as the draw here gives) Adam's moments are zero, and AdamW's update
    # m_hat / sqrt(v_hat) = sign(g) does not see the clipping's scale. So compare on a state whose
    # second moment dominates (exp_avg 0, exp_avg_sq V >> every g_i^2, V = 1e6 |g|^2): the update is
    # then linear in the gradient, and the unclipped prediction is the clipped one over the clip factor.
    c, g2 = cli["pred/grad_clip_factor"], cli["pred/grad_norm"] ** 2
    for state in opt.state.values():
        state["exp_avg"].zero_()
        state["exp_avg_sq"].fill_(1e6 * g2)
    clipped = entprobe.probe(lm.model, opt, lm.tokenizer, (E, U), objective="trl", **settings, **QUIET)
    settings.pop("importance.max_grad_norm")
    free = entprobe.probe(lm.model, opt, lm.tokenizer, (E, U), objective="trl", **settings, **QUIET)
    assert "pred/grad_clip_factor" not in free and clipped["pred/grad_clip_factor"] == c
    # off linear by d c^2 g_i^2 / (2 b V) < 1e-6 (v_hat = b V + d c^2 g^2 at step 2: b ~ 500, d ~ 0.5); the fp32
    # dot over n coordinates rounds by at most n eps(fp32) relative
    n = sum(p.numel() for p in lm.model.parameters() if p.requires_grad)
    tol = n * torch.finfo(torch.float32).eps + 1e-6
    assert free["deltaH_pred"] == pytest.approx(clipped["deltaH_pred"] / c, rel=tol)
    assert abs(free["deltaH_pred"]) > 1.9 * abs(clipped["deltaH_pred"]) > 0  # c < 0.5: another step
