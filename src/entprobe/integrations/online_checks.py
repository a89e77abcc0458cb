"""The online probe's argument checks: early, one line, naming what to change."""
from __future__ import annotations

import math
import numbers

import torch

from entprobe.config import ConfigError
from entprobe.math.adamw import step_check_tolerance
from entprobe.rollouts.sampling import RolloutBatch


def check_every(every, name: str) -> None:
    """A ConfigError naming ``name`` unless ``every`` is an int >= 1 (a bool is not one)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{name}={every!r}: probe every N optimizer steps, N an int >= 1")


def check_rollouts(batch: RolloutBatch, where: str) -> None:
    """A ValueError, before any pass, when the batch is unusable (``RolloutBatch.problem``: shapes
    other than [B, G, T] / [B, G] (advantages, rewards) / [B], masks, non-finite advantages, ...)
    or has fewer than 3 prompts or 2 responses each (the cross-prompt U-statistic pairs each prompt
    with the update of the other B - 1, and its SE needs two of those)."""
    wrong = batch.problem()
    if wrong:
        raise ValueError(f"{where}: rollouts: {wrong}; pass the RolloutBatch the gradient in .grad was computed on")
    if batch.B < 3 or batch.G < 2:
        raise ValueError(f"{where}: rollouts has {batch.B} prompt(s) x {batch.G} response(s); source='rollouts' "
                         "needs >= 3 prompts and >= 2 responses each (the cross-prompt U-statistic)")


def step_check(predicted: float, taken: float, u: float, x_theta_abs: float, step_mag: float, n: int) -> dict:
    """The step taken against the one predicted, on the prediction's own Xbar: ``taken`` =
    ``deltaH1_step = -Xbar . (theta_plus - theta)`` against ``predicted = -Xbar . Delta theta`` of the
    update ``before_step`` computed, within ``step_check_tolerance(u, x_theta_abs, step_mag)`` plus
    the fp64 sums' rounding over the ``n`` coordinates, ``n eps64 (2 x_theta_abs + step_mag)``.
    Outside it: ``step_mismatch`` True, ``step_mismatch_rel``, and ``pred_consistent`` None with its
    reason (the prediction was of another step). Along Xbar is where it matters: a step that
    agrees there has the predicted first-order change."""
    tol = step_check_tolerance(u, x_theta_abs, step_mag) + n * torch.finfo(torch.float64).eps * (
        2 * x_theta_abs + step_mag)
    diff = taken - predicted
    out = {"step_check/predicted": predicted, "step_check/diff": diff, "step_check/tol": tol,
           "step_mismatch": not abs(diff) <= tol}
    if not out["step_mismatch"]:
        return out
    rel = abs(diff) / abs(predicted) if predicted else math.inf
    out.update({"step_mismatch_rel": rel, "pred_consistent": None, "pred_consistent_reason": (
        f"the step taken is not the one predicted: -Xbar . (theta_plus - theta) = {taken:.6g} against "
        f"{predicted:.6g} for the update before_step computed (relative difference {rel:.3g}, rounding allows "
        f"{tol:.3g})")})
    return out


def theta_sum(params) -> float:
    """``sum_i theta_i`` over every parameter, in fp64 (summed the same way each call: a parameter
    left as it was gives the same bits)."""
    return float(torch.stack([torch.sum(p.detach(), dtype=torch.float64) for p in params]).sum())


def still_check(before: float, after: float) -> dict:
    """The step taken against an update predicted to be exactly 0 (``source="rollouts"``, every
    group tied, nothing carried, no decay): ``theta_plus = theta`` leaves the parameters' fp64 sum
    (``theta_sum``) bit for bit as it was; any other step is flagged as ``step_check`` flags it.
    ``deltaH1_step`` is 0 exactly when it holds (NaN otherwise: no Xbar was formed to dot the step with)."""
    diff = after - before
    out = {"deltaH1_step": 0.0 if diff == 0 else math.nan, "step_check/predicted": 0.0, "step_check/diff": diff,
           "step_check/tol": 0.0, "step_mismatch": diff != 0}
    if out["step_mismatch"]:
        out.update({"step_mismatch_rel": math.inf, "pred_consistent": None, "pred_consistent_reason": (
            f"the step taken is not the one predicted: the update was exactly 0 (every group tied, nothing "
            f"carried), but the parameters' sum moved by {diff:.6g}")})
    return out


def check_bonus_args(entropy_coef, bonus_effect: bool, source: str) -> None:
    """``before_step``'s entropy-bonus arguments: a finite coefficient >= 0; its effect only from the step's batch."""
    if isinstance(entropy_coef, bool) or not isinstance(entropy_coef, numbers.Real) or not 0 <= entropy_coef < float("inf"):
        raise ConfigError(f"entropy_coef={entropy_coef!r}: the entropy bonus's coefficient in your loss, a finite number >= 0")
    if bonus_effect and source != "rollouts":
        raise ConfigError("bonus_effect=True: the bonus's effect is read from the step's own batch; use "
                          "OnlineProbe(..., source='rollouts')")
