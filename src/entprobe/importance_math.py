"""Importance-sampling math of the ground truth (docs/math.md): pure functions
on tensors, no config, no I/O, no distributed calls.

The measured change is ``H(theta_plus) - H(theta)`` on E's responses, drawn at theta and
reweighted by ``w = pi_theta_plus / pi_theta = exp(S_upd - S_orig)``. The target is the mean over
prompts of each prompt's entropy, so every estimate is *stratified*: a prompt's responses are
reweighted among themselves, never against another prompt's (normalising over all B*G samples at
once lets the prompts with the largest mean log-weight dominate: between-prompt noise).

Per prompt n (units for the standard error), with f = -S_w at theta and f+ = -S_w at theta_plus:
- ``cv`` (default, exactly unbiased for every G >= 2): unnormalised IS with a leave-one-out
  control variate, ``psi_n = mean_g [w_g (f+_g - beta_g) - (f_g - beta_g)]``,
  ``beta_g = mean_{h != g} f_h``. E[w_g | prompt] = 1 and beta_g is independent of response g, so
  ``E[psi_n] = H_n(theta_plus) - H_n(theta)`` exactly.
- ``snis``: self-normalised within the prompt, ``psi_n = sum_g wn_g f+_g - mean_g f_g`` with
  ``wn = w / sum_g w`` (bias O(Var(w)/G): negligible for small steps, not at low ESS);
  ``clip``: the same with ``min(w, clip_c)``; ``psis``: with Pareto-smoothed weights (the tail is
  fitted on all log-weights pooled, then each prompt normalises its own).
``dr_grpo`` couples a prompt's G responses through Lmax, so its functional is a function of the
whole group: the item is the group (f = -(1/G) sum_g S_g / Lmax, log-weight = sum_g logw_g), one per
prompt. ``cv`` then takes its baseline from the other prompts (leave-one-prompt-out, still exactly
unbiased); ``snis``/``clip``/``psis`` normalise the group weights over the batch and report the
ratio estimator's linearisation per prompt.
The estimate is ``mean_n psi_n`` and its SE ``sd(psi) / sqrt(B)`` (prompts are independent).
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from entprobe.estimators import mean_variance

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


def psis_weights(logw: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Pareto-smoothed self-normalised weights and k-hat (arviz-stats ``psislw``).

    arviz-stats' ``_psislw`` negates its input before fitting the right tail (it was written for
    LOO, where the input is the log-likelihood and the log-ratio is its negative), so it receives
    ``-logw``; the large weights are then the ones smoothed (tests/test_importance.py checks k-hat
    against the textbook Gaussian cases, where k = 1 - 1/sigma^2). Needs >= 25 weights.
    """
    import numpy as np

    array_stats = psis_backend()
    if logw.numel() < 25:  # arviz fits the tail to floor(N/5) >= 5 draws: PSIS is undefined below
        warnings.warn(f"PSIS needs >= 25 importance weights, got {logw.numel()}: psis = SNIS, k-hat = nan")
        return snis_weights(logw), float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):  # degenerate fits are handled below
        lw, khat = array_stats.psislw(-logw.double().cpu().numpy(), r_eff=1.0)
    lw = torch.as_tensor(np.asarray(lw), dtype=torch.float64)
    if not torch.isfinite(lw).all():  # degenerate tail fit (sigma <= 0), e.g. tied weights from
        # repeated identical responses: arviz returns all-NaN log-weights
        warnings.warn("PSIS tail fit failed (tied or degenerate largest weights): psis = SNIS, k-hat = nan")
        return snis_weights(logw), float("nan")
    w = (lw - lw.max()).exp()
    return w / w.sum(), float(np.asarray(khat))


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


def cv_change(f_orig: torch.Tensor, f_upd: torch.Tensor, logw: torch.Tensor) -> torch.Tensor:
    """Per item ``w (f+ - beta) - (f - beta)``, ``beta`` the leave-one-out mean of f over the last
    dimension (the items of one stratum). Its mean over a stratum's items is exactly unbiased for
    the stratum's ``E_{theta+}[f] - E_theta[f]`` (E[w] = 1; beta is independent of the item)."""
    beta = loo_mean(f_orig.double())
    return logw.double().exp() * (f_upd.double() - beta) - (f_orig.double() - beta)


def snis_change(f_orig: torch.Tensor, f_upd: torch.Tensor, log_wt: torch.Tensor) -> torch.Tensor:
    """Per stratum (last dimension normalised): ``sum wn f+ - mean f``, ``wn = softmax(log_wt)``."""
    wn = torch.softmax(log_wt.double(), -1)
    return (wn * f_upd.double()).sum(-1) - f_orig.double().mean(-1)


def snis_change_influence(f_orig: torch.Tensor, f_upd: torch.Tensor, log_wt: torch.Tensor) -> torch.Tensor:
    """One stratum of I items (1-D inputs) normalised together: per item the linearisation
    ``psi_i = H+ + I wn_i (f+_i - H+) - f_i`` of the ratio estimator ``H+ - mean f``
    (``H+ = sum wn f+``); ``mean psi`` is the estimate, ``sd(psi)/sqrt(I)`` its delta-method SE."""
    wn = torch.softmax(log_wt.double(), -1)
    Hp = (wn * f_upd.double()).sum()
    return Hp + wn.numel() * wn * (f_upd.double() - Hp) - f_orig.double()


def psis_log_weights(logw: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Pareto-smoothed log-weights (same shape, fitted on all entries pooled) and k-hat. Never
    raises: a fit that fails (too few weights, tied tail, arviz errors) warns and returns the raw
    log-weights with k-hat nan."""
    flat = logw.reshape(-1).double()
    try:
        wn, khat = psis_weights(flat)
    except Exception as e:  # an optional diagnostic must not lose the run
        warnings.warn(f"PSIS failed ({type(e).__name__}: {e}); psis = raw weights, k-hat = nan")
        return logw.double(), float("nan")
    return wn.log().view(logw.shape), khat


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


def prompt_changes(f_orig: torch.Tensor, f_upd: torch.Tensor, logw: torch.Tensor, smoothed: torch.Tensor,
                   group: bool, clip_c: float) -> dict[str, PromptChange]:
    """Every estimator's per-prompt change (``smoothed``: PSIS log-weights, ``psis_log_weights``).

    ``group`` False: inputs [B, G], responses are the items of prompt n's stratum. ``group`` True
    (dr_grpo): inputs [B], one item (the group) per prompt, all prompts one stratum."""
    out = {}
    clipped = clipped_log_weights(logw, clip_c)
    if group:
        out["cv"] = cv_change(f_orig, f_upd, logw)
        for name, lw in (("snis", logw), ("clip", clipped), ("psis", smoothed)):
            out[name] = snis_change_influence(f_orig, f_upd, lw)
    else:
        out["cv"] = cv_change(f_orig, f_upd, logw).mean(-1)
        for name, lw in (("snis", logw), ("clip", clipped), ("psis", smoothed)):
            out[name] = snis_change(f_orig, f_upd, lw)
    return {k: summarize_change(v) for k, v in out.items()}


def stratified_ess(logw: torch.Tensor) -> torch.Tensor:
    """Kish ESS of each stratum (last dimension) ``(sum w)^2 / sum w^2`` [...]."""
    lw = logw.double() - logw.double().amax(-1, keepdim=True)
    w = lw.exp()
    return w.sum(-1) ** 2 / (w ** 2).sum(-1)
