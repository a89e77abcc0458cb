"""Pure tensor math of the probe (no config, no I/O, no distributed calls).

Notation (DESIGN.md §2-3): S[n, g] sequence log-prob of response g of prompt n, L[n, g] its
generated length, Lmax[n] = max_g L, A[n, g] the advantage; a unit is one prompt with its G
responses. Sums over prompts are called ``sum_*``, means ``*bar``.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch


# ---------------------------------------------------------------- probe losses (scalars built from S)
def weighted_S(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str) -> torch.Tensor:
    """The entropy functional's per-response quantity S_w [n, g].

    ``sequence``: S; ``dr_grpo``: S / Lmax[n]; ``per_token_avg``: S / L[n, g].
    """
    mode = getattr(mode, "value", mode)
    if mode == "sequence":
        return S
    if mode == "dr_grpo":
        return S / Lmax.clamp(min=1).unsqueeze(-1).to(S.dtype)
    if mode == "per_token_avg":
        return S / L.clamp(min=1).to(S.dtype)
    raise ValueError(f"unknown weighting_mode {mode!r}")


def loo_centred(S_w: torch.Tensor) -> torch.Tensor:
    """``c[n, g] = S_w[n, g] - mean_{h != g} S_w[n, h]`` (leave-one-out baseline; needs G >= 2)."""
    G = S_w.shape[-1]
    if G < 2:
        raise ValueError("G must be >= 2 for the leave-one-out baseline")
    total = S_w.sum(-1, keepdim=True)
    return S_w - (total - S_w) / (G - 1)


def x_loss(S: torch.Tensor, S_w: torch.Tensor) -> torch.Tensor:
    """``sum_n (1/G) sum_g detach(c[n,g]) * S[n,g]``: its gradient is ``sum_n X_n``.

    E[X_n] = -grad H_n exactly in ``sequence`` mode (H = -E[S]). A sum over prompts, not a mean.
    """
    c = loo_centred(S_w.detach())
    return (c * S).sum() / S.shape[-1]


def y_loss(S: torch.Tensor, A: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
    """``sum_n (1/G) sum_g (A[n,g] / Lmax[n]) * S[n,g]``: its gradient is ``sum_n Y_n``.

    Y_n is minus the gradient of prompt n's DR-GRPO loss ``-(sum A * mask * logp) / (G * Lmax)``.
    """
    w = A.to(S.dtype) / Lmax.clamp(min=1).unsqueeze(-1).to(S.dtype)
    return (w * S).sum() / S.shape[-1]


def x_unit_coeffs(S_w: torch.Tensor) -> torch.Tensor:
    """Per-response weights of X_n: ``c / G`` [n, g] (X_n = sum_g weight * grad S)."""
    return loo_centred(S_w) / S_w.shape[-1]


def y_unit_coeffs(A: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
    """Per-response weights of Y_n: ``A / (G Lmax)`` [n, g]."""
    return A / Lmax.clamp(min=1).unsqueeze(-1).to(A.dtype) / A.shape[-1]


# ---------------------------------------------------------------- two-batch prediction and its variance
def delta_h1(lr: float, bars_dot: float) -> float:
    """``deltaH1 = -lr * Xbar . P . Ybar`` (X estimates -grad H; the step ascends J along P Ybar)."""
    return -lr * bars_dot


class TwoBatchVariance(NamedTuple):
    V_X: float
    V_Y: float
    SE: float
    SE_jackknife: float
    frac_var: float
    ci95_low: float
    ci95_high: float


def mean_variance(x: torch.Tensor) -> float:
    """Variance of the sample mean: ``sum (x - mean x)^2 / (B (B - 1))``."""
    B = x.numel()
    if B < 2:
        raise ValueError("need >= 2 units for a variance")
    return float(((x - x.mean()) ** 2).sum() / (B * (B - 1)))


def jackknife_var_of_mean_product(a: torch.Tensor) -> float:
    """Delete-1 jackknife variance of ``mean(a)`` : ``(B-1)/B sum (theta_{-u} - mean theta_{-.})^2``
    with ``theta_{-u} = (B mean(a) - a_u) / (B - 1)``."""
    B = a.numel()
    loo = (a.sum() - a) / (B - 1)
    return float((B - 1) / B * ((loo - loo.mean()) ** 2).sum())


def two_batch_variance(a: torch.Tensor, b: torch.Tensor, lr: float, bars_dot: float) -> TwoBatchVariance:
    """Delta-method variance of ``deltaH1`` from per-unit projections.

    a[u] = X_u . P Ybar (u in E), b[v] = Y_v . P Xbar (v in U); V_X = Var(mean a), V_Y = Var(mean b),
    SE = lr sqrt(V_X + V_Y). The delete-1 jackknife deletes one unit of E or of U at a time; for
    this bilinear statistic it coincides with the delta method up to rounding.
    """
    V_X, V_Y = mean_variance(a.double()), mean_variance(b.double())
    se = lr * math.sqrt(max(V_X, 0.0) + max(V_Y, 0.0))
    jk = lr * math.sqrt(jackknife_var_of_mean_product(a.double()) + jackknife_var_of_mean_product(b.double()))
    d = delta_h1(lr, bars_dot)
    return TwoBatchVariance(V_X, V_Y, se, jk, (V_X + V_Y) / max(bars_dot ** 2, 1e-12),
                            d - 1.959963984540054 * se, d + 1.959963984540054 * se)


# ---------------------------------------------------------------- single-batch U-statistic (seed 001)
class UStat(NamedTuple):
    U_cross: float
    bars_term: float  # B/(B-1) Xbar.P.Ybar
    diag_sum: float  # sum_u d_u
    zeta1_plugin: float
    SE_plugin: float
    zeta1_jack: float
    SE_jack: float
    phi: torch.Tensor  # [B] influence 2 (r_u - U)


def u_statistic(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> UStat:
    """Cross-unit U-statistic of the kernel h(u, v) = X_u . P Y_v, u != v.

    With a_u = X_u.P Ybar, b_u = Y_u.P Xbar, d_u = X_u.P Y_u and m = Xbar.P.Ybar = mean(a) = mean(b):
    U = B/(B-1) m - sum d / (B(B-1)); row means r_u = (X_u.P Ybar_{-u} + Xbar_{-u}.P Y_u)/2 with
    X_u.P Ybar_{-u} = (B a_u - d_u)/(B-1); zeta1 = sample var of r; SE_plugin = sqrt(4 zeta1 / B);
    U_{-u} = (B^2 m - B a_u - B b_u + 2 d_u - sum d) / ((B-1)(B-2)); Var_jack = (B-1)/B sum (U_{-u}-mean)^2.
    """
    a, b, d = a.double(), b.double(), d.double()
    B = a.numel()
    if B < 3:
        raise ValueError("the U-statistic jackknife needs >= 3 units")
    m = a.mean()
    U = B / (B - 1) * m - d.sum() / (B * (B - 1))
    r = 0.5 * ((B * a - d) + (B * b - d)) / (B - 1)
    zeta1 = float(((r - r.mean()) ** 2).sum() / (B - 1))
    U_loo = (B * B * m - B * a - B * b + 2 * d - d.sum()) / ((B - 1) * (B - 2))
    var_jack = float((B - 1) / B * ((U_loo - U_loo.mean()) ** 2).sum())
    return UStat(float(U), float(B / (B - 1) * m), float(d.sum()), zeta1, math.sqrt(4 * zeta1 / B),
                 B * var_jack / 4, math.sqrt(var_jack), 2 * (r - U))


# ---------------------------------------------------------------- importance sampling
def ess(logw: torch.Tensor) -> float:
    """Kish effective sample size ``(sum w)^2 / sum w^2`` computed from log-weights."""
    lw = logw.double() - logw.double().max()
    w = lw.exp()
    return float(w.sum() ** 2 / (w ** 2).sum())


def snis_weights(logw: torch.Tensor) -> torch.Tensor:
    """Self-normalised weights ``w / sum w`` in the log domain (shift by max)."""
    lw = logw.double() - logw.double().max()
    w = lw.exp()
    return w / w.sum()


def clipped_log_weights(logw: torch.Tensor, clip_c: float) -> torch.Tensor:
    """``log min(w, c)`` elementwise: truncated raw weights (before normalisation), never above c."""
    return logw.double().clamp(max=math.log(clip_c))


def clipped_weights(logw: torch.Tensor, clip_c: float) -> torch.Tensor:
    """Self-normalised truncated weights ``min(w, c) / sum min(w, c)``, normalised in the log domain
    (shift by the max), so very negative log-weights do not underflow to 0/0."""
    return snis_weights(clipped_log_weights(logw, clip_c))


def psis_weights(logw: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Pareto-smoothed self-normalised weights and k-hat (arviz-stats ``psislw``).

    arviz-stats' ``_psislw`` negates its input before fitting the right tail (it was written for
    LOO, where the input is the log-likelihood and the log-ratio is its negative), so it receives
    ``-logw``; the large weights are then the ones smoothed (tests/test_importance.py checks k-hat
    against the textbook Gaussian cases, where k = 1 - 1/sigma^2). Needs >= 25 weights.
    """
    import numpy as np
    from arviz_stats.base import array_stats

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


def is_estimate(f: torch.Tensor, wn: torch.Tensor) -> float:
    """``sum_i wn_i f_i`` for normalised weights wn."""
    return float((wn * f.double()).sum())


def ratio_estimate(num: torch.Tensor, den: torch.Tensor, wn: torch.Tensor) -> float:
    """``sum wn num / sum wn den`` (per-token entropy: num = -S, den = L)."""
    return float((wn * num.double()).sum() / (wn * den.double()).sum())


class TokenRatioSums(NamedTuple):
    """Additive pieces of the seed-003 token diagnostics (sum over ranks, then divide)."""
    n_tokens: float  # response tokens
    n_finite_old: float  # of which the old log-prob is finite (not NaN / inf)
    sum_ratio: float  # sum of exp(new - old) after the NaN fill
    n_clipped: float  # tokens with ratio outside [1 - eps, 1 + eps_high]


def token_ratio_sums(new_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     eps: float, eps_high: float) -> TokenRatioSums:
    """Sums over response tokens (``mask`` 1) of the quantities behind ``token_ratio_stats``.

    Old log-probs that are not finite are counted, then replaced by the new ones (ratio 1), as
    seed 003 describes for missing sampler log-probs."""
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
    """Seed 003 observability over response tokens: finite fraction of old log-probs (before any
    fill), mean ratio exp(new - old), and the fraction of tokens outside [1 - eps, 1 + eps_high]."""
    return token_ratio_stats_from_sums(token_ratio_sums(new_logp, old_logp, mask, eps, eps_high))


def group_covariance(S_w: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``Cov_g(S_w, A)`` per prompt [n], unbiased (divides by G - 1)."""
    G = S_w.shape[-1]
    ds = S_w.double() - S_w.double().mean(-1, keepdim=True)
    da = A.double() - A.double().mean(-1, keepdim=True)
    return (ds * da).sum(-1) / (G - 1)


def delta_h_cov(lr: float, S_w: torch.Tensor, A: torch.Tensor) -> float:
    """Cui et al. 2025 (Thm. 2, natural PG) baseline at sequence level:
    ``deltaH_cov = -lr * mean_n Cov_g(S_w[n, g], A[n, g])`` over the U batch."""
    return -lr * float(group_covariance(S_w, A).mean())
