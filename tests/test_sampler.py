"""The keyed sampler (``rollout.generate``): each response draws from its own stream keyed by
(seed, prompt position, response index), so draws are a prefix in B, a flipped token changes only
its own response, and the draws follow the (filtered) sampling distribution.

A toy bigram model stands in for the LM: next-token logits are a fixed table row of the last
token, so every row's distribution is known exactly and can be perturbed one row at a time.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from entprobe.rollouts.sampling import generate, inverse_cdf, keyed_uniforms, row_keys

V, EOS, PAD = 7, 0, 0


class Bigram(torch.nn.Module):
    """``logits[n, t] = table[input_ids[n, t]]``; ``perturb`` = (call, row, delta): the logits
    of ``row`` in forward call ``call`` (call 0 reads the prompt, call k gives draw k) get ``delta``."""

    def __init__(self, table: torch.Tensor, perturb=None):
        super().__init__()
        self.table, self.perturb, self.calls = table, perturb, 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        logits = self.table[input_ids].clone()
        if self.perturb is not None and self.perturb[0] == self.calls:
            logits[self.perturb[1], -1] += self.perturb[2]
        self.calls += 1
        return SimpleNamespace(logits=logits, past_key_values=None)


def _table(seed: int = 0, eos_logit: float = -1.0) -> torch.Tensor:
    t = torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
    t[:, EOS] = eos_logit  # responses of a few tokens, of different lengths
    return t


def _prompts(n: int) -> list[list[int]]:
    return [[1 + i % (V - 1), 1 + (3 * i) % (V - 1)][: 1 + i % 2] for i in range(n)]


def _gen(model, prompts, G=4, seed=11, max_new=12, first_prompt=0, temperature=1.0, top_k=0, top_p=1.0):
    """(rows, responses, log-probs) of ``generate`` (its entropies: ``test_sampler_records_entropies``)."""
    return generate(model, prompts, G, max_new, EOS, PAD, temperature, top_k, top_p, seed, "cpu",
                    first_prompt=first_prompt)[:3]


def test_same_seed_same_draws_other_seed_other_draws():
    a, b = _gen(Bigram(_table()), _prompts(8)), _gen(Bigram(_table()), _prompts(8))
    assert a == b
    c = _gen(Bigram(_table()), _prompts(8), seed=12)
    assert c[1] != a[1]


def test_b_prompts_are_a_prefix_of_2b_and_chunks_continue_positions():
    """B_E = 8 is a prefix of B_E = 16 (same seed), and sampling 16 prompts in chunks of 8
    (``first_prompt``) gives the rows of one call."""
    G, prompts = 4, _prompts(16)
    _, r8, l8 = _gen(Bigram(_table()), prompts[:8], G=G)
    _, r16, l16 = _gen(Bigram(_table()), prompts, G=G)
    assert r16[:8 * G] == r8 and l16[:8 * G] == l8
    _, tail, _ = _gen(Bigram(_table()), prompts[8:], G=G, first_prompt=8)
    assert r16[8 * G:] == tail
    assert len({tuple(r) for r in r16}) > G  # not a degenerate sample


def test_a_flip_in_one_response_changes_only_that_response():
    """A large change of one row's logits at draw 2 (the worst case of an ulp that flips a token)
    changes that row's tokens from draw 2 on; every other row is unchanged token for token."""
    prompts, row = _prompts(6), 9
    _, base, base_lp = _gen(Bigram(_table()), prompts)
    assert len(base[row]) > 2
    flip = torch.zeros(V)
    flip[base[row][2]] = -30.0  # the token drawn there becomes impossible
    _, moved, moved_lp = _gen(Bigram(_table(), perturb=(2, row, flip)), prompts)
    assert moved[row][:2] == base[row][:2] and moved[row][2] != base[row][2]
    for i in range(len(base)):
        if i != row:
            assert moved[i] == base[i] and moved_lp[i] == base_lp[i], i


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expect = counts.sum() * p
    return float(((counts - expect) ** 2 / expect).sum())


def _crit(dof: int) -> float:
    """The chi-square critical value at p = 1e-6. The test is deterministic (the keys and uniforms
    are integer arithmetic, so a pass here passes everywhere); the level says how unlikely a
    correct sampler's failure, and how lucky a biased sampler's pass, would be."""
    from scipy.stats import chi2
    return float(chi2.isf(1e-6, dof))


def test_draws_follow_the_sampling_distribution():
    """First and second tokens of 6000 rows against softmax(table / T): the marginal and the
    joint (independence of a row's successive uniforms) pass a chi-square test; the recorded
    sampler log-prob is log_softmax(logits / T) of the token drawn."""
    T, table = 0.7, _table(3, eos_logit=-50.0)  # EOS ~never: two full draws per row
    prompt = [[2]] * 1500
    _, resp, lps = _gen(Bigram(table), prompt, G=4, max_new=2, temperature=T)
    tok = torch.tensor(resp)  # [6000, 2]
    logp = (table / T).log_softmax(-1)
    p1 = logp[2].exp()  # first token: after the prompt token 2
    live = p1 > 1e-12
    c1 = torch.bincount(tok[:, 0], minlength=V).double()
    assert c1[~live].sum() == 0
    assert _chi2(c1[live], p1[live]) < _crit(int(live.sum()) - 1)
    joint = p1.unsqueeze(1) * logp.exp()  # [first, second]
    cj = torch.bincount(tok[:, 0] * V + tok[:, 1], minlength=V * V).double().view(V, V)
    keep = joint * 6000 >= 5  # cells with enough mass for the chi-square approximation
    stat = _chi2(torch.cat([cj[keep], cj[~keep].sum().view(1)]), torch.cat([joint[keep], joint[~keep].sum().view(1)]))
    assert int(keep.sum()) > 2 * V and stat < _crit(int(keep.sum()))  # cells + 1 pooled rest - 1
    for r, l in zip(resp[:50], lps[:50]):
        assert l == [logp[2, r[0]].item(), logp[r[0], r[1]].item()]


def test_truncation_is_honoured():
    """top_k = 2: only the two most likely tokens are drawn, in their renormalised proportions."""
    table = _table(5, eos_logit=-50.0)
    _, resp, _ = _gen(Bigram(table), [[4]] * 1000, G=4, max_new=1, top_k=2)
    c = torch.bincount(torch.tensor(resp)[:, 0], minlength=V).double()
    top = table[4].topk(2).indices
    assert c.sum() == c[top].sum() == 4000
    p = table[4, top].softmax(-1)
    assert _chi2(c[top], p) < _crit(1)


def test_inverse_cdf_and_uniforms():
    """Zero-probability entries are never picked, u = 0 and u -> 1 land on the first and last live
    entries; the uniforms are keyed by (seed, prompt position, response) and step, in [0, 1)."""
    p = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(4, 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 1 - 2 ** -53], dtype=torch.float64)
    assert inverse_cdf(p, u).tolist() == [1, 1, 3, 3]
    k = row_keys(7, torch.arange(64) // 4, torch.arange(64) % 4)
    assert k.unique().numel() == 64 and not torch.equal(k, row_keys(8, torch.arange(64) // 4, torch.arange(64) % 4))
    us = torch.stack([keyed_uniforms(k, t) for t in range(100)])  # [100, 64]
    assert us.min() >= 0 and us.max() < 1 and us.unique().numel() == us.numel()
    # 6400 uniforms: mean 1/2 within 5 standard errors (sd 1/sqrt(12 * 6400))
    assert abs(us.mean().item() - 0.5) < 5 / math.sqrt(12 * us.numel())
    assert torch.equal(keyed_uniforms(k[5:6], 3), keyed_uniforms(k, 3)[5:6])  # a row's own stream


def test_a_transformers_model_samples_through_its_current_cache_argument(monkeypatch):
    """A real causal LM (the built-in architecture) samples with its KV cache passed under the name
    its forward takes (``cache`` in transformers 5.2x): no deprecation warning reaches the user. The
    control passes the former name and must warn, so the check can fail."""
    import warnings

    import entprobe.rollouts.sampling as sampling
    from entprobe.checkpoints.builtin import build_tiny_llama

    model = build_tiny_llama(16, seed=0).eval()

    def cache_warnings() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                generate(model, [[3, 4, 5], [6, 7]], 2, 5, 1, 0, 1.0, 0, 1.0, 11, "cpu")
        return [str(w.message) for w in caught if "past_key_values" in str(w.message)]

    assert not cache_warnings()
    if sampling.kv_cache_key(model) == "cache":  # transformers that deprecates the former name
        monkeypatch.setattr(sampling, "kv_cache_key", lambda m: "past_key_values")
        assert cache_warnings()


def test_sampling_builds_no_graph_and_reports_its_tokens():
    """Every forward of the sampler runs with autograd off (a graph per decoding step would stay
    alive until the loop ends: 6.96 GB against 1.43 GB on SmolLM2 with 24 rows of 32 tokens), even
    when the caller has autograd on; and ``on_tokens`` counts exactly the tokens sampled. The
    control calls the real model with autograd on, so the hook can tell the two apart."""
    from entprobe.checkpoints.builtin import build_tiny_llama

    model = build_tiny_llama(16, seed=0).eval()
    seen = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(torch.is_grad_enabled()))
    counted = []
    try:
        with torch.enable_grad():
            rows, responses, logprobs, entropies = generate(model, [[3, 4, 5], [6, 7]], 2, 5, 1, 0, 1.0, 0, 1.0, 11, "cpu",
                                                 on_tokens=counted.append)
            assert seen and not any(seen)
            model(input_ids=torch.tensor([[3, 4, 5]]))  # the control: the hook sees autograd on
    finally:
        handle.remove()
    assert seen[-1] is True
    assert sum(counted) == sum(len(r) for r in responses)
    assert all(isinstance(x, float) for lp in logprobs for x in lp)


def test_sampler_records_the_entropy_of_each_sampling_distribution():
    """The entropy recorded at each generated position is that of ``log_softmax(logits / T)`` at
    the prefix: for the bigram model, the entropy of the previous token's table row (known
    exactly), at any temperature; a wrong row or a missing temperature would differ by O(0.1)."""
    table, T = _table(3), 0.7
    rows, responses, _, entropies = generate(Bigram(table), _prompts(4), 3, 6, EOS, PAD, T, 0, 1.0, 5, "cpu")
    lp_rows = (table / T).log_softmax(-1)
    H_row = -(lp_rows.exp() * lp_rows).sum(-1)  # [V] entropy after each token
    n = 0
    for prompt, resp, ent in zip(rows, responses, entropies):
        prev = [prompt[-1]] + resp[:-1]
        assert len(ent) == len(resp)
        for p, h in zip(prev, ent):
            # one fp32 log-softmax over V = 7 terms: a few ulps of the entropy
            assert abs(h - float(H_row[p])) <= 8 * V * torch.finfo(torch.float32).eps * float(H_row[p])
            n += 1
    assert n > 10
