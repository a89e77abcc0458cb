"""objective=verl against verl's own loss, transcribed.

verl cannot be imported here (it needs ray, tensordict and transformers < 5.11 at import time), so
its formulas are transcribed from verl 0.9.1, ``verl/trainer/ppo/core_algos.py``:
``compute_grpo_outcome_advantage`` (lines 268-331), ``compute_policy_loss_vanilla`` (lines
1286-1390, the PPO loss with dual clipping) and ``agg_loss`` (lines 1140-1206), single data-parallel
rank (``dp_size=1``, ``batch_num_tokens`` / ``global_batch_size`` / ``loss_scale_factor`` None).
For every ``loss_agg_mode`` and ``norm_adv_by_std_in_grpo``, our advantages equal verl's and our
Ybar equals minus the gradient of that loss at ``old_log_prob = log_prob.detach()`` (the first
PPO epoch on a batch).
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from entprobe.config import ObjectiveConfig, ObjectivePreset
from entprobe.rollouts.logprobs import token_logprobs
from entprobe.rollouts.objectives import VERL_LOSS_AGG_MODES, prepare
from entprobe.pipeline.stages.accumulate import accumulate, y_loss_of
from exact_model import MAX_NEW, make_setup


# ---------------------------------------------------------------- verl 0.9.1, transcribed
def masked_sum(values, mask):  # verl/utils/torch_functional.py
    return (values * mask).sum()


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx], id2std[idx] = torch.mean(scores_tensor), torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                cliprange=0.2, clip_ratio_c=3.0):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


# ---------------------------------------------------------------- the check
@pytest.fixture(scope="module")
def setup_and_batch():
    setup = make_setup()
    batch = setup.sample(B=6, G=4, seed=5)
    assert batch.gen_lengths.unique().numel() > 1 and batch.rewards.std() > 0
    return setup, batch


def verl_minus_grad(setup, batch, mode: str, norm_adv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's advantages [B*G] and minus its loss gradient on ``batch``, responses padded to the
    rollout's response length (MAX_NEW: seq-mean-token-sum-norm's default divisor)."""
    ids, att, resp = batch.flat("cpu")
    logp = token_logprobs(setup.model, ids, att, resp).logp  # [N, T], 0 off the response
    P = int(resp.any(0).nonzero()[0])
    pad = MAX_NEW - (ids.shape[1] - P)
    log_prob = torch.nn.functional.pad(logp[:, P:], (0, pad))
    mask = torch.nn.functional.pad(resp[:, P:], (0, pad)).to(log_prob.dtype)
    scores = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    scores[torch.arange(len(last)), last] = batch.rewards.reshape(-1).to(mask.dtype)  # the reward on the last token
    index = torch.arange(batch.B).repeat_interleave(batch.G).tolist()  # a uid per prompt slot, as verl's
    adv, _ = compute_grpo_outcome_advantage(scores, mask, index, norm_adv_by_std_in_grpo=norm_adv)
    loss = compute_policy_loss_vanilla(log_prob.detach(), log_prob, adv, mask, mode)
    grads = torch.autograd.grad(loss, setup.params)
    return adv[:, 0], -torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("norm_adv", [True, False])
@pytest.mark.parametrize("mode", list(VERL_LOSS_AGG_MODES))
def test_ybar_is_minus_the_gradient_of_verls_loss(setup_and_batch, mode, norm_adv):
    setup, batch = setup_and_batch
    ocfg = ObjectiveConfig(preset=ObjectivePreset.verl, loss_agg_mode=mode, norm_adv_by_std_in_grpo=norm_adv)
    U, objective = prepare(ocfg, batch, MAX_NEW)
    ctx = setup.ctx()
    ctx.objective = objective
    ours = torch.cat([b.reshape(-1) for b in accumulate(ctx, U, y_loss_of(ctx), "Y over U").sum_buf]) / U.B
    adv, theirs = verl_minus_grad(setup, batch, mode, norm_adv)
    torch.testing.assert_close(U.advantages.reshape(-1).double(), adv.double(), rtol=1e-6, atol=1e-7)
    assert theirs.norm() > 0
    rel = float((ours - theirs).norm() / theirs.norm())
    # 1e-6: seq-mean-token-mean divides by L + 1e-8 (relative 1e-8 / L; the probe by L)
    assert rel < 1e-6, f"{mode} (norm_adv_by_std_in_grpo={norm_adv}): relative error {rel:.2e}"


def test_agg_modes_are_told_apart(setup_and_batch):
    """The check has the power to fail: the five aggregations give different gradients here."""
    setup, batch = setup_and_batch
    grads = [verl_minus_grad(setup, batch, mode, True)[1] for mode in VERL_LOSS_AGG_MODES]
    for i in range(len(grads)):
        for j in range(i):
            cos = float(grads[i] @ grads[j] / (grads[i].norm() * grads[j].norm()))
            assert cos < 1 - 1e-6 or abs(float(grads[i].norm() / grads[j].norm()) - 1) > 1e-3
