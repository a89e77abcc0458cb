"""The measured change of the token-entropy functionals (math/token_functionals.py), paired with the
prediction term by term (pure math on tensors; no config, no I/O, no distributed calls).

Inputs per response of E, at theta (0) and theta_plus (1): token log-probs ``l0, l1`` and entropies
``H0, H1`` [B, G, T], the response mask m. ``rho_t = l1_t - l0_t``; ``W_<t = exp(sum_{s<t} rho_s)``
is the likelihood ratio of the prefix y_<t (per-decision weights), ``w_t = exp(rho_t)``.

**Per-decision estimator** of the change of ``E[sum_t x_t]`` for a per-position quantity x that is a
function of the prefix (``H_t``, or 1 for the length), with the reward-to-go baselines ``b_t`` of X
(``alive_loo_mean`` of ``sum_{s>t} x_s``, built from the prompt's other responses):

    psi_n = (1/G) sum_g sum_t m_t [ W_<t x1_t - x0_t - (w_t - 1) b_t ]

Unbiased for ``E_theta+[sum_t x1_t] - E_theta[sum_t x0_t]``: ``m_t x1_t`` is a function of y_<t, whose
likelihood ratio is ``W_<t``; ``E[w_t - 1 | y_<t] = 0`` and b_t does not depend on response g. To
first order (``W_<t - 1 ~ sum_{s<t} dl_s``, ``w_t - 1 ~ dl_t``, ``x1 - x0 ~ dx``) it is
``(1/G) sum_g [sum_t dx_t + sum_t dl_t (sum_{s>t} x_s - b_t)]``: the Rao-Blackwellised prediction's
own per-response terms, so measured - predicted is second order. Per-decision weights keep their
variance where whole-sequence weights degrade with the response's length.

**Whole-response estimator** (score-form X, and ``seq_mean_token_mean``) of the change of
``E[f]`` with ``f1 - f0 = d`` known per response and a leave-one-out baseline ``beta`` of f:
``psi_n = sum_g nu_g (f1_g - beta_g) - mean_g (f0_g - beta_g)`` with ``nu = w^ / G`` (cv) or
``w^ / sum w^`` (normalised within the prompt), ``w^`` the estimator's weights of whole responses;
first order ``mean_g (dx_g + l_g (f0_g - beta_g))`` (``sum_g (f - beta) = 0`` cancels SNIS's shift).

``token_mean`` (``Phi = N / D``, N the numerator's and D the length's expectation): with per-prompt
changes ``psi_N``, ``psi_D`` of either estimator, the batch's ``Phi^ = N^ / D^`` at theta and
``D^+ = D^ + mean psi_D``, the change of the ratio is exactly ``(dN^ - Phi^ dD^) / D^+``; its
per-prompt contributions are ``psi_n = (psi_N,n - kappa psi_D,n + (kappa - Phi^) mean psi_D) / D^+``
(kappa: the constant X used, equal to Phi^ up to rounding), paired with X's ``(dN_n - kappa dD_n)/D^``.
Its SE treats Phi^ and D^+ as fixed, as the prediction's treats its kappa and 1/D^.
"""
from __future__ import annotations

import math

import torch

from entprobe.math import token_functionals as tf


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1) - x


def per_decision_change(x0: torch.Tensor, x1: torch.Tensor, rho: torch.Tensor, m: torch.Tensor,
                        b: torch.Tensor, log_clip: float | None = None) -> torch.Tensor:
    """Per prompt [B] (inputs [B, G, T]): ``(1/G) sum_g sum_t m [W_<t x1 - x0 - (w_t - 1) b]``
    (module docstring), computed as ``m [(W_<t - 1) x1 + (x1 - x0) - (w_t - 1) b]`` so that
    nothing large cancels; ``log_clip``: weights truncated at ``exp(log_clip)`` (``clip``)."""
    m = m.double()
    rho = rho.double() * m
    lW, lw = _exclusive_cumsum(rho), rho
    if log_clip is not None:
        lW, lw = lW.clamp(max=log_clip), lw.clamp(max=log_clip)
    x0, x1 = x0.double(), x1.double()
    term = torch.expm1(lW) * x1 + (x1 - x0) - torch.expm1(lw) * b.double()
    return (term * m).sum(-1).mean(-1)


def per_decision_change_normalised(x0: torch.Tensor, x1: torch.Tensor, rho: torch.Tensor, m: torch.Tensor,
                                   b: torch.Tensor, log_clip: float | None = None) -> torch.Tensor:
    """Per prompt [B]: the per-decision estimator with each position's prefix weights normalised
    over the prompt's G responses (``snis``; ``clip``: truncated at ``exp(log_clip)`` first),
    ``nu_{g,t} = W_<t,g / sum_h W_<t,h`` (a response that ended before t keeps its whole weight):

        psi_n = (1/G) sum_g sum_t [ G nu (m x1 - beta) - (m x0 - beta) - m (w_t - 1)(b_t - B_t) ]

    with ``beta_{g,t}`` the mean of ``m x0`` at t over the other responses (so ``sum_g (m x0 - beta)
    = 0`` at every t, which cancels the normalisation's first-order shift) and ``B_{g,t} =
    sum_{t' > t} beta_{g,t'}``; to first order this is the unnormalised estimator's expansion, X's
    own terms. Self-normalising leaves an O(step^2 / G) bias."""
    m = m.double()
    rho = rho.double() * m
    lW = _exclusive_cumsum(rho)
    lw = rho
    if log_clip is not None:
        lW, lw = lW.clamp(max=log_clip), lw.clamp(max=log_clip)
    G = m.shape[-2]
    xm0, xm1 = x0.double() * m, x1.double() * m
    beta = (xm0.sum(-2, keepdim=True) - xm0) / (G - 1)
    Bsuf = beta.flip(-1).cumsum(-1).flip(-1) - beta  # sum over later positions
    nu = torch.softmax(lW, -2)  # over the G responses, per position
    main = (G * nu * (xm1 - beta) - (xm0 - beta)).sum(-1)
    cv = (m * torch.expm1(lw) * (b.double() - Bsuf)).sum(-1)
    return (main - cv).mean(-1)


def per_decision_ess_frac(rho: torch.Tensor, m: torch.Tensor) -> float:
    """Mean over (prompt, position) of Kish's ESS of the prefix weights ``W_<t`` over the prompt's
    responses generating at t, as a fraction of their number (1: no degeneracy)."""
    m = m.double()
    lW = _exclusive_cumsum(rho.double() * m)
    lW = torch.where(m > 0, lW, torch.full_like(lW, -math.inf))
    top = lW.amax(-2, keepdim=True)
    w = torch.where(m > 0, (lW - top.clamp(min=-1e300)).exp(), torch.zeros_like(lW))
    n = m.sum(-2)  # [B, T] responses generating at t
    ess = w.sum(-2) ** 2 / (w ** 2).sum(-2).clamp(min=1e-300)
    keep = n > 0
    return float((ess[keep] / n[keep] * n[keep]).sum() / n[keep].sum())


def whole_response_change(f0: torch.Tensor, d: torch.Tensor, lw_hat: torch.Tensor, normalise: bool
                          ) -> torch.Tensor:
    """Per prompt [B] (inputs [B, G]): ``sum_g nu_g (f1_g - beta_g) - mean_g (f0_g - beta_g)`` with
    ``f1 = f0 + d``, beta the leave-one-out mean of f0, ``nu = w^ / G`` or ``softmax(lw_hat)``."""
    f0, d, lw = f0.double(), d.double(), lw_hat.double()
    G = f0.shape[-1]
    c = f0 - (f0.sum(-1, keepdim=True) - f0) / (G - 1)  # f0 - beta
    if normalise:
        nu = torch.softmax(lw, -1)
        return (nu * (c + d)).sum(-1) - c.mean(-1)
    return (torch.expm1(lw) * (c + d) + d).mean(-1)


def token_mean_psi(psi_N: torch.Tensor, psi_D: torch.Tensor, Phi, D, kappa) -> torch.Tensor:
    """``token_mean``'s per-prompt contributions [..., B] (module docstring): their mean is exactly
    the change of the batch's ratio, ``(mean psi_N - Phi mean psi_D) / (D + mean psi_D)``. Phi, D,
    kappa: floats, or tensors broadcasting against [..., 1] (one per batch)."""
    dD = psi_D.double().mean(-1, keepdim=True)
    return (psi_N.double() - kappa * psi_D.double() + (kappa - Phi) * dD) / (D + dD)


def reward_to_go_baselines(H0: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b_R, b_C)`` [B, G, T]: X's reward-to-go baselines of the entropy (``Q = sum_{s>t} H_s``)
    and of the length (``sum_{s>t} 1``), each ``alive_loo_mean`` over the prompt's other responses."""
    m = m.double()
    R, C = tf.suffix_sum(H0.double(), m), tf.suffix_sum(torch.ones_like(m), m)
    return tf.alive_loo_mean(R, m), tf.alive_loo_mean(C, m)


def forward_rounding(lp: torch.Tensor, H: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    """A bound on the rounding error of one forward pass's token log-prob and token entropy [..., T]
    (generated positions; 0 elsewhere): ``eps (1 + |l_t| + H_t)``, eps the pass's working precision.
    log-softmax and its entropy are computed from logits whose scale ``|l_t| + H_t + 1`` bounds on
    a small vocabulary; measured on the exact model (tests/test_paired_rounding.py), the difference of
    two passes at nearby parameters stays within 0.84 of two such bounds for l_t and 0.38 for H_t.
    The errors are not independent between tokens (their mean is ~0.25 eps at lr 1e-3): sum them
    as bounds (``estimators.propagated_bound``), not in quadrature."""
    return eps * (1.0 + lp.double().abs() + H.double().abs()) * m.double()


def change_psi(lp0: torch.Tensor, lp1: torch.Tensor, H0: torch.Tensor, H1: torch.Tensor, m: torch.Tensor,
               mode: str, per_decision: bool, is_mode: str, clip_c: float, kappa=None,
               smoothed_log_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-prompt contributions [..., B] of the measured change of a token functional (inputs
    [..., B, G, T]; leading dimensions: independent batches). ``per_decision``: the estimator that
    pairs with the Rao-Blackwellised X (``cv``; ``snis``: normalised per position; ``clip``: as snis
    with weights truncated at ``clip_c``), else the
    whole-response one (``cv``, ``snis``, ``clip``, ``psis`` with ``smoothed_log_weights`` [..., B, G]).
    ``kappa``: token_mean's constant in X (default: the batch's own Phi)."""
    m = m.double()
    rho = (lp1.double() - lp0.double()) * m
    if per_decision:
        if is_mode not in ("cv", "snis", "clip"):
            raise ValueError(f"per-decision weights offer cv, snis and clip, not {is_mode}")
        log_clip = math.log(clip_c) if is_mode == "clip" else None
        change = per_decision_change if is_mode == "cv" else per_decision_change_normalised
        b_R, b_C = reward_to_go_baselines(H0, m)
        psi_N = change(H0, H1, rho, m, b_R, log_clip)
        ones = torch.ones_like(m)
        psi_D = change(ones, ones, rho, m, b_C, log_clip) if mode == "token_mean" else None
    else:
        l = rho.sum(-1)  # [..., B, G]
        lw, norm = {"cv": (l, False), "snis": (l, True), "psis": (smoothed_log_weights, True),
                    "clip": (l.clamp(max=math.log(clip_c)), True)}[is_mode]
        if lw is None:
            return torch.full(l.shape[:-1], math.nan, dtype=torch.float64)
        L = m.sum(-1)
        if mode == "seq_mean_token_mean":
            f0, f1 = (H0.double() * m).sum(-1) / L.clamp(min=1), (H1.double() * m).sum(-1) / L.clamp(min=1)
            return whole_response_change(f0, f1 - f0, lw, norm)
        # the entropy's numerator as -S (f1 - f0 = -l), with the score term's control variate: the
        # ``sequence`` estimator of math/importance.py (``separable_change`` with k = 1)
        from entprobe.math.importance import separable_change
        S0 = (lp0.double() * m).sum(-1)
        psi_N = separable_change(-S0, l, lw, torch.ones_like(S0), norm)
        psi_D = whole_response_change(L, torch.zeros_like(L), lw, norm) if mode == "token_mean" else None
    if mode != "token_mean":
        return psi_N
    Hs, Ls = (H0.double() * m).sum(-1).mean(-1).mean(-1, keepdim=True), m.sum(-1).mean(-1).mean(-1, keepdim=True)
    Phi = Hs / Ls
    return token_mean_psi(psi_N, psi_D, Phi, Ls, Phi if kappa is None else kappa)
