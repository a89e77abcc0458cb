"""Coupled draws within a prompt (``sampling.coupling``): a prompt's G responses take dependent
uniforms, each response's own sequence of uniforms staying i.i.d. U(0, 1), so that every response
is an exact draw from the policy while the group covers the distribution more evenly.

A prompt's G responses are split into ``G / k`` blocks of k (``sampling.coupling_block``, default
``G // 2``: two blocks). Within a block, at position t:

- ``stratified``: ``u_{j,t} = (pi_t(j) + v_{j,t}) / k`` with ``pi_t`` a uniformly random permutation of
  the block (the ranks of k hashed uniforms) and v the response's own uniform: one response in each
  of the k strata ``[i/k, (i+1)/k)``; marginally ``u_{j,t}`` is U(0, 1) (a uniform stratum plus a
  uniform offset), independent over t;
- ``antithetic`` (k = 2): ``u_{1,t} = 1 - u_{0,t}``.

Blocks, prompts and positions take independent hashes: prompts stay independent (SEs over prompts
stay valid) and responses of different blocks are independent. Every uniform is a counter-based
hash of (seed, prompt position, response, t) as the independent sampler's (``streams.row_keys``),
so the draws do not depend on the batch layout. With ``coupling_order=probability`` (default) the
inverse CDF runs over the tokens sorted by probability (a choice per position and prefix, so each
marginal stays exact): neighbouring strata then pick the same or similarly likely tokens even
where two responses' distributions differ a little.

**Cross-fit baselines.** The estimators average per-response terms, unbiased under exact
marginals, except the leave-one-out baselines, which use the prompt's other responses: a coupled
partner's value is not independent of response g, and ``E[b_g grad S_g]`` no longer vanishes.
``cross_block_*`` take a response's baseline from the other blocks only (independent of it): X
stays exactly unbiased (``crossfit_weights``, ``crossfit_token_coeffs``; the batch carries
``RolloutBatch.coupling_blocks``). The measured change (importance sampling) and ``probe.cross_fit``
are not cross-fitted: ``coupling_errors`` refuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entprobe.config import ConfigError
from entprobe.math import token_functionals as tf
from entprobe.rollouts.streams import inverse_cdf, keyed_uniforms, row_keys

MODES = ("none", "stratified", "antithetic")
ORDERS = ("probability", "vocab")
PERM_STREAM = 1 << 20  # the permutation hashes' response index offset (their own streams; G < 2^20)


@dataclass(frozen=True)
class Coupling:
    mode: str  # stratified | antithetic
    block: int  # responses per coupled block (k)
    order: str = "probability"  # the inverse CDF's token order


def block_size(mode: str, block: int, G: int) -> int:
    """k of ``sampling.coupling_block`` (0: ``G // 2``; antithetic: 2)."""
    if mode == "antithetic":
        return 2
    return int(block) if block else G // 2


def coupling_spec(sampling, G: int, batch: str = "E") -> Coupling | None:
    """The coupling of ``batch`` ("E" or "U") under a SamplingConfig (None: independent draws).
    U is coupled only with ``sampling.coupling_U``."""
    mode = str(getattr(sampling, "coupling", "none"))
    if mode == "none" or (batch == "U" and not getattr(sampling, "coupling_U", False)):
        return None
    return Coupling(mode, block_size(mode, getattr(sampling, "coupling_block", 0), G),
                    str(getattr(sampling, "coupling_order", "probability")))


def coupling_blocks(B: int, G: int, block: int) -> torch.Tensor:
    """``RolloutBatch.coupling_blocks`` [B, G]: response g's block ``g // k``."""
    return (torch.arange(G) // block).expand(B, G).clone()


def blocks_problem(c: torch.Tensor | None, B: int, G: int) -> str | None:
    """What makes a batch's ``coupling_blocks`` unusable (None: nothing, or no blocks): not integer
    ids of shape [B, G], or a prompt with a single block (its baselines would have no response)."""
    if c is None:
        return None
    if tuple(c.shape) != (B, G) or c.dtype.is_floating_point or (B and bool((c == c[:, :1]).all(-1).any())):
        return f"coupling_blocks must be integer block ids [B, G] = {(B, G)}, >= 2 blocks a prompt"
    return None


def coupling_errors(cfg) -> list[tuple[str, str]]:
    """``(key, message)`` for every setting ``sampling.coupling`` cannot be used with (empty: fine)."""
    s, b = cfg.sampling, cfg.batch
    mode = str(getattr(s, "coupling", "none"))
    if mode not in MODES:
        return [("sampling.coupling", f"is {mode!r}; use none, stratified or antithetic")]
    if str(s.coupling_order) not in ORDERS:
        return [("sampling.coupling_order", f"is {s.coupling_order!r}; use probability or vocab")]
    if mode == "none":
        return []
    out, k, G = [], block_size(mode, s.coupling_block, b.G), b.G
    if mode == "antithetic" and s.coupling_block not in (0, 2):
        out.append(("sampling.coupling_block", f"is {s.coupling_block}; antithetic pairs are blocks of 2 (set 0 or 2)"))
    elif k < 2 or G % k or G // k < 2:
        out.append(("sampling.coupling_block" if s.coupling_block else "batch.G",
                    f"{mode} coupling splits each prompt's batch.G={G} responses into blocks of "
                    f"sampling.coupling_block={k}: it must divide G into >= 2 blocks of >= 2 (each response's "
                    "baseline comes from the other blocks): use G >= 4 and a divisor k with 2 <= k <= G/2"))
    return out + restriction_errors(cfg, f"sampling.coupling={mode} couples a prompt's responses, which biases ")


def restriction_errors(cfg, why: str) -> list[tuple[str, str]]:
    """The settings whose estimates coupled E responses would bias (``why`` starts each message)."""
    p, out = cfg.probe, []
    if p.weighting_mode.value == "dr_grpo":
        out.append(("probe.weighting_mode", why + "dr_grpo's functional (it couples the group through Lmax, "
                    "so its target itself changes): use sequence, per_token_avg, token_mean or seq_mean_token_mean"))
    if cfg.importance.enabled:
        out.append(("importance.enabled", why + "the measured change (its baselines are leave-one-out within "
                    "a prompt, not cross-fitted): set importance.enabled=false (prediction only) or "
                    "sampling.coupling=none"))
    if p.cross_fit:
        out.append(("probe.cross_fit", why + "its X half / Y half split: set probe.cross_fit=false"))
    if p.mode.value != "two_batch":
        out.append(("probe.mode", why + "single_batch's estimates (E is U there): use probe.mode=two_batch"))
    return out


def check_batch(cfg, E) -> None:
    """ConfigError when E's responses are coupled (``coupling_blocks``: loaded or passed in) under a
    setting they would bias (``restriction_errors``)."""
    if getattr(E, "coupling_blocks", None) is not None:
        for key, msg in restriction_errors(cfg, "E's responses are coupled (its coupling_blocks), which biases ")[:1]:
            raise ConfigError(f"{key}: {msg}")


# ----------------------------------------------------------------------------- the uniforms
def block_ranks(r: torch.Tensor, k: int) -> torch.Tensor:
    """``pi(j)`` [P, G]: the rank of ``r[p, j]`` within its block of k (a uniformly random
    permutation of 0..k-1 per block when the r are i.i.d. continuous)."""
    P, G = r.shape
    rb = r.view(P, G // k, k)
    return rb.argsort(-1).argsort(-1).view(P, G)


def stratify(v: torch.Tensor, r: torch.Tensor, k: int) -> torch.Tensor:
    """``u = (pi(j) + v) / k`` [P, G] with ``pi = block_ranks(r, k)``: one response per stratum
    ``[i/k, (i+1)/k)`` of each block; U(0, 1) marginally."""
    return (block_ranks(r, k).to(v.dtype) + v) / k


def antithetic(v: torch.Tensor) -> torch.Tensor:
    """``u_{2i} = v_{2i}``, ``u_{2i+1} = 1 - v_{2i}`` [P, G] (G even): antithetic pairs."""
    P, G = v.shape
    first = v.view(P, G // 2, 2)[..., :1]
    return torch.cat([first, 1 - first], -1).view(P, G)


def perm_keys(seed: int, prompt_pos: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """The keys of the permutation hashes: ``row_keys`` streams no response uses."""
    return row_keys(seed, prompt_pos, response + PERM_STREAM)


def coupled_uniforms(keys: torch.Tensor, pkeys: torch.Tensor, step: int, c: Coupling, G: int) -> torch.Tensor:
    """The uniforms [N] of draw ``step`` for rows in prompt-major order, G a prompt."""
    v = keyed_uniforms(keys, step).view(-1, G)
    if c.mode == "antithetic":
        return antithetic(v).reshape(-1)
    return stratify(v, keyed_uniforms(pkeys, step).view(-1, G), c.block).reshape(-1)


def sorted_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf`` over each row's tokens in descending probability (ties in vocabulary order),
    mapped back to token ids: the same distribution, another u -> token map."""
    p, order = probs.sort(dim=-1, descending=True, stable=True)
    return order.gather(-1, inverse_cdf(p, u).unsqueeze(-1)).squeeze(-1)


def draw(probs: torch.Tensor, keys: torch.Tensor, pkeys: torch.Tensor, step: int, c: Coupling, G: int) -> torch.Tensor:
    """Tokens [N] of draw ``step`` under coupling ``c``."""
    u = coupled_uniforms(keys, pkeys, step, c, G)
    return sorted_inverse_cdf(probs, u) if c.order == "probability" else inverse_cdf(probs, u)


# ----------------------------------------------------------------------------- cross-fit baselines
def cross_block_matrix(blocks: torch.Tensor, dtype, shape=None) -> torch.Tensor:
    """``M[n, g, h] = 1`` where responses g and h of prompt n lie in different blocks [B, G, G]
    (``shape``: the [B, G] of the values it will average, checked: a unit's values against the whole
    batch's blocks would broadcast silently)."""
    if shape is not None and tuple(blocks.shape) != tuple(shape):
        raise ValueError(f"coupling_blocks {tuple(blocks.shape)} do not match the values' [B, G] {tuple(shape)}")
    return (blocks.unsqueeze(-1) != blocks.unsqueeze(-2)).to(dtype)


def cross_block_mean(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``b[n, g] = mean of x[n, h] over h outside g's block`` [B, G]: independent of response g."""
    M = cross_block_matrix(blocks.to(x.device), x.dtype, x.shape)
    return (M @ x.unsqueeze(-1)).squeeze(-1) / M.sum(-1)


def cross_block_centred(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``x_g - cross_block_mean(x)_g`` (the cross-fit of ``loo_centred``)."""
    return x - cross_block_mean(x, blocks)


def cross_block_alive_mean(x: torch.Tensor, m: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``b[n,g,t] = mean of x[n,h,t] over h outside g's block with m[n,h,t] = 1`` (0 where none is
    generating at t), times ``m[n,g,t]`` (the cross-fit of ``alive_loo_mean``)."""
    M = cross_block_matrix(blocks.to(x.device), x.dtype, x.shape[:2])
    others = M @ (x * m)
    count = M @ m
    return torch.where(count > 0, others / count.clamp(min=1), torch.zeros_like(others)) * m


def crossfit_weights(mode: str, S: torch.Tensor, L: torch.Tensor, blocks: torch.Tensor,
                     kappa: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """Score-form weights w [B, G] of ``X_n = sum_g w grad S_g`` with cross-block baselines (c the
    ``cross_block_centred``): ``sequence`` ``c(S) / G``; ``per_token_avg`` ``c((S + 1) / L) / G``;
    ``token_mean`` ``c(S + kappa L) scale / G``. Unbiased for -grad of the functional whenever each
    response is an exact draw and the blocks are independent."""
    S, G = S.detach(), S.shape[-1]
    if mode == "sequence":
        return cross_block_centred(S, blocks) / G
    if mode == "per_token_avg":
        return cross_block_centred((S + 1) / L.clamp(min=1).to(S.dtype), blocks) / G
    if mode == "token_mean":
        return cross_block_centred(S + kappa * L.to(S.dtype), blocks) * (scale / G)
    raise ValueError(f"no cross-fitted X for weighting_mode {mode!r} (sampling.coupling refuses it)")


def crossfit_token_coeffs(mode: str, H: torch.Tensor, m: torch.Tensor, blocks: torch.Tensor,
                          kappa: float = 0.0, scale: float = 1.0):
    """Per-token X coefficients with cross-block baselines: ``seq_mean_token_mean``
    ``a = -c(f) m / G``, ``e = -m / (G L)`` (f = sum_t H_t / L); otherwise (Rao-Blackwellised
    ``sequence`` / ``token_mean``) ``a = -(Q - b) m scale / G``, ``e = -m scale / G`` with
    ``Q = sum_{s>t} (H_s - kappa)`` and b its ``cross_block_alive_mean``."""
    H, m = H.detach(), m.to(H.dtype)
    G = H.shape[-2]
    if mode == "seq_mean_token_mean":
        L = m.sum(-1).clamp(min=1)
        f = (H * m).sum(-1) / L
        return tf.TokenCoeffs(-cross_block_centred(f, blocks).unsqueeze(-1) * m / G, -m / (G * L.unsqueeze(-1)))
    Q = tf.suffix_sum(H - kappa, m)
    a = -(Q - cross_block_alive_mean(Q, m, blocks)) * (scale / G)
    return tf.TokenCoeffs(a, m * (-scale / G))
