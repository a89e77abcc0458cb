"""The prediction from the step's own batch (``source="rollouts"``): a cross-prompt U-statistic of
X and the update without each prompt, its standard errors to first order through the optimizer's
Jacobian (pure math on per-prompt scalars; no config, no I/O, no distributed calls).

The batch has B prompts (units) n with X_n (E[X_n] = -grad H) and the objective's Y_n
(``Ybar = mean_n Y_n`` is minus the loss gradient). The optimizer steps on ``y = c(Ybar) Ybar``
(``c = min(1, max_norm / (|Ybar| + 1e-6))`` under gradient clipping, else 1): ``Delta theta(y)``.
The plain product ``-Xbar . Delta theta`` is biased by prompt n's own X_n.Y_n, as the single-batch
U-statistic's plain product is (docs/math.md). Instead X_n meets the update of the *other* prompts:

    deltaH_pred = -(1/B) sum_n X_n . Delta theta(y_{-n}),   Ybar_{-n} = (B Ybar - Ytilde_n) / (B - 1)

(``y_{-n}`` clipped as the trainer clips), its variance from the first-order expansion
``Delta theta(Ybar_{-n}) ~ Delta theta + K (Ybar_{-n} - Ybar)``, whose own mean is
``-[ebar + (abar - dbar) / (B - 1)]``,

with ``K = d Delta theta / d Ybar = c J (I - rho yhat yhat^T)`` when clipping is active (the clipped
step keeps its norm, ``rho = |Ybar| / (|Ybar| + 1e-6)``: only the direction moves), ``K = J``
otherwise (J the update's diagonal Jacobian in y, math/adamw.py), ``Ytilde_n = Y_n - k_n Ybar`` the
first-order influence of unit n on Ybar (k_n the objective's coupling: a token-mean normaliser or a
batch reward std; 0 otherwise), and per unit

    e_n = X_n . Delta theta,  a_n = X_n . K Ybar,  b_n = Ytilde_n . K^T Xbar,  d_n = X_n . K Ytilde_n.

X_n is independent of the other prompts, so each term is unbiased for the population's change of a
step on B - 1 prompts, and for that of a step on B prompts up to the update's curvature in Ybar times
O(1/B^2). The update without prompt n is taken exactly (its closed form at ``y_{-n}``), not by the
expansion: AdamW's update is curved enough in Ybar that the expansion's second-order remainder,
which meets X_n through Y_n, biased the prediction by a quarter of the change on the exact model
(tests/test_rollout_source.py). The expansion is a U-statistic with kernel
``h(n, m) = -[(e_n - a_n) + X_n . K Ytilde_m]``: its row means ``r_n`` (``cross_prompt``) give the
delete-1 jackknife SE of the *expected* step's change
(both sides: the X_n and the step's own sampling, as single_batch mode's). For the step actually
taken (its Y fixed), the error is the X side's, ``-(Xbar - E X) . Delta theta`` to leading order:
SE ``sd(t_n) / sqrt(B)`` with ``t_n = -X_n . Delta theta(y_{-n})`` the unit's own term
(``mean t_n = deltaH_pred``), plus at second order the covariance of each pair of prompts with its
swap, which the own terms do not carry (``pair_variance``: a prompt's X and Y share its responses).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from entprobe.math import estimators as est
from entprobe.math.ustat import row_statistics

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6)


class UnitDots(NamedTuple):
    """Per prompt [B] (fp64), the dots the stage computes on the model's device."""
    e: torch.Tensor  # [B, parts] X_n . Delta theta_part (the update's parts, in order)
    xjy: torch.Tensor  # X_n . J y
    yy: torch.Tensor  # Y_n . y
    yjx: torch.Tensor  # Y_n . J Xbar
    xjyn: torch.Tensor  # X_n . J Y_n
    e_loo: torch.Tensor  # [B, parts] X_n . Delta theta_part(y_{-n}), the update without prompt n
    pairs: torch.Tensor | None = None  # [B, B] X_n . J Y_m (None: not computed, see ``pair_variance``)


def leave_one_out(ybar: torch.Tensor, Y: torch.Tensor, k: float, B: int) -> torch.Tensor:
    """``Ybar_{-n} = (B Ybar - Ytilde_n) / (B - 1)``, ``Ytilde_n = Y_n - k_n Ybar``: the batch's gradient
    without prompt n (exact for uncoupled objectives; first order in the coupling otherwise)."""
    return (ybar * (B + k) - Y) / (B - 1)


def clip_coefficient(ybar_norm: float, max_grad_norm: float | None) -> float:
    """``c`` with ``y = c Ybar``: ``min(1, max_norm / (|Ybar| + 1e-6))`` (torch's clip_grad_norm_), 1 unclipped."""
    if not max_grad_norm:
        return 1.0
    return min(1.0, max_grad_norm / (ybar_norm + CLIP_EPS))


class KernelTerms(NamedTuple):
    a: torch.Tensor  # X_n . K Ybar
    b: torch.Tensor  # Ytilde_n . K^T Xbar
    d: torch.Tensor  # X_n . K Ytilde_n


def clip_projection(ybar_norm: float, max_grad_norm: float | None) -> float:
    """``rho`` of the clipped step's Jacobian ``dy/dYbar = c (I - rho yhat yhat^T)``: with
    ``c = max_norm / (|Ybar| + 1e-6)``, ``rho = |Ybar| / (|Ybar| + 1e-6)``; 0 when the step is not clipped."""
    if clip_coefficient(ybar_norm, max_grad_norm) >= 1.0:
        return 0.0
    return ybar_norm / (ybar_norm + CLIP_EPS)


def kernel_terms(dots: UnitDots, y_norm: float, c: float, rho: float,
                 coupling: torch.Tensor | None) -> KernelTerms:
    """``a_n, b_n, d_n`` (module docstring) for ``K = c J (I - rho yhat yhat^T)`` (``rho`` 0 unclipped,
    ``clip_projection`` clipped), from the raw dots, with ``Ybar = y / c``, ``J Ybar = J y / c``,
    ``yhat = y / |y|`` and ``Ytilde_n = Y_n - k_n Ybar``:

    ``a = (1 - rho) X.Jy``;  ``b = c [Ytilde.JXbar - rho (yhat.Ytilde)(yhat.JXbar)]``;
    ``d = c [X.J Ytilde - rho (X.J yhat)(yhat.Ytilde)]``, where ``c Ytilde.JXbar = c Y.JXbar - k Xbar.Jy``,
    ``c X.J Ytilde = c X.JY - k X.Jy``, ``yhat.Ytilde = Y.y / |y| - k |y| / c``,
    ``yhat.JXbar = mean(X.Jy) / |y|`` and ``X.J yhat = X.Jy / |y|``.
    """
    k = torch.zeros_like(dots.xjy) if coupling is None else coupling.to(dots.xjy.device, torch.float64)
    mean_xjy = dots.xjy.mean()  # Xbar . J y
    b = c * dots.yjx - k * mean_xjy
    d = c * dots.xjyn - k * dots.xjy
    if rho:
        if y_norm == 0:
            raise ValueError("a clipped step with a zero gradient")
        yhat_yt = dots.yy / y_norm - k * y_norm / c
        b = b - c * rho * yhat_yt * mean_xjy / y_norm
        d = d - c * rho * dots.xjy / y_norm * yhat_yt
    return KernelTerms((1.0 - rho) * dots.xjy, b, d)


class CrossPrompt(NamedTuple):
    U: float  # deltaH_pred = mean t
    own: torch.Tensor  # [B] t_n = -X_n . Delta theta(y_{-n}), unit n's own term
    rows: torch.Tensor  # [B] r_n, the linearised kernel's row means, shifted to mean U


def cross_prompt(e_loo: torch.Tensor, e: torch.Tensor, kt: KernelTerms) -> CrossPrompt:
    """``U = -mean_n e_loo_n`` (``e_loo_n = X_n . Delta theta(y_{-n})``, the exact update without
    prompt n) and, for its SEs, the row means of the linearised kernel
    ``h(n, m) = -[(e_n - a_n) + X_n . K Ytilde_m]`` over ordered pairs n != m:
    ``sum_{m != n} h(n, m) = -[(B-1)(e_n - a_n) + B a_n - d_n]``, ``sum_{m != n} h(m, n) =
    -[B (ebar - abar) - (e_n - a_n) + B b_n - d_n]`` (``bbar = abar``: both are ``Xbar . K Ybar``), their
    sum over ``2 (B - 1)``. The linearised U (the rows' mean) differs from U at second order in the
    step's dependence on one prompt; the rows are shifted by that difference (the jackknife reads
    their spread only). ``e`` [B]: the projection onto the whole update at y, or onto one of its parts
    with ``kt`` zero for the parts that do not depend on Ybar."""
    e_loo, e, a, b, d = (t.double() for t in (e_loo, e, kt.a, kt.b, kt.d))
    B = e.numel()
    if B < 3:
        raise ValueError(f"{B} prompts: the cross-prompt U-statistic's jackknife needs >= 3")
    s1 = -((B - 1) * (e - a) + B * a - d)
    s2 = -(B * (e.mean() - a.mean()) - (e - a) + B * b - d)
    rows = (s1 + s2) / (2 * (B - 1))
    U = -float(e_loo.mean())
    return CrossPrompt(U, -e_loo, rows - rows.mean() + U)


def zero_terms(like: torch.Tensor) -> KernelTerms:
    z = torch.zeros_like(like, dtype=torch.float64)
    return KernelTerms(z, z, z)


MAX_SPLITS = 256  # halves averaged by ``pair_variance`` (all of them up to B = 11)


def half_splits(B: int) -> torch.Tensor:
    """Boolean masks [S, B] of splits of B units into two halves (sizes floor(B/2), ceil(B/2)), unit 0
    always in the first: every split up to ``MAX_SPLITS`` of them, else ``MAX_SPLITS`` drawn with a
    fixed seed (the same for every batch of B)."""
    import itertools

    half = B // 2
    n_all = math.comb(B - 1, half - 1)
    if n_all <= MAX_SPLITS:
        combos = [(0,) + c for c in itertools.combinations(range(1, B), half - 1)]
    else:
        gen = torch.Generator().manual_seed(B)
        combos = [(0,) + tuple((1 + torch.randperm(B - 1, generator=gen)[:half - 1]).tolist()) for _ in range(MAX_SPLITS)]
    masks = torch.zeros((len(combos), B), dtype=torch.bool)
    for i, c in enumerate(combos):
        masks[i, list(c)] = True
    return masks


def _double_centred(Z: torch.Tensor) -> torch.Tensor:
    """Each [..., n, m] block minus its row and column means plus its grand mean."""
    return Z - Z.mean(-2, keepdim=True) - Z.mean(-1, keepdim=True) + Z.mean((-2, -1), keepdim=True)


def pair_variance(dots: UnitDots, y_norm: float, c: float, rho: float, coupling: torch.Tensor | None) -> float:
    """The part of ``Var(deltaH_pred - deltaH_step)`` (the error against the step taken) that the
    prompts' own terms miss. To second order the error is

        -(1/B) sum_n (X_n - E X) . Delta theta  -  1/(B(B-1)) sum_{n != m} h_nm,   h_nm = (X_n - E X) . K (Ytilde_m - E Ytilde)

    and the spread of the own terms ``t_n`` carries the first sum and the second's ``E h_nm^2`` (through
    the other prompts' noise in ``Delta theta(y_{-n})``), not the covariance of a pair with its swap,
    ``E[h_nm h_mn] = tr(K C K C)`` with ``C = Cov(X_n, Ytilde_n)`` (large when a prompt's X and Y come
    from the same responses):

        V_pair = tr(K C K C) / (B (B - 1)).

    ``tr(K C K C)`` is a product of two covariances: estimated without bias from two disjoint halves
    a, b of the batch, ``tr(K C_a K C_b)`` with each half's own sample covariance,
    ``sum_{n in a, m in b} M^ab_nm M^ba_mn / ((|a| - 1)(|b| - 1))``, ``M^ab_nm = (X_n - Xbar_a) . K
    (Ytilde_m - Ytilde_b)`` (the a x b block of ``A_nm = X_n . K Ytilde_m``, doubly centred), averaged
    over the splits of ``half_splits`` (centring on the whole batch's means instead would add each
    prompt's own X_n . K Y_n, whose mean is not 0: several times the term on the exact model).
    ``A_nm = c [P_nm - k_m X_n.J Ybar - rho (X_n.J yhat)(yhat.Ytilde_m)]`` from ``P_nm = X_n . J Y_m``
    (``dots.pairs``), ``X_n.J Ybar = X_n.Jy / c``, ``X_n.J yhat = X_n.Jy / |y|`` and ``yhat.Ytilde_m =
    Y_m.y / |y| - k_m |y| / c`` (kernel_terms' K). 0 without ``dots.pairs`` or below 4 prompts."""
    if dots.pairs is None or dots.pairs.shape[0] < 4:
        return 0.0
    P = dots.pairs.double().cpu()
    B = P.shape[0]
    k = torch.zeros(B, dtype=torch.float64) if coupling is None else coupling.cpu().double()
    xjy = dots.xjy.double().cpu()
    A = P - xjy[:, None] * k[None, :] / c
    if rho:
        yhat_yt = dots.yy.double().cpu() / y_norm - k * y_norm / c
        A = A - rho * (xjy / y_norm)[:, None] * yhat_yt[None, :]
    A = c * A
    splits = half_splits(B)
    order = torch.argsort((~splits).to(torch.int8), dim=1, stable=True)  # each split's half a, then b
    na = int(splits[0].sum())
    ia, ib = order[:, :na], order[:, na:]
    Mab = _double_centred(A[ia[:, :, None], ib[:, None, :]])  # [S, |a|, |b|]
    Mba = _double_centred(A[ib[:, :, None], ia[:, None, :]])  # [S, |b|, |a|]
    trace = (Mab * Mba.transpose(1, 2)).sum((1, 2)) / ((na - 1) * (B - na - 1))
    return float(trace.mean()) / (B * (B - 1))


def standard_errors(cp: CrossPrompt, pair_var: float = 0.0) -> dict:
    """``SE_step`` (the step taken: the X side, ``sqrt(Var(mean t) + V_pair)``, ``pair_variance``
    floored at 0) and the jackknife and plug-in SEs of the U-statistic (``SE_expected``: the mean
    change of a fresh batch's step, both sides)."""
    _, se_plugin, _, se_jack = row_statistics(cp.U, cp.rows)
    return {"SE_step": math.sqrt(est.mean_variance(cp.own) + max(pair_var, 0.0)), "SE_expected": se_jack,
            "SE_plugin": se_plugin}


def unit_mean_rows(f: torch.Tensor) -> torch.Tensor:
    """Row means of a statistic that is the mean of per-unit values f_n (a kernel of its first
    argument only), ``[(B - 2) f_n + B fbar] / (2 (B - 1))``: combined with ``cross_prompt``'s rows,
    the jackknife of a sum of such statistics (``row_statistics``)."""
    f = f.double()
    B = f.numel()
    return ((B - 2) * f + B * f.mean()) / (2 * (B - 1))
