"""What-if predictions: the pure math behind ``probe.what_if`` (docs/what_if.md). No config, no I/O.

The probe predicts ``deltaH_pred = -Xbar_E . Delta theta(Ybar_U)`` for the step the user's optimizer
takes. Under another setting the step is ``Delta theta_s``; its prediction is ``-Xbar_E . Delta
theta_s`` with the E-side SE of its per-prompt contributions ``e_n = -X_n . Delta theta_s`` (given U,
the prediction is linear in Xbar: exactly unbiased for ``grad H . Delta theta_s``).

- lr x f: AdamW's update ``-lr (m_hat / (sqrt(v_hat) + eps) + wd theta)`` (and SGD's, and
  ``lr P Ybar``) is linear in lr at a fixed gradient, so ``Delta theta_s = f Delta theta`` and the
  prediction, its per-prompt contributions and its SE all scale by f exactly (``lr_scaled``).
- the lr for a target change: ``lr* = lr target / deltaH_pred`` (``lr_for_target``).
- Clip-Cov / KL-Cov: verl's token selections (``clip_cov_selection``, ``kl_cov_selection``);
  TRL's ``top_entropy_quantile`` (``high_entropy_mask``).
"""
from __future__ import annotations

import math

import torch

from entprobe.math import estimators as est


def summary(values: torch.Tensor) -> dict:
    """``deltaH_pred`` (the mean of the per-prompt contributions ``values`` [B_E]), its SE
    ``sd / sqrt(B_E)`` and the Student-t 95% interval with B_E - 1 degrees of freedom."""
    v = values.double()
    pred = float(v.mean())
    se = math.sqrt(est.mean_variance(v)) if v.numel() > 1 else math.nan
    lo, hi = est.interval(pred, se, v.numel() - 1)
    return {"deltaH_pred": pred, "SE": se, "ci95_low": lo, "ci95_high": hi, "df": v.numel() - 1}


def lr_scaled(base: dict, f: float) -> dict:
    """The prediction at lr x f from the one at lr (``deltaH_pred``, ``SE``, ``ci95_low/high``):
    value and SE times f exactly (the update is linear in lr at a fixed gradient); a negative f
    would swap the interval's ends, so they are sorted."""
    lo, hi = sorted((base["ci95_low"] * f, base["ci95_high"] * f))
    return {"deltaH_pred": base["deltaH_pred"] * f, "SE": base["SE"] * f, "ci95_low": lo, "ci95_high": hi,
            "df": base.get("df")}


def lr_for_target(lr: float, pred: float, se: float, ci_low: float, ci_high: float, target: float) -> dict:
    """The lr whose predicted change is ``target``: ``lr* = lr target / pred`` (the prediction is
    linear in lr). Its 95% interval is the exact image of the prediction's t interval under the
    monotone map ``p -> lr target / p`` (Fieller's interval for a ratio whose numerator is known:
    when the interval holds no 0 it maps to ``[lr target / hi, lr target / lo]``, sorted); its SE
    the delta method's ``|lr*| SE / |pred|``. ``status``: ``resolved``, or why no lr is determined
    (the interval holds 0, or there is none: the sign of the change is not known; or the
    prediction's sign is not the target's: no lr > 0 reaches it)."""
    out = {"target_deltaH": target, "lr": lr, "lr_star": math.nan, "SE_lr_star": math.nan,
           "ci95_lr_low": math.nan, "ci95_lr_high": math.nan}
    if not (math.isfinite(pred) and math.isfinite(ci_low) and math.isfinite(ci_high)):
        return {**out, "status": "not resolved: the prediction has no 95% interval (probe.variance_enabled=false, "
                                 "or B_E = 1), so the sign of the change is not known"}
    if ci_low <= 0.0 <= ci_high:
        return {**out, "status": "not resolved: the prediction's 95% interval holds 0, so no lr is determined"}
    if (pred > 0) != (target > 0):
        return {**out, "status": f"not resolved: the predicted change has the other sign ({pred:+.3g}) than the "
                                 f"target ({target:+.3g}): no lr > 0 reaches it with this step"}
    star = lr * target / pred
    lo, hi = sorted((lr * target / ci_high, lr * target / ci_low))
    return {**out, "lr_star": star, "SE_lr_star": abs(star) * se / abs(pred), "ci95_lr_low": lo,
            "ci95_lr_high": hi, "status": "resolved"}


def centred_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s per-token covariance ``(logp - mean logp)(A - mean A)``, means over the masked
    tokens of the batch ([..., T] inputs, A broadcast over a response's tokens; fp64)."""
    m = mask.bool()
    lp, a = logp.double(), adv.double()
    return (lp - lp[m].mean()) * (a - a[m].mean())


def clip_cov_selection(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, ratio: float, lb: float,
                       ub: float, generator: torch.Generator) -> torch.Tensor:
    """The tokens whose policy gradient Clip-Cov detaches (verl ``compute_policy_loss_clip_cov``):
    among the masked tokens whose centred covariance lies in the open interval ``(lb, ub)``, a
    uniformly random ``max(int(ratio N), 1)`` (N the masked tokens; all of them when fewer are
    eligible). On the first step from on-policy samples the ratio is 1, so verl's PPO-clip
    exclusion (``clip_by_origin``) selects nothing and is left out. Returns a bool mask like ``mask``."""
    m = mask.bool()
    cov = centred_covariance(logp, adv, mask)
    eligible = ((cov > lb) & (cov < ub) & m).reshape(-1).nonzero().squeeze(-1)
    n = max(int(ratio * int(m.sum())), 1)
    pick = eligible[torch.randperm(eligible.numel(), generator=generator)[:n]]
    out = torch.zeros(m.numel(), dtype=torch.bool)
    out[pick] = True
    return out.view(m.shape)


def kl_cov_selection(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """The tokens KL-Cov penalises with ``ppo_kl_coef |logp - old_logp|`` (verl
    ``compute_policy_loss_kl_cov``): the ``max(1, int(ratio N))`` masked tokens of largest centred
    covariance. Returns a bool mask like ``mask``. At the first step from on-policy samples
    ``logp == old_logp``, where ``|.|`` has (sub)gradient 0 in torch: the selection changes the
    loss's value and gradient by exactly nothing there."""
    m = mask.bool()
    cov = centred_covariance(logp, adv, mask).reshape(-1)
    idx = m.reshape(-1).nonzero().squeeze(-1)
    n = min(max(1, int(idx.numel() * ratio)), idx.numel())
    top = idx[torch.topk(cov[idx], n, largest=True).indices]
    out = torch.zeros(m.numel(), dtype=torch.bool)
    out[top] = True
    return out.view(m.shape)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The tokens TRL ``GRPOTrainer`` keeps with ``top_entropy_quantile = quantile``
    (``get_high_entropy_mask(entropies, mask, 1 - quantile)``): the masked tokens whose entropy is
    at least ``torch.quantile`` of the masked tokens' entropies at ``1 - quantile``; the others'
    policy-gradient terms are multiplied by 0. Returns a bool mask like ``mask``."""
    m = mask.bool()
    vals = entropy[m].float()
    if vals.numel() == 0:
        return torch.zeros_like(m)
    threshold = torch.quantile(vals, 1.0 - quantile)
    return (entropy * m.float() >= threshold) & m


def setting_key(kind: str, value: float) -> str:
    """The results key of a setting: ``lr_x0.5``, ``entropy_coef=0.01``, ``clip_cov=0.0002``."""
    return f"lr_x{value:g}" if kind == "lr" else f"{kind}={value:g}"
