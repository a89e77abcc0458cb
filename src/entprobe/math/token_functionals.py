"""Entropy functionals built from token entropies, and their X in per-token form (pure math on
tensors: no config, no I/O, no distributed calls).

Notation (docs/math.md): prompt n, response g (G per prompt), position t (a generated token, EOS
included); tensors are ``[B, G, T]`` over the batch's columns with ``m`` the response mask (1 on
generated tokens; a response's tokens sit in the same columns in every row of a prompt's group, the
sampler's layout). ``l_t = log pi(y_t | x, y_<t)``; ``H_t`` the full-vocabulary entropy of
``pi(. | x, y_<t)`` (a function of the prefix only); ``L = sum_t m_t``.

The functionals (``probe.weighting_mode``) defined by token entropies:

- ``sequence``: ``E[sum_t H_t]``, which equals ``E[-S]`` (``E[-l_t | y_<t] = H_t``);
- ``token_mean``: ``Phi = E[sum_t H_t] / E[L]``, expectations over prompts and responses: the mean of
  H_t over all generated tokens, as TRL logs ``entropy`` and verl ``actor/entropy`` (token-mean
  aggregation). A ratio of expectations;
- ``seq_mean_token_mean``: ``E[sum_t H_t / L]`` (verl's seq-mean-token-mean): each response's mean.

Every X here has the form ``X_n = sum_{g,t} a[n,g,t] grad l_t + e[n,g,t] grad H_t`` with detached
coefficients (``TokenCoeffs``), ``E[X_n] = -grad`` of the functional (up to the ratio's O(1/B) for
token_mean). The **Rao-Blackwellised** X of an additive functional ``E[sum_t r_t]`` with
``r_t = H_t - kappa`` (``rao_blackwell_coeffs``): differentiate term by term,
``grad E[H_t(y_<t)] = E[grad H_t] + E[H_t sum_{s<t} grad l_s]``, and swap the sums:

    -grad E[sum_t r_t] = -E[sum_t grad H_t] - E[sum_t grad l_t (Q_t - b_t)],   Q_t = sum_{s>t} r_s

for any baseline b_t that does not depend on response g's tokens from t on (``E[grad l_t | y_<t] =
0``): here the mean of Q at the same position over the prompt's *other* responses still generating
there (``alive_loo_mean``). Compared with the score form ``(S - b) grad S`` it replaces each sampled
``-l_s`` by its conditional mean ``H_s`` and drops the past terms ``s <= t`` of the score at t.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

TOKEN_MODES = ("token_mean", "seq_mean_token_mean")  # functionals that need the token entropies
CAUSAL_MODES = ("sequence", "token_mean")  # additive in the tokens: a Rao-Blackwellised X exists


class TokenCoeffs(NamedTuple):
    """``X_n = sum_{g,t} a grad l_t + e grad H_t`` (coefficients [B, G, T], detached)."""
    a: torch.Tensor
    e: torch.Tensor


def suffix_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``Q_t = sum_{s > t} m_s x_s`` along the last dimension, 0 off the mask (the reward-to-go)."""
    xm = x * m
    return (xm.flip(-1).cumsum(-1).flip(-1) - xm) * m


def alive_loo_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``b[n,g,t] = mean of x[n,h,t] over h != g with m[n,h,t] = 1`` (0 where no other response is
    generating at t), times ``m[n,g,t]``. It depends on the other responses only."""
    xm, G = x * m, x.shape[-2]
    if G < 2:
        raise ValueError("a leave-one-out baseline needs G >= 2 responses per prompt")
    others = xm.sum(-2, keepdim=True) - xm
    count = m.sum(-2, keepdim=True) - m
    return torch.where(count > 0, others / count.clamp(min=1), torch.zeros_like(others)) * m


def rao_blackwell_coeffs(H: torch.Tensor, m: torch.Tensor, kappa: float = 0.0, scale: float = 1.0) -> TokenCoeffs:
    """X's coefficients for ``-grad E[sum_t (H_t - kappa)]`` times ``scale`` (module docstring):
    ``e = -scale m / G``, ``a = -scale (Q - b) m / G`` with ``Q = suffix_sum(H - kappa)`` and b its
    ``alive_loo_mean``. ``sequence``: kappa 0, scale 1; ``token_mean``: kappa = Phi, scale = 1/E[L]
    (``token_mean_coeffs``)."""
    H, m = H.detach(), m.to(H.dtype)
    G = H.shape[-2]
    Q = suffix_sum(H - kappa, m)
    a = -(Q - alive_loo_mean(Q, m)) * (scale / G)
    return TokenCoeffs(a, m * (-scale / G))


def loo_centred(x: torch.Tensor) -> torch.Tensor:
    """``x_g - mean_{h != g} x_h`` along the last dimension (G >= 2)."""
    G = x.shape[-1]
    if G < 2:
        raise ValueError("a leave-one-out baseline needs G >= 2 responses per prompt")
    return x - (x.sum(-1, keepdim=True) - x) / (G - 1)


def score_token_mean_weights(S: torch.Tensor, L: torch.Tensor, kappa: float, scale: float) -> torch.Tensor:
    """Per-response weights w [B, G] of the score-form X of token_mean, ``X_n = sum_g w grad S_g``:
    ``-grad Phi = (-grad N + Phi grad D) / D`` with ``N = E[-S]``, ``D = E[L]``, each by the score
    identity with a leave-one-out baseline: ``w = c(S + kappa L) / (G D)`` (kappa = Phi, scale = 1/D)."""
    G = S.shape[-1]
    return loo_centred(S.detach() + kappa * L.to(S.dtype)) * (scale / G)


def seq_mean_token_mean_coeffs(H: torch.Tensor, m: torch.Tensor) -> TokenCoeffs:
    """X's coefficients for ``-grad E[f]``, ``f = sum_t H_t / L``: the pathwise term
    ``e = -m / (G L)`` and the whole-sequence score term ``a = -(f - b) m / G`` with b the
    leave-one-out mean of f over the group (the 1/L weight looks ahead, so no reward-to-go)."""
    H, m = H.detach(), m.to(H.dtype)
    G = H.shape[-2]
    L = m.sum(-1).clamp(min=1)  # [B, G]
    f = (H * m).sum(-1) / L
    a = -loo_centred(f).unsqueeze(-1) * m / G
    return TokenCoeffs(a, -m / (G * L.unsqueeze(-1)))


def token_mean_stats(H: torch.Tensor, m: torch.Tensor) -> tuple[float, float, float]:
    """``(N, D, Phi)`` of a batch: N the mean over prompts of ``(1/G) sum_g sum_t H_t``, D the mean
    over prompts of the mean length, ``Phi = N / D`` (= sum H / sum L over the batch's tokens)."""
    Hs = (H.double() * m).sum(-1).mean(-1)
    Ls = m.double().sum(-1).mean(-1)
    N, D = float(Hs.mean()), float(Ls.mean())
    return N, D, N / D


def functional_values(H: torch.Tensor, m: torch.Tensor, mode: str) -> torch.Tensor:
    """Per response [B, G] the quantity the functional averages: ``sum_t H_t`` (sequence, token_mean's
    numerator) or ``sum_t H_t / L`` (seq_mean_token_mean)."""
    s = (H.double() * m).sum(-1)
    if mode == "seq_mean_token_mean":
        return s / m.double().sum(-1).clamp(min=1)
    return s


def token_surrogate(c: TokenCoeffs, lp: torch.Tensor, H: torch.Tensor | None) -> torch.Tensor:
    """Per unit [B] ``sum_{g,t} a l_t + e H_t``: its gradient is ``X_n`` (lp, H with graph)."""
    out = (c.a.to(lp.dtype) * lp).sum((-1, -2))
    if H is not None:
        out = out + (c.e.to(H.dtype) * H).sum((-1, -2))
    return out
