"""Pure tensor math of the probe (no config, no I/O, no distributed calls).

Notation (docs/math.md): S[n, g] sequence log-prob of response g of prompt n, L[n, g] its
generated length, Lmax[n] = max_g L, A[n, g] the advantage; a unit is one prompt with its G
responses. Sums over prompts are called ``sum_*``, means ``*bar``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


# ---------------------------------------------------------------- probe losses (scalars built from S)
# each weighting mode's per-response quantity S_w, as the results name the entropy functional
# (``H = -E[mean over a group of S_w]``)
FUNCTIONALS = {"sequence": "S", "per_token_avg": "S / L", "dr_grpo": "S / Lmax(group)",
               "token_mean": "sum H_t / sum L over all tokens: TRL's entropy",
               "seq_mean_token_mean": "mean over responses of sum_t H_t / L"}


def functional_name(mode) -> str:
    """``dr_grpo (S / Lmax(group))``: the weighting mode and its S_w (``FUNCTIONALS``)."""
    mode = getattr(mode, "value", mode)
    return f"{mode} ({FUNCTIONALS[mode]})" if mode in FUNCTIONALS else str(mode)


def weighted_S(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str) -> torch.Tensor:
    """The entropy functional's per-response quantity S_w [n, g].

    ``sequence``: S; ``dr_grpo``: S / Lmax[n]; ``per_token_avg``: S / L[n, g]. The functionals
    built from token entropies (``token_mean``, ``seq_mean_token_mean``: math/token_functionals.py)
    have no such quantity; for them this is the sampled per-token ``S / L`` (Cui et al.'s
    covariance baseline ``delta_h_cov`` reads it).
    """
    mode = getattr(mode, "value", mode)
    if mode == "sequence":
        return S
    if mode == "dr_grpo":
        return S / Lmax.clamp(min=1).unsqueeze(-1).to(S.dtype)
    if mode in ("per_token_avg", "token_mean", "seq_mean_token_mean"):
        return S / L.clamp(min=1).to(S.dtype)
    raise ValueError(f"unknown weighting_mode {mode!r}")


def loo_centred(S_w: torch.Tensor) -> torch.Tensor:
    """``c[n, g] = S_w[n, g] - mean_{h != g} S_w[n, h]`` (leave-one-out baseline; needs G >= 2)."""
    G = S_w.shape[-1]
    if G < 2:
        raise ValueError("G must be >= 2 for the leave-one-out baseline")
    total = S_w.sum(-1, keepdim=True)
    return S_w - (total - S_w) / (G - 1)


def leave_one_out_max(L: torch.Tensor) -> torch.Tensor:
    """``Lmax_{-g}[n, g] = max_{h != g} L[n, h]`` (the group's longest response without g)."""
    G = L.shape[-1]
    others = L.unsqueeze(-2).expand(*L.shape[:-1], G, G).clone()  # [n, g, h]
    others.diagonal(dim1=-2, dim2=-1).fill_(0)
    return others.amax(-1)


def x_unit_coeffs(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-response weights w [n, G] of X_n = sum_g w[n,g] grad S[n,g], with E[X_n] = -grad H_n
    exactly in every weighting mode (values are treated as constants: detach S).

    H_n = -E[F], F = (1/G) sum_g S_w[g] over a group of G responses, so (score identity)
    ``-grad H_n = E[sum_g (F - b_g) grad S_g] + E[grad F]`` for any baseline b_g that does not
    depend on response g. With ``c`` the leave-one-out centring (``loo_centred``):

    - ``sequence`` (S_w = S): ``w = c(S) / G`` (grad F = mean_g grad S has mean 0 and is dropped);
    - ``per_token_avg`` (S_w = S / L): ``w = c((S + 1) / L) / G`` -- the LOO-centred 1/L is the
      ``grad S_w = grad S / L`` term, which does not vanish in expectation;
    - ``dr_grpo`` (S_w = S / Lmax, Lmax the group's longest response: the functional couples the
      group): ``w = F + 1/(G Lmax) - m_{-g} - 1/(G Lmax_{-g})`` with ``m_{-g} = mean_{h != g}
      S_h / Lmax_{-g}``, ``Lmax_{-g} = max_{h != g} L_h`` (baselines from the other responses only).
    All three reduce to ``c(S)/(G L)`` when every response has the same length L.
    """
    mode = getattr(mode, "value", mode)
    G = S.shape[-1]
    if G < 2:
        raise ValueError("G must be >= 2 for the leave-one-out baseline")
    S = S.detach()
    if mode == "sequence":
        return loo_centred(S) / G
    Lf = L.clamp(min=1).to(S.dtype)
    if mode == "per_token_avg":
        return loo_centred((S + 1) / Lf) / G
    if mode == "dr_grpo":
        Lm = Lmax.clamp(min=1).to(S.dtype).unsqueeze(-1)  # [n, 1]
        Lm_out = leave_one_out_max(Lf).clamp(min=1)  # [n, G]
        F = (S / Lm).mean(-1, keepdim=True)
        m_out = ((S.sum(-1, keepdim=True) - S) / (G - 1)) / Lm_out
        return F + 1 / (G * Lm) - m_out - 1 / (G * Lm_out)
    raise ValueError(f"unknown weighting_mode {mode!r}")


def x_loss(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, mode: str) -> torch.Tensor:
    """``sum_n sum_g detach(w[n,g]) * S[n,g]`` with ``w = x_unit_coeffs``: its gradient is
    ``sum_n X_n`` (E[X_n] = -grad H_n in every mode). A sum over prompts, not a mean."""
    return (x_unit_coeffs(S, L, Lmax, mode) * S).sum()


def y_loss(S: torch.Tensor, A: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
    """``sum_n (1/G) sum_g (A[n,g] / Lmax[n]) * S[n,g]``: its gradient is ``sum_n Y_n``.

    Y_n is minus the gradient of prompt n's DR-GRPO loss ``-(sum A * mask * logp) / (G * Lmax)``.
    """
    w = A.to(S.dtype) / Lmax.clamp(min=1).unsqueeze(-1).to(S.dtype)
    return (w * S).sum() / S.shape[-1]


def y_unit_coeffs(A: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
    """Per-response weights of Y_n: ``A / (G Lmax)`` [n, g]."""
    return A / Lmax.clamp(min=1).unsqueeze(-1).to(A.dtype) / A.shape[-1]


# ---------------------------------------------------------------- two-batch prediction and its variance
def delta_h1(lr: float, bars_dot: float) -> float:
    """``deltaH1 = -lr * Xbar . P . Ybar`` (X estimates -grad H; the step ascends J along P Ybar)."""
    return -lr * bars_dot


class TwoBatchVariance(NamedTuple):
    V_X: float  # variance of the E-side mean (the a_u)
    V_Y: float  # variance of the U-side mean (the b_u)
    SE: float  # sqrt(V_X + V_Y), times lr for deltaH1
    df: float  # Welch-Satterthwaite degrees of freedom of the interval
    frac_var: float
    ci95_low: float
    ci95_high: float


def mean_variance(x: torch.Tensor) -> float:
    """Variance of the sample mean: ``sum (x - mean x)^2 / (B (B - 1))``."""
    B = x.numel()
    if B < 2:
        raise ValueError("need >= 2 units for a variance")
    return float(((x - x.mean()) ** 2).sum() / (B * (B - 1)))


def propagated_bound(fn, inputs: list[torch.Tensor], bounds: list[torch.Tensor]) -> float:
    """First-order bound on the error of the scalar ``fn(*inputs)`` when every element x of the
    inputs carries an error of at most ``a`` (``bounds``, shaped like the inputs):
    ``sum_x |d fn / d x| a_x``, the gradient by autograd in fp64. A bound, not a standard deviation:
    the errors may share a sign (rounding errors of one function at nearby points do)."""
    xs = [x.detach().double().requires_grad_(True) for x in inputs]
    with torch.enable_grad():
        y = fn(*xs)
        if not torch.isfinite(y):
            return float("nan")
        if not y.requires_grad:  # it does not depend on the inputs
            return 0.0
        gs = torch.autograd.grad(y, xs, allow_unused=True)
    return float(sum((g.abs() * a.double()).nansum() for g, a in zip(gs, bounds) if g is not None))


def welch_df(parts: list[tuple[float, int]]) -> float:
    """Welch-Satterthwaite degrees of freedom of ``sum_k V_k`` for variances of means of
    ``B_k`` units: ``(sum V_k)^2 / sum V_k^2 / (B_k - 1)``; inf when every V_k is 0."""
    num = sum(max(V, 0.0) for V, _ in parts) ** 2
    den = sum(max(V, 0.0) ** 2 / (B - 1) for V, B in parts if B > 1)
    return num / den if den > 0 else math.inf


def t_quantile(df: float, level: float = 0.95) -> float:
    """Two-sided Student-t quantile ``t_{df}((1 + level)/2)`` (the normal one for df = inf)."""
    from scipy.special import ndtri, stdtrit

    q = 0.5 + level / 2
    return float(ndtri(q) if not math.isfinite(df) else stdtrit(df, q))


def interval(estimate: float, se: float, df: float, level: float = 0.95) -> tuple[float, float]:
    """``estimate -+ t_{df} SE``: a small-sample interval (t with ``df`` degrees of freedom)."""
    h = t_quantile(df, level) * se
    return estimate - h, estimate + h


def two_batch_variance(a: torch.Tensor, b: torch.Tensor, lr: float, bars_dot: float) -> TwoBatchVariance:
    """Delta-method variance of ``deltaH1`` from per-unit projections.

    a[u] = X_u . P Ybar (u in E), b[v] = Y_v . P Xbar (v in U); V_X = Var(mean a), V_Y = Var(mean b),
    SE = lr sqrt(V_X + V_Y); the 95% interval uses the Student-t quantile with Welch-Satterthwaite
    degrees of freedom (``welch_df``): per-unit projections are heavy-tailed, and at B = 8 the
    normal quantile under-covers. (The delete-1 jackknife of this bilinear statistic equals the
    delta method exactly, so it is not reported as a second estimate.)
    """
    V_X, V_Y = mean_variance(a.double()), mean_variance(b.double())
    se = lr * math.sqrt(max(V_X, 0.0) + max(V_Y, 0.0))
    df = welch_df([(V_X, a.numel()), (V_Y, b.numel())])
    d = delta_h1(lr, bars_dot)
    lo, hi = interval(d, se, df)
    return TwoBatchVariance(V_X, V_Y, se, df, (V_X + V_Y) / max(bars_dot ** 2, 1e-12), lo, hi)


# ---------------------------------------------------------------- single-batch U-statistic
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
