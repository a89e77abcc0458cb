"""An update that is exactly zero: nothing moves, so nothing is left to measure.

When every coordinate of the update ``Delta theta`` the optimizer would take is exactly 0, and so
is the gradient ``P Ybar`` it is built from (every advantage of U zero, or cancelling within each
group on identical responses; and no momentum or weight decay to apply), the step leaves
``theta_plus = theta``: the entropy change is 0 exactly, predicted (``-Xbar . Delta theta`` for any
Xbar) and measured (every importance weight is 1), and so is ``deltaH1 = -lr Xbar . P Ybar``. With
AdamW's momentum or a weight decay the update is not zero though the gradient is, and the probe
runs in full. The modes check right after the update is built (pipeline/modes/two_batch.py: after
the U pass; single_batch.py: after its bars pass) and then skip the E pass, the per-unit passes
and the real step, reporting ``zero_update_results`` (``update_zero: true``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entprobe.math import paramvec as pv
from entprobe.math.adamw import StepModel
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.prediction import directions


@dataclass
class ZeroUpdate:
    """What the two-batch probe has when it stops at a zero update: the step model's parts and
    kind, U's global prompt count and this rank's U log-probs (for ``deltaH_cov``)."""
    step_names: list[str]
    step_kind: str
    B_U: int
    S_U: torch.Tensor  # [B_U, G] local sequence log-probs at theta


def update_is_zero(ctx: ProbeContext, step: StepModel, Ybar: pv.Buffer) -> bool:
    """Whether ``Ybar`` and every part of ``step``'s update are exactly 0 (the update is written
    into a scratch set only when ``Ybar`` is: a nonzero gradient costs one norm)."""
    if pv.norm(Ybar) != 0.0:  # NaN is not 0 either
        return False
    parts = directions(ctx, [], step, ctx.buffers_device)
    zero = pv.is_zero(parts)
    del parts
    return zero


def zero_update_results(step_names: list[str], step_kind: str, measured: bool) -> dict:
    """The results of a probe whose update is exactly zero: the prediction 0 with SE 0 (each part
    too), ``norm_PYbar`` 0 and, when the step would have been measured (``measured``), the measured
    change and the paired difference 0 with SE 0, consistent, every importance weight 1."""
    res: dict = {"update_zero": True, "deltaH_pred": 0.0, "pred/step_model": step_kind, "SE_deltaH_pred": 0.0,
                 "SE_deltaH_pred_E": 0.0, "ci95_pred_low": 0.0, "ci95_pred_high": 0.0, "norm_PYbar": 0.0}
    if len(step_names) > 1:
        for k in step_names:
            res.update({f"deltaH_pred_{k}": 0.0, f"SE_deltaH_pred_{k}": 0.0})
    if measured:
        res.update({"deltaH_true": 0.0, "SE_deltaH_true": 0.0, "ci95_true_low": 0.0, "ci95_true_high": 0.0,
                    "measurable": True, "ESS_frac": 1.0, "deltaH_true_minus_pred": 0.0,
                    "SE_deltaH_true_minus_pred": 0.0, "ci95_true_minus_pred_low": 0.0,
                    "ci95_true_minus_pred_high": 0.0, "pred_consistent": True})
    return res
