"""Importance-sampling math of the ground truth (docs/math.md, docs/uncertainty.md): pure functions
on tensors, no config, no I/O, no distributed calls.

The measured change is ``H(theta_plus) - H(theta)`` on E's responses, drawn at theta and
reweighted by ``w = pi_theta_plus / pi_theta = exp(l)``, ``l = S_upd - S_orig``. The target is the
mean over prompts of each prompt's entropy, so every estimate is *stratified* (prompts are the
units of the SE) and **paired with the prediction by construction**: expanded to first order in
the step, each estimator's contribution of a prompt is ``-sum_g x_g l_g``, where ``x_g`` are the
per-response weights of X (``estimators.x_unit_coeffs``) and ``l_g ~ grad S_g . Delta theta`` --
the prediction's own ``-X_n . Delta theta`` term by term. So ``measured - predicted`` on the same
responses is second order in the step (plus the normalisation effects named below), and the paired
test has power. Each estimator is (its importance part) + (zero-mean control variates in ``w - 1``
whose baselines come from the *other* responses of the prompt, so they add no bias).

Separable functionals (``sequence``: f = -S; ``per_token_avg``: f = -S / L), per prompt n, with
``k_g = dS_w/dS`` (1, or 1/L_g), ``beta_g`` / ``lam_g`` the leave-one-out means of f / k:

    psi_n = sum_g nu_g (f+_g - beta_g) - mean_g (f_g - beta_g) + mean_g (w^_g - 1) lam_g

- ``cv`` (default): ``nu = w / G``, ``w^ = w``; exactly unbiased for every G >= 2 (E[w_g] = 1 and
  the baselines do not depend on response g).
- ``snis``: ``nu = w / sum_g w`` (self-normalised within the prompt), ``w^ = w``; ``clip``: the
  same with ``min(w, clip_c)``; ``psis``: with Pareto-smoothed weights (tail fitted on all
  responses' log-weights pooled, then each prompt normalises its own). The leave-one-out baseline
  inside the normalised sum removes SNIS's first-order O(1/G) shrinkage (a plain within-prompt
  SNIS estimates (1 - 1/G) of the covariance part); what is left is O(step^2 / G).
The ``lam`` term is the score term ``-mean_g k_g l_g`` of ``f+ - f``, zero in expectation, which X
leaves out: without it the measured side carries first-order noise the prediction does not.

``dr_grpo`` (f = (1/G) sum_k u_k / Lmax with ``u = -S``: the group's longest response couples it),
per prompt n, with ``a_g = w^_g - 1``, ``Lmax_-g`` the longest of the other responses:

    cv:  psi_n = (1/G) sum_k w_k u+_k r_k - f + (1/G) sum_g a_g (1 - ubar_-g) / Lmax_-g          (exactly unbiased)
         r_k = 1/Lmax + sum_{B} prod_{j in B} a_j (1/Lmax - 1/Lmax(outside B))

each response reweighted among its prompt's own (``group_change_cv``: the sum over the nonempty sets
B of the other responses; ``ubar_-g`` the mean of u over the others). ``r_k`` is an unbiased
estimate, given response k, of ``E_theta+[1/Lmax]``; a term vanishes unless B holds every longest
response, so with m responses at the longest length (truncated generations) ``r = 1/Lmax + O(l^m)``.
Expanded in l, psi is ``-sum_g x_g l_g`` at first order, and its second order is centred: each
response's ``l_g^2 (u_g - ubar_-g - 1) / (2 G Lmax)``, plus cross terms ``l_g l_h`` only through the
longest responses (none when three or more share the longest length). The group weight
``W = prod_g w_g`` with zero-mean control variates (``W f+ - f - sum_g a_g b_g``) is unbiased too,
but its second order carries ``f sum_{g<h} l_g l_h``, with f ~ H uncentred.

    normalised: psi_n = H+ + B om_n (f+_n - H+) - f_n - sum_g a_g (b_g - fbar_-n)

with ``W`` normalised over the B prompts, ``om = W / sum_m W_m``, ``H+ = sum_n om_n f+_n`` (``psi``
is the ratio estimator's linearisation), ``b_g = x_g - F - 1/(G Lmax)`` (F = -f: the baseline inside
x_g, built from the other responses only) and ``fbar_-n`` the mean of f over the other prompts
(``group_change_normalised``). Normalising over prompts leaves an O(1/B) first-order residual,
larger than any second-order term, so these keep the group weight; ``cv`` is the paired test's.
The estimate is ``mean_n psi_n`` and its SE ``sd(psi) / sqrt(B)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from entprobe.math.estimators import leave_one_out_max, mean_variance, weighted_S, x_unit_coeffs

def snis_weights(logw: torch.Tensor) -> torch.Tensor:
    """Self-normalised weights ``w / sum w`` in the log domain (shift by max)."""
    lw = logw.double() - logw.double().max()
    w = lw.exp()
    return w / w.sum()


def clipped_log_weights(logw: torch.Tensor, clip_c: float) -> torch.Tensor:
    """``log min(w, c)`` elementwise: truncated raw weights (before normalisation), never above c."""
    return logw.double().clamp(max=math.log(clip_c))


def psis_backend():
    """arviz-stats' array functions (``psislw``). The first import in a process takes ~1 s (it
    loads scipy.signal); the online probe calls this when it is made, so that its first
    measurement does not stall the training loop."""
    from arviz_stats.base import array_stats

    return array_stats


PSIS_MIN_WEIGHTS = 25  # arviz fits the tail to floor(N/5) >= 5 draws: PSIS is undefined below


class Smoothed(NamedTuple):
    """Pareto-smoothed importance weights, or why there are none."""
    log_weights: torch.Tensor | None  # smoothed log-weights on the raw weights' scale (None: undefined)
    khat: float  # the fitted tail's shape (nan when undefined); above 0.7 the weights' mean is unreliable
    note: str  # why PSIS is undefined ("" when it is defined)


def psis_smooth(logw: torch.Tensor) -> Smoothed:
    """Pareto-smoothed log-weights (all entries pooled, same shape) and k-hat (arviz-stats ``psislw``).

    arviz-stats' ``_psislw`` negates its input before fitting the right tail (it was written for
    LOO, where the input is the log-likelihood and the log-ratio is its negative), so it receives
    ``-logw``; the large weights are then the ones smoothed (tests/test_importance.py checks k-hat
    against the textbook Gaussian cases, where k = 1 - 1/sigma^2). The smoothed weights come back
    normalised; they are put back on the raw scale through the smallest weight, which smoothing never
    touches. Never raises and never substitutes other weights: undefined (fewer than 25 weights, a
    degenerate tail, an arviz error) is ``log_weights=None`` with the reason in ``note``.
    """
    import numpy as np

    flat = logw.reshape(-1).double().cpu()
    n = flat.numel()
    nan = float("nan")
    if n < PSIS_MIN_WEIGHTS:
        return Smoothed(None, nan, f"PSIS needs >= {PSIS_MIN_WEIGHTS} importance weights (B_E*G), got {n}")
    if not bool(torch.isfinite(flat).all()):
        return Smoothed(None, nan, "non-finite log-weights")
    try:
        array_stats = psis_backend()
        with np.errstate(divide="ignore", invalid="ignore"):  # degenerate fits are reported below
            lw, khat = array_stats.psislw(-flat.numpy(), r_eff=1.0)
    except Exception as e:  # an optional estimate must not lose the run
        return Smoothed(None, nan, f"the PSIS fit failed ({type(e).__name__}: {e})")
    lw = torch.as_tensor(np.asarray(lw), dtype=torch.float64)
    if not bool(torch.isfinite(lw).all()):  # e.g. tied largest weights (repeated identical responses)
        return Smoothed(None, nan, "the Pareto tail fit failed (tied or degenerate largest weights)")
    i = int(flat.argmin())
    return Smoothed((lw - lw[i] + flat[i]).view(logw.shape), float(np.asarray(khat)), "")


class TokenRatioSums(NamedTuple):
    """Additive pieces of the update's token diagnostics (sum over ranks, then divide)."""
    n_tokens: float  # response tokens
    n_finite_old: float  # of which the old log-prob is finite (not NaN / inf)
    sum_ratio: float  # sum of exp(new - old) after the NaN fill
    n_clipped: float  # tokens with ratio outside [1 - eps, 1 + eps_high]


def token_ratio_sums(new_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     eps: float, eps_high: float) -> TokenRatioSums:
    """Sums over response tokens (``mask`` 1) of the quantities behind ``token_ratio_stats``.

    Old log-probs that are not finite are counted, then replaced by the new ones (ratio 1), as
    for missing sampler log-probs (ratio 1)."""
    m = mask.bool()
    new, old = new_logp[m].double(), old_logp[m].double()
    finite = torch.isfinite(old)
    ratio = (new - torch.where(finite, old, new)).exp()
    clipped = (ratio < 1 - eps) | (ratio > 1 + eps_high)
    return TokenRatioSums(float(m.sum()), float(finite.sum()), float(ratio.sum()), float(clipped.sum()))


def token_ratio_stats_from_sums(s: TokenRatioSums) -> dict[str, float]:
    """Fractions and means from (possibly globally reduced) ``TokenRatioSums``; nan without tokens."""
    n = s.n_tokens
    nan = float("nan")
    return {"frac_old_logprobs_valid": s.n_finite_old / n if n else nan,
            "mean_importance_ratio": s.sum_ratio / n if n else nan,
            "clip_fraction": s.n_clipped / n if n else nan}


def token_ratio_stats(new_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                      eps: float, eps_high: float) -> dict[str, float]:
    """Observability of the update over response tokens: finite fraction of old log-probs (before any
    fill), mean ratio exp(new - old), and the fraction of tokens outside [1 - eps, 1 + eps_high]."""
    return token_ratio_stats_from_sums(token_ratio_sums(new_logp, old_logp, mask, eps, eps_high))


def loo_mean(x: torch.Tensor) -> torch.Tensor:
    """``mean_{h != g} x[..., h]`` along the last dimension (needs >= 2 entries)."""
    n = x.shape[-1]
    if n < 2:
        raise ValueError("a leave-one-out baseline needs >= 2 items")
    return (x.sum(-1, keepdim=True) - x) / (n - 1)


def score_coefficients(L: torch.Tensor, mode: str) -> torch.Tensor:
    """``k = dS_w / dS`` per response [B, G] of a separable functional: 1 (``sequence``), 1/L
    (``per_token_avg``); then ``f+ - f = -k l`` exactly."""
    if mode == "sequence":
        return torch.ones(L.shape, dtype=torch.float64)
    if mode == "per_token_avg":
        return 1.0 / L.double().clamp(min=1)
    raise ValueError(f"{mode!r} is not a separable functional")


def separable_change(f_orig: torch.Tensor, logw: torch.Tensor, lw_hat: torch.Tensor, k: torch.Tensor,
                     normalise: bool) -> torch.Tensor:
    """Per prompt [B] (inputs [B, G]; f at theta, l = S_upd - S_orig): ``sum_g nu_g (f+_g - beta_g) - mean_g (f_g - beta_g)
    + mean_g (w^_g - 1) lam_g`` with ``beta``, ``lam`` the leave-one-out means of f and k,
    ``w^ = exp(lw_hat)`` the estimator's weights and ``nu = w^ / G`` (cv) or ``w^ / sum_g w^``
    (``normalise``). ``f+ - f`` is taken as ``-k l`` (exact) to avoid cancelling large entropies.

    First order in l: ``-(1/G) sum_g (c_g(S_w) + c_g(k)) l_g`` with c the leave-one-out centring,
    the prediction's ``-X_n . Delta theta`` term by term (X's weights ``c((S + 1) / L) / G``)."""
    f0, l = f_orig.double(), logw.double()
    G = f0.shape[-1]
    beta, lam = loo_mean(f0), loo_mean(k.double())
    d = -k.double() * l  # f+ - f
    if normalise:
        nu = torch.softmax(lw_hat.double(), -1)
        main = (nu * d).sum(-1) + ((nu - 1.0 / G) * (f0 - beta)).sum(-1)
    else:
        main = (torch.expm1(lw_hat.double()) * (f0 - beta + d) + d).mean(-1)
    return main + (torch.expm1(lw_hat.double()) * lam).mean(-1)


def group_baselines(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
    """``b_g = x_g - F - 1/(G Lmax)`` [B, G] of the ``dr_grpo`` functional: the part of X's response
    weight ``x_g`` (``estimators.x_unit_coeffs``) built from the group's other responses only,
    ``-(mean_{h != g} S_h / Lmax_{-g} + 1/(G Lmax_{-g}))``."""
    S = S.double()
    G = S.shape[-1]
    Lm = Lmax.double().clamp(min=1).unsqueeze(-1)
    return x_unit_coeffs(S, L, Lmax, "dr_grpo") - (S / Lm).mean(-1, keepdim=True) - 1.0 / (G * Lm)


def inverse_lmax_corrections(a: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """``r_k - 1/Lmax`` [..., G] for ``a = w - 1`` and lengths L [..., G] (clamped to >= 1), where

        r_k = 1/Lmax + sum_{B} prod_{j in B} a_j (1/Lmax - 1/Lmax(outside B))

    over the nonempty sets B of responses other than k, ``Lmax(outside B)`` the longest response
    of the group not in B (k included). Given response k, ``E[r_k] = E_theta+[1/Lmax]`` (the others
    drawn at theta_plus): ``r_k = W_-k / Lmax`` minus zero-mean terms, ``prod_B a_j`` times a
    function of responses outside B (``group_change_cv``). A term is 0 unless B holds every
    longest response other than k, and every term is 0 when k is a longest response.

    With the other responses sorted longest first (o_1, o_2, ...), the sets B whose longest
    response left out is o_i are o_1..o_{i-1} plus any of the shorter ones:
    ``sum_i prod_{j<i} a_(j) prod_{j>i} w_(j) (1/Lmax - 1/max(L_k, L_(i)))``, and B = all others
    adds ``prod_j a_(j) (1/Lmax - 1/L_k)``: O(G^2) per response."""
    G = L.shape[-1]
    Lf = L.double().clamp(min=1)
    order = torch.sort(Lf, dim=-1, descending=True, stable=True).indices
    Ls, As = Lf.gather(-1, order), a.double().gather(-1, order)
    others = torch.tensor([[j for j in range(G) if j != k] for k in range(G)], device=L.device)  # [G, G-1]
    Lo, Ao = Ls[..., others], As[..., others]  # [..., G, G-1]: each response's others, longest first
    ones = torch.ones_like(Ao[..., :1])
    before = torch.cat([ones, Ao.cumprod(-1)[..., :-1]], -1)  # prod_{j<i} a_(j)
    after = torch.cat([(1 + Ao).flip(-1).cumprod(-1).flip(-1)[..., 1:], ones], -1)  # prod_{j>i} w_(j)
    inv_max = 1 / Ls[..., :1]  # [..., 1]
    left_out = (before * after * (inv_max.unsqueeze(-1) - 1 / torch.maximum(Ls.unsqueeze(-1), Lo))).sum(-1)
    corr = left_out + Ao.prod(-1) * (inv_max - 1 / Ls)
    return torch.empty_like(corr).scatter_(-1, order, corr)


def group_change_cv(S_orig: torch.Tensor, logw: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """``cv``'s per-prompt change [..., B] of the ``dr_grpo`` functional ``f = (1/G) sum_k u_k / Lmax``
    (``u = -S``; S, l = S_upd - S_orig and L [..., B, G]), each response reweighted among its
    prompt's own, with ``a = w - 1`` and r from ``inverse_lmax_corrections``::

        psi_n = (1/G) sum_k w_k u+_k r_k - f + (1/G) sum_g a_g (1 - ubar_-g) / Lmax_-g

    (``u+ = u - l``; ``ubar_-g``, ``Lmax_-g`` the mean of u and the longest length over the other
    responses; computed as ``mean_k [u_k (a_k r_k + r_k - 1/Lmax) - w_k l_k r_k]`` plus the last sum,
    without cancelling large u.)

    Unbiased for ``H+_n - H_n`` exactly: given the prompts, E's responses are independent draws from
    pi_theta and the step (from U) does not depend on them, with ``E[a_j] = sum_y pi_theta+(y) - 1 = 0``.
    So a term ``a_g`` times a function of the other responses has mean 0 (the last sum), and in
    ``r_k = W_-k / Lmax - sum_B prod_{j in B} a_j / Lmax(outside B)`` (``W_-k = prod_{j != k} w_j =
    sum_B prod_{j in B} a_j``) each subtracted term is ``prod_B a_j`` times a function of k and the
    responses outside B: mean 0 given response k. ``E[W_-k / Lmax | y_k]`` is ``E[1/Lmax | y_k]``
    with the others drawn at theta_plus (their likelihood ratio), so
    ``E[w_k u+_k r_k] = E_theta+[u+_k / Lmax]``, and the mean over k is ``H+_n``; ``E[f] = H_n``.

    Expanded in l: ``-sum_g x_g l_g`` (X's weights, term by term: the last sum makes up the part of
    x_g built from the others), then ``sum_g l_g^2 (u_g - ubar_-g - 1) / (2 G Lmax)`` and cross terms
    ``l_g l_h`` only from r, where a set B holds every longest response: none when three or more
    responses share the longest length."""
    S0, l = S_orig.double(), logw.double()
    G = S0.shape[-1]
    u, a = -S0, torch.expm1(l)
    Lf = L.double().clamp(min=1)
    inv_max = 1 / Lf.amax(-1, keepdim=True)
    corr = inverse_lmax_corrections(a, Lf)
    r = inv_max + corr
    main = (u * (a * r + corr) - (1 + a) * l * r).mean(-1)
    score = (a * (1 - loo_mean(u)) / leave_one_out_max(Lf)).sum(-1) / G
    return main + score


def group_change_normalised(f_orig: torch.Tensor, f_upd: torch.Tensor, lw_hat: torch.Tensor,
                            b: torch.Tensor) -> torch.Tensor:
    """Per prompt [..., B] of the ``dr_grpo`` functional with the group weights ``W = prod_g w^_g``
    normalised over the B prompts (f [..., B], log-weights and baselines [..., B, G]):
    ``H+ + B om_n (f+_n - H+) - f_n - sum_g (w^_g - 1)(b_g - fbar_-n)``."""
    f0, f1, lw = f_orig.double(), f_upd.double(), lw_hat.double()
    B = f0.shape[-1]
    om = torch.softmax(lw.sum(-1), -1)
    Hp = (om * f1).sum(-1, keepdim=True)
    return Hp + B * om * (f1 - Hp) - f0 - (torch.expm1(lw) * (b - loo_mean(f0).unsqueeze(-1))).sum(-1)


def psis_log_weights(logw: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Backward-compatible view of ``psis_smooth``: smoothed log-weights (normalised over all
    entries) and k-hat; raises ``ValueError`` with the reason when PSIS is undefined."""
    sm = psis_smooth(logw)
    if sm.log_weights is None:
        raise ValueError(sm.note)
    return sm.log_weights - torch.logsumexp(sm.log_weights.reshape(-1), 0), sm.khat


class PromptChange(NamedTuple):
    """A stratified estimate of the entropy change: its per-prompt contributions and summary."""
    psi: torch.Tensor  # [B] per-prompt contributions, mean = estimate
    estimate: float
    SE: float  # sd(psi) / sqrt(B)


def summarize_change(psi: torch.Tensor) -> PromptChange:
    """``mean psi`` and ``sqrt(Var(mean psi))`` (nan SE below 2 prompts or for non-finite psi)."""
    psi = psi.double()
    est = float(psi.mean())
    se = math.sqrt(mean_variance(psi)) if psi.numel() >= 2 and torch.isfinite(psi).all() else float("nan")
    return PromptChange(psi, est, se)


IS_ESTIMATORS = ("cv", "snis", "clip", "psis")


def paired_psi(S_orig: torch.Tensor, S_upd: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str,
               clip_c: float, smoothed_log_weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Every estimator's per-prompt contributions ``{name: psi [..., B]}`` (module docstring) from
    sequence log-probs at theta and theta_plus [..., B, G] (leading dimensions: independent batches);
    ``smoothed_log_weights``: ``psis_smooth(S_upd - S_orig).log_weights``. ``psis`` is NaN when that
    is None (PSIS undefined): never another estimator in its place."""
    l = S_upd.double() - S_orig.double()
    weights = {"cv": (l, False), "snis": (l, True), "clip": (clipped_log_weights(l, clip_c), True),
               "psis": (smoothed_log_weights, True)}
    if mode == "dr_grpo":
        Lm = Lmax.double().clamp(min=1).unsqueeze(-1)
        f0 = -(S_orig.double() / Lm).mean(-1)
        f1 = f0 - (l / Lm).mean(-1)  # f+ = -(1/G) sum S+ / Lmax, without cancelling S
        b = group_baselines(S_orig, L, Lmax)
        fn = lambda lw, norm: (group_change_normalised(f0, f1, lw, b) if norm  # noqa: E731
                               else group_change_cv(S_orig, l, L))
    else:
        f0 = -weighted_S(S_orig.double(), L, Lmax, mode)
        k = score_coefficients(L, mode)
        fn = lambda lw, norm: separable_change(f0, l, lw, k, norm)  # noqa: E731
    return {name: fn(lw, norm) if lw is not None else torch.full(l.shape[:-1], float("nan"), dtype=torch.float64)
            for name, (lw, norm) in weights.items()}


def sequence_rounding(S: torch.Tensor, L: torch.Tensor, eps: float) -> torch.Tensor:
    """A bound on the rounding error of a forward pass's sequence log-probs S [..., B, G] (L their
    lengths): the per-token bound ``eps (1 + |l_t| + H_t)`` (``token_importance.forward_rounding``)
    summed over the response, ``eps (L + |S| + L Hbar)``, with the token entropies H_t, which the
    sequence-level passes do not keep, replaced by the prompt's per-token entropy estimate
    ``Hbar = sum_g -S / sum_g L``."""
    S, L = S.double(), L.double()
    Hbar = (-S).sum(-1, keepdim=True).clamp(min=0) / L.sum(-1, keepdim=True).clamp(min=1)
    return eps * (L + S.abs() + L * Hbar)


def paired_changes(S_orig: torch.Tensor, S_upd: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str,
                   clip_c: float, smoothed: Smoothed) -> dict[str, PromptChange]:
    """``paired_psi`` of one batch [B, G] with each estimate and its SE (``summarize_change``)."""
    psi = paired_psi(S_orig, S_upd, L, Lmax, mode, clip_c, smoothed.log_weights)
    return {k: summarize_change(v) for k, v in psi.items()}


def stratified_ess(logw: torch.Tensor) -> torch.Tensor:
    """Kish ESS of each stratum (last dimension) ``(sum w)^2 / sum w^2`` [...]."""
    lw = logw.double() - logw.double().amax(-1, keepdim=True)
    w = lw.exp()
    return w.sum(-1) ** 2 / (w ** 2).sum(-1)
