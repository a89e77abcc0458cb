"""Pure math of the single-batch U-statistic (docs/math.md) beyond
``estimators.u_statistic``: per-response unit weights (with optional within-prompt cross-fitting),
the deterministic partner design of the incomplete U-statistic, and its row-mean statistics.

No config, no I/O, no distributed calls. A unit u is one prompt or one block of prompts; its
vectors are X_u = sum_g cx[u, g] grad S[u, g] and Y_u = sum_g cy[u, g] grad S[u, g] (block units:
the mean of their prompts' vectors). The kernel is h(u, v) = X_u . P Y_v.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from entprobe.math.estimators import UStat, x_unit_coeffs, y_unit_coeffs


class UnitCoeffs(NamedTuple):
    cx: torch.Tensor  # [n, G] weights of X_n (detached)
    cy: torch.Tensor  # [n, G] weights of Y_n (the U-statistic's Y side)
    cy_full: torch.Tensor  # [n, G] weights of the full-group Y_n (the real update's gradient)


def cross_fit_split(G: int) -> int:
    """G1, the size of the X half under cross-fitting: the first ceil(G/2) responses (>= 2 for the
    leave-one-out baseline); Y uses the other G - G1 >= 1."""
    G1 = (G + 1) // 2
    if G1 < 2 or G - G1 < 1:
        raise ValueError(f"cross_fit needs G >= 3 (X half >= 2 for its leave-one-out baseline), got G={G}")
    return G1


def unit_coefficients(S: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, A: torch.Tensor, mode: str,
                      cross_fit: bool, cy_full: torch.Tensor | None = None) -> UnitCoeffs:
    """Per-response weights of X_n and Y_n [n, G]. ``cy_full``: the update objective's weights of
    the full-group Y_n (``objectives.unit_weights``); None: entprobe's ``A / (G Lmax)``.

    Plain: cx = ``x_unit_coeffs`` (E[X_n] = -grad H_n in the weighting mode), cy = cy_full.
    Cross-fit (modes whose functional is a mean over responses, not ``dr_grpo``):
    X from the first G1 = ceil(G/2) responses, its weights computed within that half and 0
    elsewhere; Y from the other G2 = G - G1, ``cy = cy_full G / G2`` (``A / (G2 Lmax)``) there and 0 elsewhere, with the
    batch's advantages A and group Lmax unchanged. By exchangeability of the G responses both
    halves keep the expectations of the full-group vectors (E[X^half] = E[X], E[Y^half] = E[Y]),
    so the U-statistic's target is unchanged; X_n and Y_n then share no response of prompt n.
    """
    S = S.detach()
    cy_full = y_unit_coeffs(A.to(S.dtype), Lmax) if cy_full is None else cy_full.to(S.dtype)
    if not cross_fit:
        return UnitCoeffs(x_unit_coeffs(S, L, Lmax, mode), cy_full, cy_full)
    if getattr(mode, "value", mode) == "dr_grpo":
        raise ValueError("cross_fit needs a weighting mode whose functional is a mean over responses "
                         "(sequence or per_token_avg); dr_grpo's couples the whole group through Lmax")
    G = S.shape[-1]
    G1 = cross_fit_split(G)
    cx = torch.zeros_like(S)
    cx[:, :G1] = x_unit_coeffs(S[:, :G1], L[:, :G1], Lmax, mode)
    cy = torch.zeros_like(cy_full)
    cy[:, G1:] = cy_full[:, G1:] * (G / (G - G1))
    return UnitCoeffs(cx, cy, cy_full)


def cyclic_partners(M: int, K: int) -> torch.Tensor:
    """Partner blocks [M, K]: unit u is paired (as X) with Y of units (u + 1), ..., (u + K) mod M.

    A balanced design: every unit is the X side of K pairs and the Y side of K pairs, no pair is
    repeated and no unit meets itself. K = M - 1 gives every ordered pair once (the complete U).
    """
    if not 1 <= K <= M - 1:
        raise ValueError(f"pairs_per_block={K} must be in [1, M-1] with M={M} units")
    return (torch.arange(M).unsqueeze(1) + torch.arange(1, K + 1).unsqueeze(0)) % M


def row_statistics(U: float, r: torch.Tensor) -> tuple[float, float, float, float]:
    """Plug-in and delete-1 jackknife from row means r_u, M = len(r) units.

    zeta1 = sum (r - mean r)^2 / (M - 1), SE_plugin = sqrt(4 zeta1 / M);
    U_{-u} = (M U - 2 r_u) / (M - 2), Var_jack = (M-1)/M sum (U_{-u} - mean)^2, zeta1_jack = M Var_jack / 4.
    Returns (zeta1_plugin, SE_plugin, zeta1_jack, SE_jack).
    """
    r = r.double()
    M = r.numel()
    if M < 3:
        raise ValueError("the U-statistic jackknife needs >= 3 units")
    zeta1 = float(((r - r.mean()) ** 2).sum() / (M - 1))
    U_loo = (M * U - 2 * r) / (M - 2)
    var_jack = float((M - 1) / M * ((U_loo - U_loo.mean()) ** 2).sum())
    return zeta1, math.sqrt(4 * zeta1 / M), M * var_jack / 4, math.sqrt(var_jack)


def incomplete_u_statistic(h: torch.Tensor, partners: torch.Tensor) -> UStat:
    """Incomplete U-statistic of the kernel values h[u, k] = X_u . P Y_{partners[u, k]} [M, K].

    U_inc = sum h / (M K). Every pair joins two distinct, independent units, so E[h] = E[X].P.E[Y]
    and U_inc is unbiased for the same target as the complete U (whatever the design; its variance
    is larger by O((1 - K/(M-1)) / (M K))). Row means r_u = (sum of the K pairs with u as X + the K
    pairs with u as Y) / (2K) average to U_inc, and deleting unit u removes exactly its 2K pairs,
    so U_{-u} = (M U - 2 r_u)/(M - 2) as in the complete case (``row_statistics``).
    bars_term and diag_sum are not defined here (nan); phi = 2 (r - U) as in ``u_statistic``.
    """
    h = h.double()
    M, K = h.shape
    U = float(h.mean())
    as_y = torch.zeros(M, dtype=torch.float64).index_add_(0, partners.reshape(-1), h.reshape(-1))
    r = (h.sum(1) + as_y) / (2 * K)
    z, se, zj, sej = row_statistics(U, r)
    return UStat(U, float("nan"), float("nan"), z, se, zj, sej, 2 * (r - U))


def top_units(phi: torch.Tensor, k: int) -> list[int]:
    """Indices of the k units with the largest |phi| (ties: lower index first)."""
    k = min(k, phi.numel())
    order = sorted(range(phi.numel()), key=lambda i: (-abs(float(phi[i])), i))
    return order[:k]
