"""Projection paths on tied embeddings and the ``ghost`` path (probe.projection=ghost): per-unit
projections read off each layer's activations and output gradients in one backward, checked against
the per-unit backward on the fp64 exact model (the fp32 builtin and the whole pipeline are in
test_variance.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import fp_tol, recording_units
from entprobe.checkpoints.builtin import tiny_llama_config
from entprobe.math import paramvec as pv
from entprobe.pipeline.stages import ghost_projection
from entprobe.pipeline.stages.accumulate import accumulate, x_loss_of
from entprobe.pipeline.stages.variance import project_backward, project_jvp
from exact_model import adamw_with_state, make_setup

MODES = ("sequence", "dr_grpo", "per_token_avg")
SETUP_SEED = 1  # test_variance.py's exact setup


@pytest.fixture(scope="module")
def setup():
    """The exact model after test_variance.py's AdamW steps."""
    s = make_setup(seed=SETUP_SEED)
    adamw_with_state(s)
    return s


def rel(x, y) -> float:
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    return float((x - y).abs().max() / y.abs().max())


def tied_setup():
    """The exact setup's tokenizer and sampler on a 1-layer fp64 Llama with tied input/output embeddings."""
    setup = make_setup()
    cfg = tiny_llama_config(len(setup.tokenizer), hidden=16, layers=1, heads=2, max_positions=16)
    cfg.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        setup.model = LlamaForCausalLM(cfg).double().train()
    return setup


@pytest.mark.numerics
def test_jvp_matches_backward_with_tied_embeddings():
    """Tied input/output embeddings (SmolLM2 and many small LMs): the output side gives the
    padding row a direction, which the lookup must not use, since backward() gives that row no
    gradient through nn.Embedding(padding_idx). Without that rule b_u was off by ~50% here."""
    setup = tied_setup()
    emb = setup.model.model.embed_tokens
    assert setup.model.lm_head.weight is emb.weight and emb.padding_idx == 0
    E, U = setup.sample(4, 3, seed=1), setup.sample(4, 3, seed=2)
    assert (U.input_ids[U.attention_mask.bool()] == 0).any()  # the pad id is sampled as a token
    ctx = setup.ctx("sequence", mb_size=2)
    v = pv.scale_(accumulate(ctx, E, x_loss_of(ctx), "X over E").sum_buf, 1.0 / E.B)
    assert v[0][0].abs().sum() > 0  # the padding row has a direction (from lm_head)
    d = pv.stack_directions([v])
    with recording_units() as rec:
        b, b_ref = project_jvp(ctx, U, d, "Y", "b_u")[:, 0], project_backward(ctx, U, d, "Y", "b_u")[:, 0]
    # forward and reverse mode round differently in the fp32 softmax of the eager attention: each
    # unit's fp32 bound over its terms |Y_v,i d_i| (conftest.fp_tol); the padding row's direction
    # used by the lookup moved b_u by ~50%
    N = sum(p.numel() for p in ctx.params)
    tol = torch.tensor([fp_tol(torch.float32, float(m), N) for m in rec.all()[:, 0]], dtype=torch.float64)
    assert (b_ref != 0).sum() >= 2 and ((b - b_ref).abs() <= tol).all()


def _random_directions(params, k: int, seed: int) -> pv.DirectionSet:
    gen = torch.Generator().manual_seed(seed)
    return pv.stack_directions([[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
                                for _ in range(k)])


@pytest.mark.parametrize("mode", MODES)
def test_ghost_equals_backward_on_exact_model(setup, mode):
    """probe.projection=ghost: the per-unit projections read off the layers' activations and output
    gradients during one backward per microbatch equal the per-unit backward's (fp64: to 1e-10),
    and the gradient sum the hooks write equals autograd's."""
    E = setup.sample(6, 3, seed=11)
    ctx = setup.ctx(mode, mb_size=4)
    assert ghost_projection.covered_params(setup.model, ctx.params)[0] == set(range(len(ctx.params)))
    d = _random_directions(ctx.params, 3, 0)
    acc = accumulate(ctx, E, x_loss_of(ctx), "X over E", directions=d, unit_backward="ghost")
    assert ctx.stats.passes == {"forward": 18, "backward": 18}
    assert all(p.requires_grad for p in ctx.params)  # switched off inside the pass only
    ref = project_backward(ctx, E, d, "X", "a_u over E")
    plain = accumulate(ctx, E, x_loss_of(ctx), "X over E")
    assert rel(acc.proj, ref) < 1e-10 and acc.proj.std() > 0.1 * acc.proj.abs().max()
    assert rel(torch.cat([g.reshape(-1) for g in acc.sum_buf]), torch.cat([g.reshape(-1) for g in plain.sum_buf])) < 1e-12


def test_ghost_tied_embeddings_and_uncovered_parameters(monkeypatch):
    """Tied input/output embeddings add the lookup's part (padding row excluded) and the output
    layer's (its ghost_linear form: the materialised per-unit gradients forced over their limit);
    a parameter of a layer type without a rule (here the norms, by pretending they have none)
    takes the batched backward, and the projections still equal the per-unit backward's."""
    setup = tied_setup()
    E = setup.sample(4, 3, seed=2)
    assert (E.input_ids[E.attention_mask.bool()] == 0).any()  # the pad id is sampled as a token
    ctx = setup.ctx("sequence", mb_size=2)
    d = _random_directions(ctx.params, 2, 1)
    ref = project_backward(ctx, E, d, "X", "ref")
    monkeypatch.setattr(ghost_projection, "MATERIALIZE_MAX_BYTES", 0)  # every linear layer by ghost_linear
    kind = ghost_projection._kind
    monkeypatch.setattr(ghost_projection, "_kind", lambda m: None if "Norm" in type(m).__name__ else kind(m))
    hooks = ghost_projection.GhostHooks(setup.model, ctx.params, d)
    assert {ctx.names[i].split(".")[-2] for i in hooks.uncovered} == {"input_layernorm", "post_attention_layernorm", "norm"}
    acc = accumulate(ctx, E, x_loss_of(ctx), "X", directions=d, unit_backward="ghost")
    assert rel(acc.proj, ref) < 1e-10


class _LoraLinear(torch.nn.Linear):
    """loralib's pattern: an ``nn.Linear`` subclass holding its own low-rank factors and adding
    ``x A^T B^T`` in its own forward (the ghost rule for ``nn.Linear`` covers weight and bias only)."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         dtype=base.weight.dtype)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            self.weight.copy_(base.weight)
        self.lora_A = torch.nn.Parameter(torch.randn(r, base.in_features, generator=gen, dtype=base.weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.randn(base.out_features, r, generator=gen, dtype=base.weight.dtype))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


def test_ghost_leaves_linear_subclasses_with_their_own_parameters_and_multihead_attention_to_backward():
    """A Linear subclass with its own parameters and forward (loralib's LoRA) was counted as a plain
    Linear: its low-rank factors got no gradient and no projection, silently (their summed gradient
    was 0, the projections onto random directions off by 1e-3); nn.MultiheadAttention uses its out_proj's weight without calling the layer,
    whose hooks never fire. Both are left to the batched backward: the projections equal the
    per-unit backward's."""
    setup = make_setup()
    attn = setup.model.model.layers[0].self_attn
    attn.q_proj = _LoraLinear(attn.q_proj)
    E = setup.sample(4, 3, seed=2)
    ctx = setup.ctx("sequence", mb_size=2)
    d = _random_directions(ctx.params, 2, 1)
    hooks = ghost_projection.GhostHooks(setup.model, ctx.params, d)
    assert {ctx.names[i].rsplit(".", 1)[-1] for i in hooks.uncovered} == {"weight", "lora_A", "lora_B"}
    assert {ctx.names[i].rsplit(".", 2)[-2] for i in hooks.uncovered} == {"q_proj"}
    ref = project_backward(ctx, E, d, "X", "ref")
    acc = accumulate(ctx, E, x_loss_of(ctx), "X", directions=d, unit_backward="ghost")
    assert rel(acc.proj, ref) < 1e-10
    plain = accumulate(ctx, E, x_loss_of(ctx), "X")
    assert rel(torch.cat([g.reshape(-1) for g in acc.sum_buf]), torch.cat([g.reshape(-1) for g in plain.sum_buf])) < 1e-12
    mha = torch.nn.MultiheadAttention(8, 2)
    covered, _ = ghost_projection.covered_params(mha, list(mha.parameters()))
    assert covered == set()  # out_proj.weight / bias included


@pytest.mark.parametrize("dora", [False, True])
def test_ghost_on_a_peft_lora_model_equals_backward(dora):
    """PEFT LoRA (its factors are plain nn.Linear layers: covered; DoRA's magnitude vectors are not
    and take the batched backward): the projections and the gradient sum equal the per-unit
    backward's and autograd's."""
    from peft import LoraConfig, get_peft_model

    from exact_model import LORA_TARGETS

    setup = make_setup()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # init_lora_weights=False: B is not 0, so every factor has a gradient
        setup.model = get_peft_model(setup.model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, use_dora=dora,
                                                             target_modules=LORA_TARGETS, init_lora_weights=False))
    setup.model.double().train()
    E = setup.sample(4, 3, seed=2)
    ctx = setup.ctx("sequence", mb_size=2)
    d = _random_directions(ctx.params, 2, 1)
    uncovered = ghost_projection.GhostHooks(setup.model, ctx.params, d).uncovered
    assert {ctx.names[i].split(".")[-3] for i in uncovered} == ({"lora_magnitude_vector"} if dora else set())
    ref = project_backward(ctx, E, d, "X", "ref")
    acc = accumulate(ctx, E, x_loss_of(ctx), "X", directions=d, unit_backward="ghost")
    plain = accumulate(ctx, E, x_loss_of(ctx), "X")
    assert rel(acc.proj, ref) < 1e-10
    assert rel(torch.cat([g.reshape(-1) for g in acc.sum_buf]), torch.cat([g.reshape(-1) for g in plain.sum_buf])) < 1e-12
