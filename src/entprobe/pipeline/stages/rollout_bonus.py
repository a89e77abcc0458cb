"""TRL's entropy bonus on the step's own batch (``source="rollouts"``; ``rollouts.objectives.EntropyBonus``):
the loss ``L_policy - c H_bonus`` the trainer stepped on, and the bonus's effect per unit coefficient.

- ``gH = grad H_bonus`` on the batch (``bonus_gradient``: one forward with differentiable entropies and
  one backward over the batch, in the probe's microbatches);
- each prompt's unit carries its share of the bonus, ``Y_n = Y_n^policy + c grad(sum m H[n]) / Tbar``; the
  ratio ``1 / Tbar`` depends on prompt n's tokens: a token-mean policy loss (TRL bnpo, dapo, ...) has that
  coupling already (``k_n = T_n / Tbar - 1`` on its whole Y); for any other aggregation it is folded into the
  unit, ``Y_n' = Y_n - c k_n gH`` (``fold_bonus_``: ``mean_n Y_n' = Ybar``, since ``sum_n k_n = 0``, and the
  leave-one-out ``(B Ybar - Y_n') / (B - 1)`` is the ratio's first-order leave-one-out);
- ``b = -Xbar . J gH`` (J the update's diagonal Jacobian in the gradient): the predicted entropy change per
  unit of coefficient added to the step's gradient input, ``b_n = -X_n . J gH`` per prompt, ``SE_b`` their
  spread over B prompts. It is a plug-in: X_n and gH are read on the same responses (gH holds prompt n's own
  ``g_n / B``), so b carries an O(1/B) own-term bias that the cross-prompt U-statistic of the step's
  prediction removes and this does not.
"""
from __future__ import annotations

import math

import torch

from entprobe.config import ConfigError
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.what_if import _grad_sum
from entprobe.rollouts import objectives as ob
from entprobe.rollouts.sampling import RolloutBatch


def bonus_error(objective: ob.Objective, batch_std: bool) -> str | None:
    """Why the bonus cannot be split by prompt with this objective: a coupling other than the token
    count's (TRL ``scale_rewards="batch"``: the batch's reward std divides the policy part only);
    None when it can."""
    if batch_std:
        return ("scale_rewards='batch' couples the policy part of the loss through the batch's reward std and the "
                "entropy bonus through its token count; use scale_rewards='group' or 'none' with the entropy bonus")
    if objective.coupling is not None and objective.aggregation != "token_mean":
        return f"objective {objective.name}'s coupling is not the token count's; use a per-sequence or token-mean loss"
    return None


def folds(objective: ob.Objective) -> bool:
    """Whether the bonus's ratio influence is folded into the units (``fold_bonus_``): the objective has no
    coupling of its own (a token-mean objective's ``k_n = T_n / Tbar - 1`` already covers the bonus)."""
    return objective.coupling is None


def bonus_gradient(ctx: ProbeContext, batch: RolloutBatch) -> pv.Buffer:
    """``gH = grad H_bonus``, ``H_bonus = sum_{n,g,t} m H / T`` over the batch's completion tokens (T their
    count), at theta, on the model's device in the gradients' dtype."""
    T = float(batch.response_mask.double().sum())

    def loss_of(mb):
        return ctx.forward_S(mb, "source=rollouts, entropy bonus gradient", with_entropy="grad").ent.sum() / T
    buf = _grad_sum(ctx, batch, loss_of, "source=rollouts, entropy bonus")
    return [g.to(p.device, p.dtype) for g, p in zip(buf, ctx.params)]


def fold_bonus_(Y: pv.Buffer, gH: pv.Buffer, coef: float, k: float) -> pv.Buffer:
    """``Y - coef k gH`` in place: the unit with the bonus's ratio influence (module docstring)."""
    if k != 0.0:
        for y, g in zip(Y, gH):
            y.sub_(g.to(y.dtype), alpha=coef * k)
    return Y


def bonus_effect(units: torch.Tensor) -> tuple[float, float]:
    """``(b, SE_b)`` from the per-prompt ``b_n = -X_n . J gH`` [B]: their mean and its standard error
    ``sqrt(sum (b_n - b)^2 / (B (B - 1)))``."""
    u = units.double()
    return float(u.mean()), math.sqrt(est.mean_variance(u))


def check_bonus(objective: ob.Objective, batch_std: bool) -> None:
    error = bonus_error(objective, batch_std)
    if error is not None:
        raise ConfigError(f"source=rollouts with an entropy bonus (entropy_coef > 0): {error}")
