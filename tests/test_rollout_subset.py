"""``probe.rollouts_prompts = k``: X and Y on k of the step's B prompts, each against the update of all
the others (math/rollout_subset.py), against exact enumeration on the policy of tests/exact_model.py
(the setup of test_rollout_coverage.py: AdamW's state from 20 real steps, lr 1e-5, token_mean).
The target of ``deltaH_pred`` and ``ci95_pred`` is the step taken's first-order change ``grad H .
Delta theta``; that of ``ci95_pred_expected`` the mean over batches of that change (a fresh step's).

Measured at B = 8, G = 4, k = 4 over 160 batches: ``ci95_pred`` covers the step's change as the full
statistic's does, and the expected step's SE is 1.14 times the spread of ``deltaH_pred`` over the
batches (the full statistic's jackknife: 1.11), so ``ci95_pred_expected`` covers the mean change in
99.4% of them (the full statistic's: 99.4%).
"""
from __future__ import annotations

import math

import pytest
import torch

from entprobe.config import ConfigError
from entprobe.math import estimators as est
from entprobe.math import rollout_subset as rs
from entprobe.math.rollout_ustat import KernelTerms
from test_rollout_coverage import _draws


@pytest.mark.slow
def test_subset_of_4_of_8_is_unbiased_and_covered():
    """160 batches of B = 8 x G = 4, k = 4 probed: ``deltaH_pred`` minus the step's change has mean 0
    (|z| < 3), ``ci95_pred`` holds it in 92-98.5% of batches (binomial SE 1.7%), and
    the expected step's SE is 0.85-1.35 times the spread of ``deltaH_pred`` over batches, its interval
    holding the mean change (its own SE under a tenth of the SE) in >= 92%."""
    _, _, t = _draws(8, 4, 160, **{"probe.rollouts_prompts": 4})
    U, lo, hi, T, elo, ehi = t.T
    err = U - T
    z = float(err.mean() / (err.std() / math.sqrt(err.numel())))
    assert abs(z) < 3, z
    cover = float(((lo <= T) & (T <= hi)).double().mean())
    assert 0.92 <= cover <= 0.985, cover
    # the expected step's SE against the spread of deltaH_pred over batches (both sides): measured 1.14,
    # the full statistic's jackknife 1.11 on the same batches (both a little conservative here)
    se_e = (ehi - elo) / (2 * est.t_quantile(3))
    ratio = float(se_e.pow(2).mean().sqrt() / U.std())
    assert 0.85 <= ratio <= 1.35, ratio
    mean_T = float(T.mean())
    assert float(T.std()) / math.sqrt(T.numel()) < 0.1 * float(se_e.median())
    cover_e = float(((elo <= mean_T) & (mean_T <= ehi)).double().mean())
    assert cover_e >= 0.92, cover_e


def test_subset_standard_errors_reduce_to_the_moments_they_state():
    """``subset_errors`` on hand-made terms: the step's SE is sd(t)/sqrt(k) (plus the pair term rescaled
    by (k - 1)^2 / (B - 1)^2), the expected step's ``Var(t)/k + Var(u)/B + 2 Cov(t, u)/B`` with u = -b;
    the rows' jackknife is Var(w)/k; and at k = B the expected step's variance is Var(t + u)/B."""
    from entprobe.math.ustat import row_statistics

    gen = torch.Generator().manual_seed(0)
    t, b = torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    kt = KernelTerms(torch.zeros(5, dtype=torch.float64), b, torch.zeros(5, dtype=torch.float64))
    cp = rs.subset_cross_prompt(-t, kt, B=20)
    assert cp.U == pytest.approx(float(t.mean()), rel=1e-12)
    se = rs.subset_errors(cp, kt, 20, pair_var_k=0.3)
    u = -b
    cov = float(((t - t.mean()) * (u - u.mean())).sum()) / 4
    assert se["SE_step"] ** 2 == pytest.approx(float(t.var()) / 5 + 0.3 * 16 / 361, rel=1e-12)
    assert se["SE_expected"] ** 2 == pytest.approx(float(t.var()) / 5 + float(u.var()) / 20 + 2 * cov / 20, rel=1e-12)
    w = t + math.sqrt(5 / 20) * u
    assert row_statistics(cp.U, cp.rows)[3] ** 2 == pytest.approx(float(w.var()) / 5, rel=1e-12)
    full = rs.subset_errors(rs.subset_cross_prompt(-t, kt, B=5), kt, 5)
    assert full["SE_expected"] ** 2 == pytest.approx(float((t + u).var()) / 5, rel=1e-12)


def test_draw_subset_is_the_seeds_and_not_the_batchs():
    a = rs.draw_subset(16, 4, 123)
    assert a == rs.draw_subset(16, 4, 123) and a == sorted(a) and len(set(a)) == 4
    assert any(rs.draw_subset(16, 4, s) != a for s in range(124, 130))
    with pytest.raises(ValueError):
        rs.draw_subset(4, 5, 0)


def test_first_probe_takes_every_prompt_then_the_subset(tmp_path):
    """The objective is checked against ``.grad`` on a whole batch first (``rollouts/grad_residual``);
    later probes take k prompts (``rollouts/probed``) and report no residual."""
    import warnings

    from entprobe.checkpoints.default_checkpoint import policy_loss
    from entprobe.integrations import OnlineProbe
    from exact_model import MAX_NEW, adamw_with_state, make_setup

    setup = make_setup(seed=1)
    opt = adamw_with_state(setup)
    probe = OnlineProbe(setup.model, opt, setup.tokenizer, None, every=1, source="rollouts",
                        **{"sampling.max_new_tokens": MAX_NEW, "logging.progress": False, "probe.rollouts_prompts": 3})
    seen = []
    for s in range(2):
        batch = setup.sample(6, 4, seed=50 + s)
        opt.zero_grad(set_to_none=True)
        policy_loss(setup.model, batch, "dr_grpo").backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert probe.before_step(3 + s, rollouts=batch)
        r = probe._pending.res
        seen.append((r["rollouts/probed"], r["rollouts/grad_residual"], r["B_E"]))
        probe._pending = None
    assert seen[0][0] == 6 and seen[0][1] is not None
    assert seen[1] == (3, None, 3)


@pytest.mark.parametrize("bad", [2, 0, -1, 2.5, "four"])
def test_rollouts_prompts_below_3_is_refused(bad):
    from entprobe.integrations.online_config import online_config

    with pytest.raises(ConfigError, match="probe.rollouts_prompts"):
        online_config({"probe.rollouts_prompts": bad}, source="rollouts")


def test_rollouts_prompts_is_for_source_rollouts():
    from entprobe.integrations.online_config import online_config

    with pytest.raises(ConfigError, match="probe.rollouts_prompts"):
        online_config({"probe.rollouts_prompts": 4}, source="held_out")


def test_rollouts_prompts_is_refused_by_the_command_lines_job():
    """The job and ``entprobe.probe`` probe their own E and U: the key is refused (preflight, before any
    model loads; ``probe_batches`` too), with what to do."""
    from entprobe.config import check_offline
    from entprobe.integrations.online_config import online_config

    cfg = online_config({"probe.rollouts_prompts": 4}, source="rollouts")
    with pytest.raises(ConfigError, match="probe.rollouts_prompts=4: applies to the online probe"):
        check_offline(cfg)
    check_offline(online_config({}, source="rollouts"))  # unset: nothing to refuse
