"""The objective presets' math (objectives.py) and configuration: per-unit weights, the
linearised per-unit influences of batch-coupled normalisers (their variance is the delta-method
variance of Ybar, checked by simulation), the config's refusals, and a run with each preset."""
from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from entprobe.math import estimators as est
from entprobe.rollouts import objectives as ob
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run, to_typed


def test_unit_weights_by_hand():
    A = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    L = torch.tensor([[2, 4], [1, 3]])
    Lmax = L.amax(-1)
    torch.testing.assert_close(ob.unit_weights("group_lmax", A, L, Lmax), est.y_unit_coeffs(A, Lmax))
    torch.testing.assert_close(ob.unit_weights("seq_token_mean", A, L, Lmax),
                               torch.tensor([[1 / 4, -1 / 8], [1 / 4, -1 / 12]]))
    torch.testing.assert_close(ob.unit_weights("seq_constant", A, L, Lmax, constant=5.0), A / 10)
    torch.testing.assert_close(ob.unit_weights("seq_token_sum", A, L, Lmax, factor=0.2), 0.2 * A / 2)
    # token_mean: Tbar = 10 / 2 = 5; the mean over units of sum_g w S is sum A S / T
    obj = ob.bind(ob_cfg("trl", loss_type="dapo", scale_rewards="none"), torch.zeros(2, 2), L, 8)
    assert obj.aggregation == "token_mean" and obj.constant == 5.0
    S = torch.randn(2, 2, dtype=torch.float64)
    assert float(obj.y_loss(S, A.double(), L, Lmax)) / 2 == pytest.approx(float((A.double() * S).sum() / 10))
    torch.testing.assert_close(obj.coupling, torch.tensor([6 / 5 - 1, 4 / 5 - 1], dtype=torch.float64))


def ob_cfg(preset, **kw):
    from entprobe.config import ObjectiveConfig, ObjectivePreset
    base = {"trl": dict(max_completion_length=None, beta=0.0, num_iterations=1, epsilon=0.2),
            "verl": dict(norm_adv_by_std_in_grpo=True)}.get(preset, {})
    return ObjectiveConfig(preset=ObjectivePreset(preset), **{**base, **kw})


def test_entprobe_preset_is_the_seeds_dr_grpo_exactly():
    obj = ob.ENTPROBE
    A, L = torch.randn(3, 4), torch.randint(1, 6, (3, 4))
    S = torch.randn(3, 4)
    assert torch.equal(obj.y_loss(S, A, L, L.amax(-1)), est.y_loss(S, A, L.amax(-1)))
    assert torch.equal(obj.effective_advantages(A, L, L.amax(-1)), A)
    b = torch.randn(3, 2)
    assert obj.linearize(b) is b and not obj.coupled


def _draws(n_draws: int, B: int, G: int, gen: torch.Generator, noise: float):
    """Independent batches: rewards (each prompt its own success rate), lengths (each prompt its
    own scale, independent of the rewards) and one scalar 'gradient' per response (z, aligned with
    the reward, so Ybar is far from 0 and the normalisers' noise matters)."""
    p = 0.05 + 0.9 * torch.rand((n_draws, B, 1), generator=gen)
    r = torch.bernoulli(p.expand(n_draws, B, G), generator=gen)
    z = noise * torch.randn((n_draws, B, G), generator=gen, dtype=torch.float64) + 2 * r
    scale = 1 + 7 * torch.rand((n_draws, B, 1), generator=gen)
    L = 1 + torch.poisson(scale.expand(n_draws, B, G), generator=gen)
    return r, z, L


@pytest.mark.parametrize("loss_type,scale", [("dapo", "none"), ("dr_grpo", "batch"), ("dapo", "batch")])
def test_linearised_units_give_the_delta_method_variance(loss_type, scale):
    """Y is a scalar per response here (z stands for grad S projected on a direction), so Ybar and
    the unit projections b_n are numbers. Over 4000 independent batches of B = 32 prompts (the
    'true' variance has a Monte-Carlo error of ~2%), the mean of Var(mean of the linearised b_n)
    is within 6% of the variance of Ybar, and closer than half the naive (unlinearised) one's
    error, which is > 3% (the token normaliser: ~20%; the batch reward std alone: ~4%)."""
    gen = torch.Generator().manual_seed(0)
    n_draws, B, G = 4000, 32, 4
    r, z, L = _draws(n_draws, B, G, gen, noise=0.3 if loss_type == "dapo" else 0.05)
    ybar, v_lin, v_naive = [], [], []
    ocfg = ob_cfg("trl", loss_type=loss_type, scale_rewards=scale)
    for i in range(n_draws):
        A = ob.trl_advantages(r[i], scale).double()
        obj = ob.bind(ocfg, r[i], L[i], 8)
        b = (obj.unit_weights(A, L[i], L[i].amax(-1)) * z[i]).sum(-1)  # b_n = Y_n (a number)
        ybar.append(float(b.mean()))
        v_naive.append(est.mean_variance(b))
        v_lin.append(est.mean_variance(obj.linearize(b)))
        assert float(obj.linearize(b).mean()) == pytest.approx(float(b.mean()), rel=1e-9, abs=1e-12)
    true = float(torch.tensor(ybar).var())
    lin, naive = float(torch.tensor(v_lin).mean()), float(torch.tensor(v_naive).mean())
    err_lin, err_naive = abs(lin / true - 1), abs(naive / true - 1)
    assert err_lin < 0.06 and err_naive > 0.03 and err_lin < err_naive / 2, (lin, naive, true)


def test_trl_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    c = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ob.trl_advantages(r, "none"), c)
    torch.testing.assert_close(ob.trl_advantages(r, "group"), c / (r.std(-1, keepdim=True) + 1e-4))
    torch.testing.assert_close(ob.trl_advantages(r, "batch"), c / (r.std() + 1e-4))
    torch.testing.assert_close(ob.verl_advantages(r, True), c / (r.std(-1, keepdim=True) + 1e-6))
    assert ob.scale_rewards_choice(True) == "group" and ob.scale_rewards_choice(False) == "none"


@pytest.mark.parametrize("overrides,key", [
    (("objective=trl", "objective.beta=0.04"), "objective.beta"),
    (("objective=trl", "objective.num_iterations=2"), "objective.num_iterations"),
    (("objective=trl", "objective.loss_type=ppo"), "objective.loss_type"),
    (("objective=trl", "objective.scale_rewards=std"), "objective.scale_rewards"),
    (("objective=trl", "+objective.loss_agg_mode=token-mean"), "objective.loss_agg_mode"),
    (("objective=verl", "objective.loss_agg_mode=token_mean"), "objective.loss_agg_mode"),
    (("objective=trl", "batch.advantage=grpo"), "batch.advantage"),
    (("objective=trl", "probe.mode=single_batch"), "probe.mode"),
    (("objective=verl", "probe.mode=single_batch"), "probe.mode"),
])
def test_objective_config_refusals_name_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_typed(compose_cfg(tmp_path, *overrides))


def test_bool_scale_rewards_and_per_sequence_single_batch_are_accepted(tmp_path):
    cfg = to_typed(compose_cfg(tmp_path, "objective=trl", "objective.scale_rewards=false",
                               "objective.loss_type=grpo", "probe.mode=single_batch"))
    assert ob.scale_rewards_choice(cfg.objective.scale_rewards) == "none"
    assert not ob.is_coupled(cfg.objective)


@pytest.mark.parametrize("overrides,name", [
    (("objective=trl", "objective.scale_rewards=batch", "objective.loss_type=grpo"), "trl/grpo"),
    (("objective=trl",), "trl/dapo"),  # token-mean: linearised V_Y
    (("objective=verl", "objective.loss_agg_mode=seq-mean-token-sum-norm"), "verl/seq-mean-token-sum-norm"),
])
def test_run_with_a_preset(tmp_path, overrides, name):
    """The whole job under a preset: the reused probe gradient is the preset's (deltaH1_step equals
    the prediction), the step is not entprobe's, and every SE is finite."""
    res = run(compose_cfg(tmp_path, *overrides))
    assert res["objective"] == name
    base = run(compose_cfg(tmp_path / "base"))
    assert res["deltaH1_step"] == pytest.approx(res["deltaH_pred"], rel=1e-4, abs=1e-9)
    assert res["deltaH1_step"] != pytest.approx(base["deltaH1_step"], rel=1e-3)
    for k in ("SE_deltaH_pred", "SE_deltaH1", "V_Y", "deltaH_cov", "deltaH_true"):
        assert res[k] == res[k] and abs(res[k]) < float("inf"), k


def test_documented_trl_command_runs_verbatim(tmp_path):
    """README and docs/objectives.md: ``python -m entprobe.main objective=trl objective.loss_type=dr_grpo``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    cmd = "python -m entprobe.main objective=trl objective.loss_type=dr_grpo"
    proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = Path(tmp_path).glob("outputs/*/*")
    res = json.loads((run_dir / "results.json").read_text())
    assert res["objective"] == "trl/dr_grpo" and res["SE_deltaH_pred"] > 0
