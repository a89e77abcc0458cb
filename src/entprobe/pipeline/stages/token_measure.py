"""The measured change when X is in per-token form or the functional is built from token entropies
(``XSpec.tokens``, ``token_mean``, ``seq_mean_token_mean``): the estimators of math/token_importance.py
on E's token log-probs and entropies at theta and theta_plus, in the layout ``importance_estimates``
returns (``deltaH_<est>``, ``SE_deltaH_<est>``, ``H_upd_<est>``, weight diagnostics) and the
per-prompt contributions ``{est: psi [B]}`` for the paired test.

Which estimator: the Rao-Blackwellised X (``sequence``, ``token_mean``) pairs with the per-decision
estimator (``cv``; ``snis`` normalised per position; ``clip``, as snis with truncated weights); the
score-form X and ``seq_mean_token_mean`` pair with the whole-response one (``cv``, ``snis``, ``clip``,
``psis``). ``ESS_frac`` is that of the
weights the estimator uses (``ESS_frac_per_decision`` or the whole responses' ``ESS_frac_sequence``;
both are reported).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from entprobe.math import estimators as est
from entprobe.math import importance as im
from entprobe.math import token_functionals as tf
from entprobe.math import token_importance as ti
from entprobe.pipeline.stages.x_spec import PER_DECISION_IS_MODES, XSpec

PER_DECISION_ESTIMATORS = PER_DECISION_IS_MODES


class TokenSide(NamedTuple):
    """E's responses at theta (0) and theta_plus (1), gathered over ranks, [B, G, T] (mask m)."""
    lp0: torch.Tensor
    lp1: torch.Tensor
    H0: torch.Tensor
    H1: torch.Tensor
    m: torch.Tensor


def offered_estimators(spec: XSpec) -> tuple[str, ...]:
    """The ``importance.is_mode`` values this X's measured side offers."""
    return PER_DECISION_ESTIMATORS if spec.estimator == "rao_blackwell" else im.IS_ESTIMATORS


def functional_at_theta(tok: TokenSide, spec: XSpec) -> tuple[float, float, dict]:
    """The functional's value on E at theta with its SE over prompts, and token_mean's (N, D)."""
    m = tok.m.double()
    per_resp = tf.functional_values(tok.H0, m, spec.mode)  # [B, G]
    if spec.mode == "token_mean":
        N, D, Phi = tf.token_mean_stats(tok.H0, m)
        Ls = m.sum(-1).mean(-1)
        infl = (per_resp.mean(-1) - Phi * Ls) / D  # the ratio's influence per prompt
        se = math.sqrt(est.mean_variance(infl)) if infl.numel() > 1 else math.nan
        return Phi, se, {"N": N, "D": D}
    h = per_resp.mean(-1)
    return float(h.mean()), math.sqrt(est.mean_variance(h)) if h.numel() > 1 else math.nan, {}


def token_importance_estimates(tok: TokenSide, spec: XSpec, clip_c: float, warn_psis: bool = True,
                               eps_forward: float = torch.finfo(torch.float32).eps
                               ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Flat results and per-prompt contributions of every offered estimator (module docstring);
    ``rounding_deltaH_<est>``: a bound on what the forward passes' rounding (working precision
    ``eps_forward``) moves each estimate (``ti.forward_rounding`` propagated to first order)."""
    import warnings

    m = tok.m.double()
    l = ((tok.lp1.double() - tok.lp0.double()) * m).sum(-1)  # [B, G]
    H0, se_H0, nd = functional_at_theta(tok, spec)
    smoothed = im.psis_smooth(l)
    per_decision = spec.estimator == "rao_blackwell"
    if not per_decision and smoothed.note and warn_psis:
        warnings.warn(f"importance.is_mode=psis: PSIS is undefined here ({smoothed.note}); deltaH_psis is "
                      "NaN and the measurement unmeasurable: use importance.is_mode=cv", stacklevel=2)
    out = {"H_orig": H0, "SE_H_orig": se_H0,
           "H_orig_per_token": float(-(tok.lp0.double() * m).sum() / m.sum())}
    psi: dict[str, torch.Tensor] = {}
    kappa = spec.kappa if spec.mode == "token_mean" else None
    a0, a1 = ti.forward_rounding(tok.lp0, tok.H0, m, eps_forward), ti.forward_rounding(tok.lp1, tok.H1, m, eps_forward)
    for name in offered_estimators(spec):
        psi[name] = ti.change_psi(tok.lp0, tok.lp1, tok.H0, tok.H1, m, spec.mode, per_decision, name, clip_c,
                                  kappa, smoothed.log_weights)
        ch = im.summarize_change(psi[name])
        fn = lambda l0, l1, h0, h1, name=name: ti.change_psi(l0, l1, h0, h1, m, spec.mode, per_decision, name,  # noqa: E731
                                                             clip_c, kappa, smoothed.log_weights).mean()
        out.update({f"deltaH_{name}": ch.estimate, f"SE_deltaH_{name}": ch.SE, f"H_upd_{name}": H0 + ch.estimate,
                    f"rounding_deltaH_{name}": est.propagated_bound(fn, [tok.lp0, tok.lp1, tok.H0, tok.H1],
                                                                    [a0, a1, a0, a1])})
    # the per-token entropy of the responses' sampled log-probs (reported in every mode)
    wn = torch.softmax(l, -1)
    Lf = m.sum(-1)
    S1 = ((tok.lp1.double()) * m).sum(-1)
    out["H_upd_per_token"] = float((wn * -S1).sum() / (wn * Lf).sum())
    out["deltaH_per_token"] = out["H_upd_per_token"] - out["H_orig_per_token"]
    seq_ess = float(im.stratified_ess(l).mean()) / l.shape[1]
    pd_ess = ti.per_decision_ess_frac(tok.lp1 - tok.lp0, m)
    ess = pd_ess if per_decision else seq_ess
    w = l.exp()
    N = l.numel()
    out.update({"ESS_frac": ess, "ESS": ess * N, "ESS_frac_sequence": seq_ess, "ESS_frac_per_decision": pd_ess,
                "psis_khat": smoothed.khat, "is/N": N, "is/stratified_by": "prompt",
                "is/weights": "per_decision" if per_decision else "sequence",
                "is/w_min": float(w.min()), "is/w_max": float(w.max()),
                "is/logw_std": float(l.std()) if N > 1 else 0.0, "is/mean_importance_ratio": float(w.mean()),
                "is/frac_old_logprobs_valid": float(torch.isfinite(l).double().mean()),
                "is/clip_fraction": float((w > clip_c).double().mean())})
    if smoothed.note:
        out["psis_khat_note"] = smoothed.note
    return out, psi


def resampled_token_change(mode: str, H1: torch.Tensor, m1: torch.Tensor, H0: torch.Tensor, m0: torch.Tensor) -> dict:
    """``deltaH_resample`` of a token functional from the fresh responses' entropies at theta_plus and
    E's at theta [B, G, T] (prompts are the units: a prompt's two groups are independent draws): per
    prompt the difference of the two groups' values; for ``token_mean`` the change of the ratio
    ``Phi+ - Phi``, with per-prompt contributions ``Phi+ - Phi + (N+_n - Phi+ D+_n) / D+ - (N_n - Phi D_n) / D``
    (each group's influence on its ratio: their mean is the change)."""
    m1, m0 = m1.double(), m0.double()
    f1, f0 = tf.functional_values(H1, m1, mode).mean(-1), tf.functional_values(H0, m0, mode).mean(-1)  # [B]
    if mode == "token_mean":
        (_, D1, P1), (_, D0, P0) = tf.token_mean_stats(H1, m1), tf.token_mean_stats(H0, m0)
        d = (P1 - P0) + (f1 - P1 * m1.sum(-1).mean(-1)) / D1 - (f0 - P0 * m0.sum(-1).mean(-1)) / D0
    else:
        d = f1 - f0
    ch = im.summarize_change(d)
    lo, hi = est.interval(ch.estimate, ch.SE, d.numel() - 1)
    return {"deltaH_resample": ch.estimate, "SE_deltaH_resample": ch.SE, "ci95_resample_low": lo,
            "ci95_resample_high": hi}
