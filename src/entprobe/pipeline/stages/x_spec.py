"""X, the entropy side, as every pass builds it: ``XSpec`` holds the functional
(``probe.weighting_mode``), the estimator (``probe.x_estimator``, resolved) and, for ``token_mean``, the
evaluation batch's constants, and gives each unit's surrogate loss, whose gradient is X_u.

Two forms (math/estimators.py, math/token_functionals.py):
- response weights ``X_n = sum_g w[n,g] grad S[n,g]`` (``score``; surrogate ``sum_g w S``);
- per token ``X_n = sum_{g,t} a grad l_t + e grad H_t`` (``rao_blackwell``, and ``seq_mean_token_mean``
  under either setting; surrogate ``sum a l + e H`` with the entropies differentiable).
Coefficients come from detached values: ``values`` (forward mode passes the primal there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from entprobe.config import ConfigError
from entprobe.math import estimators as est
from entprobe.math import token_functionals as tf
from entprobe.rollouts import coupled_uniforms as cu
from entprobe.rollouts.sampling import RolloutBatch


class Forward(NamedTuple):
    """A forward pass's outputs: S [b, G], token log-probs and token entropies [b, G, T]."""
    S: torch.Tensor
    lp: torch.Tensor
    ent: torch.Tensor | None

    def unit(self, u: int) -> "Forward":
        return Forward(self.S[u:u + 1], self.lp[u:u + 1], None if self.ent is None else self.ent[u:u + 1])

    def detached(self) -> "Forward":
        return Forward(self.S.detach(), self.lp.detach(), None if self.ent is None else self.ent.detach())


PER_DECISION_IS_MODES = ("cv", "snis", "clip")  # the measured side of the Rao-Blackwellised X (token_measure.py)


def resolve_x_estimator(mode: str, choice: str, is_mode: str | None = None) -> str:
    """``probe.x_estimator`` for ``probe.weighting_mode`` (ConfigError when it does not apply):
    ``auto`` is ``rao_blackwell`` for the functionals that are sums over tokens (sequence, token_mean)
    unless ``importance.is_mode`` asks for whole-response weights (``psis``), ``score`` otherwise."""
    mode, choice = getattr(mode, "value", mode), getattr(choice, "value", choice)
    is_mode = getattr(is_mode, "value", is_mode)
    if choice == "auto":
        whole = is_mode is not None and is_mode not in PER_DECISION_IS_MODES
        return "rao_blackwell" if mode in tf.CAUSAL_MODES and not whole else "score"
    if choice == "rao_blackwell" and mode not in tf.CAUSAL_MODES:
        raise ConfigError(
            f"probe.x_estimator=rao_blackwell needs a functional that is a sum over tokens (probe.weighting_mode="
            f"sequence or token_mean); {mode} weights every token by a length that depends on the tokens after "
            "it, so the reward-to-go does not apply: use probe.x_estimator=score (or auto)")
    return choice


@dataclass(frozen=True)
class XSpec:
    mode: str  # the weighting mode (the entropy functional)
    estimator: str  # score | rao_blackwell (resolved)
    kappa: float = 0.0  # token_mean: the batch's Phi = sum H / sum L
    scale: float = 1.0  # token_mean: 1 / the batch's mean length

    @property
    def tokens(self) -> bool:
        """Per-token form (the entropies must be differentiable)."""
        return self.estimator == "rao_blackwell" or self.mode == "seq_mean_token_mean"

    @property
    def measures_tokens(self) -> bool:
        """The measured side reads E's token log-probs and entropies (stages/token_measure.py)."""
        return self.tokens or self.mode in tf.TOKEN_MODES

    @property
    def entropy(self) -> bool | str:
        """``with_entropy`` of the X pass's forward (token_logprobs)."""
        return "grad" if self.tokens else True

    def weights(self, S: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        """Response weights w [b, G] (score form only)."""
        L, Lmax = mb.gen_lengths.to(S.device), mb.Lmax.to(S.device)
        if getattr(mb, "coupling_blocks", None) is not None:  # coupled responses: cross-fit baselines
            return cu.crossfit_weights(self.mode, S, L, mb.coupling_blocks, self.kappa, self.scale)
        if self.mode == "token_mean":
            return tf.score_token_mean_weights(S.detach(), L, self.kappa, self.scale)
        return est.x_unit_coeffs(S, L, Lmax, self.mode)

    def token_coeffs(self, ent: torch.Tensor, mb: RolloutBatch) -> tf.TokenCoeffs:
        m = mb.response_mask.to(ent.device, ent.dtype)
        if getattr(mb, "coupling_blocks", None) is not None:  # coupled responses: cross-fit baselines
            return cu.crossfit_token_coeffs(self.mode, ent, m, mb.coupling_blocks, self.kappa, self.scale)
        if self.mode == "seq_mean_token_mean":
            return tf.seq_mean_token_mean_coeffs(ent, m)
        return tf.rao_blackwell_coeffs(ent, m, self.kappa, self.scale)

    def unit_losses(self, fwd: Forward, mb: RolloutBatch, values: Forward | None = None) -> torch.Tensor:
        """Per unit [b]: a scalar whose gradient (or tangent) is X_u; coefficients from ``values``
        (default: ``fwd``'s own values, detached)."""
        v = (values or fwd).detached()
        if not self.tokens:
            return (self.weights(v.S, mb).to(fwd.S.dtype) * fwd.S).sum(-1)
        if fwd.ent is None or v.ent is None:
            raise RuntimeError(f"the {self.estimator} X needs the token entropies from the forward")
        return tf.token_surrogate(self.token_coeffs(v.ent, mb), fwd.lp, fwd.ent)

    def loss(self, fwd: Forward, mb: RolloutBatch) -> torch.Tensor:
        """``sum_n`` of the unit losses: its gradient is ``sum_n X_n``."""
        if not self.tokens:  # one product and sum, as before the per-token form existed
            return (self.weights(fwd.S.detach(), mb).to(fwd.S.dtype) * fwd.S).sum()
        return self.unit_losses(fwd, mb).sum()


def x_spec(mode, choice, is_mode: str | None = None, kappa: float = 0.0, scale: float = 1.0) -> XSpec:
    """The resolved ``XSpec`` of ``probe.weighting_mode`` / ``probe.x_estimator`` (``importance.is_mode``:
    what ``auto`` takes into account)."""
    m = getattr(mode, "value", mode)
    return XSpec(m, resolve_x_estimator(m, choice, is_mode), kappa, scale)


def functional_value(spec: XSpec, S: torch.Tensor, ent: torch.Tensor | None, m: torch.Tensor) -> float:
    """The functional's estimate at theta from S [B, G], token entropies and the response mask
    [B, G, T] (gathered): ``-mean S_w`` for the score-form functionals, from the token entropies for
    the others (``token_mean``: ``sum H / sum L``; ``sequence`` under ``rao_blackwell``:
    ``mean sum_t H_t``)."""
    m = m.double()
    if spec.mode in tf.TOKEN_MODES or (spec.tokens and ent is not None):
        if spec.mode == "token_mean":
            return tf.token_mean_stats(ent, m)[2]
        return float(tf.functional_values(ent, m, spec.mode).mean())
    L = m.sum(-1)
    return float(-est.weighted_S(S.double(), L, L.amax(-1), spec.mode).mean())
