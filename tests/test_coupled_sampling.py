"""sampling.coupling: a prompt's G responses take coupled uniforms (stratified or antithetic), each
response an exact draw from the policy; X's baselines come from the other blocks (cross-fit), so X
stays unbiased; the default (none) is the independent sampler bit for bit."""
from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest
import torch
from scipy import stats

from conftest import compose_cfg
from entprobe.config import ConfigError, SamplingConfig
from entprobe.math import token_functionals as tf
from entprobe.pipeline.config_checks import validate
from entprobe.rollouts import coupled_uniforms as cu
from entprobe.rollouts.sampling import RolloutBatch, row_keys, sample_batch
from tests.coupled_helpers import antithetic_pair_law, copies, direction, exact_target, stratified_mean_se, x_projections
from tests.exact_model import enumerate_responses, make_setup

STRAT2 = cu.Coupling("stratified", 2)
ANTI_VOCAB = cu.Coupling("antithetic", 2, "vocab")
P = 4000  # prompts of the uniform checks


@pytest.fixture(scope="module")
def setup():
    return make_setup()


def _sample(setup, idx, G, c, seed=11):
    return sample_batch(setup.model, setup.tokenizer, setup.task, idx, G, setup.sampling, seed, "dr_grpo",
                        1e-6, "never", coupling=c)


# sha256 of setup.sample(8, 4, 17).input_ids drawn by the sampler before coupling existed (fp64 model:
# a token flips only if a uniform falls within rounding of a CDF boundary)
BEFORE_COUPLING = "f50d323fa4c3c64a1dd263a585fe50802d8b61aa735f81841f10f3cf0674e190"


def test_default_is_the_independent_sampler_bit_for_bit(setup):
    """coupling=none gives no coupling at all, and the default sampler draws exactly the tokens it
    drew before coupling existed."""
    assert cu.coupling_spec(SamplingConfig(), 4, "E") is None
    assert cu.coupling_spec(SamplingConfig(coupling="stratified"), 4, "U") is None  # U only with coupling_U
    assert cu.coupling_spec(SamplingConfig(coupling="stratified", coupling_U=True), 8, "U") == cu.Coupling(
        "stratified", 4)
    got = setup.sample(8, 4, 17)
    assert got.coupling_blocks is None
    assert hashlib.sha256(got.input_ids.numpy().tobytes()).hexdigest() == BEFORE_COUPLING


def _uniforms(c: cu.Coupling, G: int, step: int, seed: int = 3) -> torch.Tensor:
    r = torch.arange(P * G)
    keys = row_keys(seed, r // G, r % G)
    return cu.coupled_uniforms(keys, cu.perm_keys(seed, r // G, r % G), step, c, G).view(P, G)


@pytest.mark.parametrize("c,G", [(STRAT2, 4), (cu.Coupling("stratified", 4), 8), (ANTI_VOCAB, 4)])
def test_each_response_takes_iid_uniforms(c, G):
    """Each response's uniform at each position is U(0, 1) over prompts (KS at the 0.1% level, P
    prompts), positions are uncorrelated, different blocks are uncorrelated, and the coupling is the
    one asked for: one response per stratum of each block, or u + u' = 1."""
    u0, u1 = _uniforms(c, G, 0), _uniforms(c, G, 1)
    for g in range(G):
        assert stats.kstest(u0[:, g].numpy(), "uniform").pvalue > 1e-3
    z = 3.3 * math.sqrt(1 / P)  # |corr| of independent uniforms: sd 1/sqrt(P), at 3.3 sd
    corr = lambda a, b: float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr(u0[:, 0], u1[:, 0])) < z  # one response, two positions
    assert abs(corr(u0[:, 0], u0[:, c.block])) < z  # two blocks
    blocks = u0.view(P, G // c.block, c.block)
    if c.mode == "stratified":
        strata = (blocks * c.block).floor().sort(-1).values
        assert torch.equal(strata, torch.arange(c.block, dtype=strata.dtype).expand_as(strata))
    else:
        assert torch.allclose(blocks.sum(-1), torch.ones((), dtype=blocks.dtype), rtol=0, atol=2 * torch.finfo(blocks.dtype).eps)


def _response_index(setup):
    return {tuple(r): i for i, r in enumerate(setup.all_responses())}


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs``, cells of expected count < 5 pooled."""
    n = float(counts.sum())
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    ex = torch.cat([exp[~small], exp[small].sum().view(1)])
    return float(stats.chi2.sf(float(((obs - ex) ** 2 / ex).sum()), len(obs) - 1))


@pytest.mark.parametrize("c", [STRAT2, ANTI_VOCAB])
def test_each_response_is_an_exact_draw(setup, c):
    """Over 600 copies of a prompt, each of the G = 4 responses' full-sequence distribution matches
    the exact policy (chi-square, p > 1e-3, fixed seed); the same counts against the policy with the
    likeliest first token's responses twice as likely (renormalised) are rejected at that level: the test has power."""
    n = 600
    b = _sample(setup, torch.zeros(n, dtype=torch.long), 4, c)
    index, K = _response_index(setup), len(setup.all_responses())
    with torch.no_grad():
        p_own = setup.response_logprobs(setup.task.prompts[0].text).exp()
    resp = setup.all_responses()
    top = max(set(r[0] for r in resp), key=lambda t: float(sum(p for r, p in zip(resp, p_own) if r[0] == t)))
    p_other = p_own * torch.tensor([2.0 if r[0] == top else 1.0 for r in resp], dtype=p_own.dtype)
    p_other = p_other / p_other.sum()
    for g in range(4):
        counts = torch.zeros(K, dtype=torch.float64)
        for i in range(n):
            resp = b.input_ids[i, g][b.response_mask[i, g].bool()].tolist()
            counts[index[tuple(resp)]] += 1
        assert _chi2_p(counts, p_own) > 1e-3, g
        assert _chi2_p(counts, p_other) < 1e-3


@pytest.fixture(scope="module")
def coupled_batches(setup):
    idx = copies(setup, 100)
    return idx, {c.mode + c.order: _sample(setup, idx, 4, c) for c in (STRAT2, ANTI_VOCAB)}


CASES = [("sequence", "score"), ("sequence", "rao_blackwell"), ("token_mean", "rao_blackwell"),
         ("token_mean", "score"), ("per_token_avg", "score"), ("seq_mean_token_mean", "score")]


@pytest.mark.parametrize("mode,estimator", CASES)
def test_x_is_unbiased_under_coupling(setup, coupled_batches, mode, estimator):
    """With coupled responses and the cross-block baselines the pipeline's X (``XSpec``) averages to
    the exact -grad of the functional along a fixed direction: |z| < 3 over 300 prompts, each
    coupling mode."""
    idx, batches = coupled_batches
    d = direction(setup)
    target = exact_target(setup, d, mode)
    for name, b in batches.items():
        mean, se = stratified_mean_se(x_projections(setup, b, d, mode, estimator), idx)
        assert abs(mean - target) < 3 * se, (name, mean, target, se)


def test_cross_block_baselines_ignore_the_own_block():
    """A response's baseline does not move when its block partners change (what makes it independent
    of the response under coupling), unlike the leave-one-out one; it is the mean of the other blocks."""
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.ones(3, 4, 5, dtype=torch.float64)
    blocks = cu.coupling_blocks(3, 4, 2)
    y = x.clone()
    y[:, 1] += 1.0  # response 0's partner
    for fn in (lambda v: cu.cross_block_mean(v, blocks), lambda v: v - cu.cross_block_centred(v, blocks)):
        assert torch.equal(fn(x)[:, 0], fn(y)[:, 0])
    assert not torch.equal((x - tf.loo_centred(x))[:, 0], (y - tf.loo_centred(y))[:, 0])
    tol = 4 * torch.finfo(torch.float64).eps * float(x.abs().max())  # a mean of 2 terms, rounded twice
    assert torch.allclose(cu.cross_block_mean(x, blocks)[:, 0], x[:, 2:].mean(-1), rtol=0, atol=tol)
    X3 = x.unsqueeze(-1).expand(3, 4, 5)
    Y3 = y.unsqueeze(-1).expand(3, 4, 5)
    assert torch.equal(cu.cross_block_alive_mean(X3, m, blocks)[:, 0], cu.cross_block_alive_mean(Y3, m, blocks)[:, 0])


def test_stratifying_the_first_token_cuts_its_variance(setup):
    """At the first position every response of a prompt draws from the same distribution, so a
    block's frequency of the most likely token has the exact variance ``sum_i q_i (1 - q_i) / k^2``
    with ``q_i = clip(k p - i, 0, 1)`` (stratum i), below the independent ``p (1 - p) / k``.
    Measured over 600 prompt copies, the ratio of the two spreads matches the exact one within 3 SEs
    of a variance ratio (``sqrt(2 / n)`` relative each)."""
    n, k = 600, 2
    idx = torch.zeros(n, dtype=torch.long)
    with torch.no_grad():
        first = setup.response_logprobs(setup.task.prompts[0].text).exp()
    resp = setup.all_responses()
    by_token = {}
    for r, p in zip(resp, first.tolist()):
        by_token[r[0]] = by_token.get(r[0], 0.0) + p
    top, p = max(by_token.items(), key=lambda kv: kv[1])
    q = [min(max(k * p - i, 0.0), 1.0) for i in range(k)]
    exact_ratio = math.sqrt(sum(x * (1 - x) for x in q) / k**2 / (p * (1 - p) / k))
    spreads = {}
    for name, c in (("none", None), ("strat", STRAT2)):
        b = _sample(setup, idx, 4, c)
        col = int(b.response_mask[0, 0].nonzero()[0])
        hit = (b.input_ids[:, :, col] == top).double().view(n, 2, k).mean(-1)  # [n, blocks]: block frequencies
        spreads[name] = float(hit.reshape(-1).std())
    ratio = spreads["strat"] / spreads["none"]
    assert ratio < 1
    assert abs(ratio - exact_ratio) < 3 * ratio * math.sqrt(2 / (2 * n)), (ratio, exact_ratio)


BASE = ["importance.enabled=false", "batch.G=4"]


@pytest.mark.parametrize("overrides,key", [
    (["sampling.coupling=stratified"], "importance.enabled"),  # the measured change is not cross-fitted
    (BASE + ["sampling.coupling=stratified", "probe.weighting_mode=dr_grpo"], "probe.weighting_mode"),
    (BASE + ["sampling.coupling=stratified", "batch.G=2"], "batch.G"),
    (BASE + ["sampling.coupling=stratified", "sampling.coupling_block=3"], "sampling.coupling_block"),
    (BASE + ["sampling.coupling=antithetic", "sampling.coupling_block=4"], "sampling.coupling_block"),
    (BASE + ["sampling.coupling=sobol"], "sampling.coupling"),
    (BASE + ["sampling.coupling=stratified", "sampling.coupling_order=random"], "sampling.coupling_order"),
    (BASE + ["sampling.coupling=stratified", "probe.mode=single_batch"], "probe.mode"),
])
def test_coupling_refused_where_it_would_bias(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(tmp_path, *overrides))
    msg = str(info.value)
    assert msg.startswith(f"{key}:") and "\n" not in msg


@pytest.mark.parametrize("extra", [[], ["sampling.coupling=antithetic"], ["sampling.coupling_block=2", "batch.G=8"]])
def test_coupling_accepted_for_prediction_runs(tmp_path, extra):
    """Prediction-only runs take every coupling: no error listed, and ``validate`` passes."""
    cfg = compose_cfg(tmp_path, *BASE, "sampling.coupling=stratified", *extra)
    assert cu.coupling_errors(cfg) == []
    validate(cfg)  # raises ConfigError on any refusal


def test_saved_batch_keeps_its_blocks(tmp_path, setup):
    b = _sample(setup, torch.arange(3), 4, STRAT2)
    b.save(tmp_path / "E.pt")
    back = RolloutBatch.load(tmp_path / "E.pt")
    assert torch.equal(back.coupling_blocks, torch.tensor([[0, 0, 1, 1]] * 3))
    assert "coupling_blocks" in dataclasses.replace(back, coupling_blocks=torch.zeros(3, 4, dtype=torch.long)).problem()


DOC_COMMAND = "python -m entprobe.main sampling.coupling=stratified importance.enabled=false"


def test_documented_coupling_command_runs(tmp_path):
    """docs/sampling.md's command (on the test config's small batches, G = 4): the whole two-batch
    prediction runs on a coupled E (blocks saved with it), U independent (no coupling_U)."""
    from entprobe.cli.probe_job import run

    overrides = DOC_COMMAND.split()[3:]
    res = run(compose_cfg(tmp_path, *overrides, f"batch.save={tmp_path / 'b'}"))
    assert math.isfinite(res["deltaH_pred"]) and res["SE_deltaH_pred"] > 0
    E, U = (RolloutBatch.load(tmp_path / "b" / f) for f in ("E.pt", "U.pt"))
    assert torch.equal(E.coupling_blocks[0], torch.tensor([0, 0, 1, 1])) and U.coupling_blocks is None


def test_cross_block_baseline_refuses_blocks_of_another_batch():
    """A unit's values [1, G] against the whole batch's blocks [B, G] would broadcast into B rows."""
    with pytest.raises(ValueError, match="coupling_blocks"):
        cu.cross_block_mean(torch.zeros(1, 4, dtype=torch.float64), cu.coupling_blocks(3, 4, 2))


@pytest.mark.parametrize("order", ["probability", "vocab"])
def test_exact_antithetic_pair_marginals_and_baseline_bias(setup, order):
    """Exact enumeration of an antithetic pair's joint law (``antithetic_pair_law``): each member's
    marginal is the policy to rounding; with the pair's partner as the leave-one-out baseline (G = 2)
    the score X's mean along d misses -grad H . d by more than 10% (measured: 23-130%), while a
    baseline from an independent block leaves it exact. This is why coupled batches cross-fit."""
    d = direction(setup)
    en = enumerate_responses(setup)
    K, Jd = en.K, en.J @ d
    index = _response_index(setup)
    eps = torch.finfo(torch.float64).eps
    for p_i in (0, 2):
        law = antithetic_pair_law(setup, setup.task.prompts[p_i].text, order)
        S, dS = en.S[p_i * K:(p_i + 1) * K], Jd[p_i * K:(p_i + 1) * K]
        p = S.exp()
        ma, mb = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
        loo = 0.0  # E[(1/2) sum_g (S_g - S_partner) dS_g]
        for (a, b), q in law.items():
            ia, ib = index[a], index[b]
            ma[ia] += q
            mb[ib] += q
            loo += q * 0.5 * float((S[ia] - S[ib]) * dS[ia] + (S[ib] - S[ia]) * dS[ib])
        tol = 4 * eps * len(law)  # each cell a product of <= 3 factors and a sum, summed over the cells
        assert float((ma - p).abs().max()) < tol and float((mb - p).abs().max()) < tol
        target = float((p * S * dS).sum())  # -grad H . d = E[S grad S] . d
        assert abs(loo - target) > 0.1 * abs(target), (p_i, loo, target)
        # baseline from an independent block: E[S_a dS_a] - E[S] E_marginal[dS_a]
        cross = float((ma * S * dS).sum()) - float((p * S).sum()) * float((ma * dS).sum())
        scale = float((p * (S * dS).abs()).sum()) + float((p * S.abs()).sum()) * float((p * dS.abs()).sum())
        # the gradients carry fp32 rounding (HF runs the norms in fp32 even in an fp64 model)
        assert abs(cross - target) < 4 * torch.finfo(torch.float32).eps * scale, (p_i, cross, target)


def test_coupled_batches_passed_in_are_refused_where_they_would_bias(tmp_path, setup):
    """E batches that carry coupling_blocks (loaded, or passed to entprobe.probe) face the same
    refusals as sampling.coupling, whatever the sampling keys say."""
    from entprobe.cli.probe_job import to_typed

    E = _sample(setup, torch.arange(3), 4, STRAT2)
    with pytest.raises(ConfigError, match=r"^importance.enabled: E's responses are coupled"):
        cu.check_batch(to_typed(compose_cfg(tmp_path)), E)
    cu.check_batch(to_typed(compose_cfg(tmp_path, "importance.enabled=false")), E)
    cu.check_batch(to_typed(compose_cfg(tmp_path)), dataclasses.replace(E, coupling_blocks=None))
