"""Teacher-forced log-probs against the sampler, against another padding layout, and the token
entropy against a brute-force sum, on the built-in checkpoint in fp32."""
from __future__ import annotations

import pytest
import torch

from entprobe.config import ModelConfig, SamplingConfig
from entprobe.rollouts.logprobs import position_ids_from_mask, token_logprobs
from entprobe.checkpoints.models import load_model
from entprobe.rollouts.sampling import RolloutBatch, sample_batch
from entprobe.tasks.base import Prompt
from conftest import fp_tol


# A token's log-prob z_t / T - logsumexp(z / T) (and its entropy) is a function of the N parameters
# through the network's sums, on the scale of its logits: two fp32 computations of it (another
# padding layout, the sampler's incremental forward with a KV cache, fp64 after the logits) differ
# by ``fp_tol(fp32, max_v |z_v| / T + |logsumexp(z / T)|, N)`` (conftest.py). A token scored at the
# wrong position, or a wrong temperature, moves it by 1e-2 of that scale or more.
def logprob_tol(lm, ids, att, temperature: float = 1.0) -> torch.Tensor:
    """[rows, positions] the bound above for the token at each position (logits of the one before)."""
    with torch.no_grad():
        z = lm.model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).logits.double()
    z = z / temperature
    scale = z.abs().amax(-1) + torch.logsumexp(z, -1).abs()
    N = sum(p.numel() for p in lm.model.parameters())
    shifted = torch.cat([scale.new_zeros(scale.shape[0], 1), scale[:, :-1]], 1)  # token k from logits k - 1
    return fp_tol(torch.float32, 1.0, N) * shifted


class MixedLengthTask:
    """Prompts of 3 to 8 characters, so the sampler's left padding is exercised."""

    def __init__(self):
        self.prompts = [Prompt(t, a) for t, a in (("3+4=", "7"), ("12+30=", "42"), ("9=", "9"),
                                                   ("5*6 +1=", "31"), ("8-2=", "6"), ("7+7+7 =", "21"))]

    def reward(self, response: str, prompt: Prompt) -> float:
        return float(response.startswith(prompt.answer))


@pytest.fixture(scope="module")
def lm():
    return load_model(ModelConfig(device="cpu"))


def sample(lm, temperature: float, seed: int = 3) -> RolloutBatch:
    s = SamplingConfig(temperature=temperature, max_new_tokens=6)
    idx = torch.arange(len(MixedLengthTask().prompts))
    return sample_batch(lm.model, lm.tokenizer, MixedLengthTask(), idx, 4, s, seed, "dr_grpo", 1e-6,
                        chat_template="never")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_forced_logprobs_match_the_sampler(lm, temperature):
    batch = sample(lm, temperature)
    ids, att, resp = batch.flat("cpu")
    assert len(set((att * (1 - resp)).sum(-1).tolist())) > 1  # prompts of several lengths: left padding
    assert len(set(resp.sum(-1).tolist())) > 1  # responses of several lengths: right padding
    with torch.no_grad():
        out = token_logprobs(lm.model, ids, att, resp, temperature=temperature)
    rec = batch.sampler_logprobs.reshape(ids.shape)
    assert out.logp.dtype == torch.float32
    assert torch.equal(out.logp != 0, rec != 0)  # same positions: the generated tokens only
    assert ((out.logp - rec).abs() <= logprob_tol(lm, ids, att, temperature)).all()


def right_padded(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows laid out as prompt, response, then padding (pad id 0)."""
    ids, att, resp = batch.flat("cpu")
    r_ids, r_att, r_resp = torch.zeros_like(ids), torch.zeros_like(att), torch.zeros_like(resp)
    for i in range(ids.shape[0]):
        keep = att[i].bool()
        n = int(keep.sum())
        r_ids[i, :n], r_att[i, :n], r_resp[i, :n] = ids[i, keep], 1, resp[i, keep]
    return r_ids, r_att, r_resp


def test_right_padding_gives_the_same_per_token_logprobs(lm):
    batch = sample(lm, 1.0, seed=5)
    ids, att, resp = batch.flat("cpu")
    r_ids, r_att, r_resp = right_padded(batch)
    assert not torch.equal(r_ids, ids)
    with torch.no_grad():
        left = token_logprobs(lm.model, ids, att, resp, with_entropy=True)
        right = token_logprobs(lm.model, r_ids, r_att, r_resp, with_entropy=True)
    tol = logprob_tol(lm, ids, att)
    for i in range(ids.shape[0]):  # the i-th response's tokens, in order, in either layout
        a, b = left.logp[i][resp[i].bool()], right.logp[i][r_resp[i].bool()]
        t = tol[i][resp[i].bool()]
        assert a.numel() == b.numel() > 0
        assert ((a - b).abs() <= t).all()
        ea, eb = left.entropy[i][resp[i].bool()], right.entropy[i][r_resp[i].bool()]
        assert ((ea - eb).abs() <= t).all()


def test_entropy_equals_brute_force_sum(lm):
    """H_k = -sum_v p_v log p_v with p = softmax(logits_{k-1} / T), from one plain full forward."""
    T = 0.7
    batch = sample(lm, T, seed=7)
    ids, att, resp = batch.flat("cpu")
    with torch.no_grad():
        out = token_logprobs(lm.model, ids, att, resp, temperature=T, with_entropy=True)
        logits = lm.model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).logits
    logits = logits.double() / T
    tol = logprob_tol(lm, ids, att, T)
    n_checked = 0
    for i in range(ids.shape[0]):
        for k in resp[i].nonzero().flatten().tolist():
            p = logits[i, k - 1].softmax(-1)
            want = -(p * p.log()).sum().item()
            assert abs(out.entropy[i, k].item() - want) <= tol[i, k]
            assert abs(out.logp[i, k].item() - p[ids[i, k]].log().item()) <= tol[i, k]
            n_checked += 1
    assert n_checked == int(resp.sum())
    assert torch.all(out.entropy[resp == 0] == 0)
    assert out.entropy[resp.bool()].max().item() > 0.05  # not a degenerate all-certain policy


def test_inference_mode_is_refused(lm):
    ids, att, resp = sample(lm, 1.0).flat("cpu")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        token_logprobs(lm.model, ids, att, resp)
