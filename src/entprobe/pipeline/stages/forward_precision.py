"""The working precision of the model's forward passes, which sets the rounding bound of the
measured change and of the paired test (stages/ground_truth.py, stages/paired.py)."""
from __future__ import annotations

import torch

from entprobe.pipeline.stages.context import ProbeContext
from entprobe.runtime.wide_forward import wide_forward_dtype


def forward_dtype(ctx: ProbeContext) -> torch.dtype:
    """The dtype that sets the model's forward passes' working precision: the coarsest of the
    parameters' dtype, the autocast dtype (``model.autocast``) and fp32 (HF models run their norms
    and softmax in at least fp32: an fp64 model's log-probs carry fp32 rounding), the last left out
    where ``runtime.wide_forward.widen_forward`` made the forward compute in the weights' dtype
    throughout (``model.dtype=float64`` in the job)."""
    wide = wide_forward_dtype(ctx.model) if ctx.model is not None else None
    dts = {p.dtype for p in ctx.params if p.is_floating_point()} | {wide or torch.float32}
    if getattr(ctx, "autocast_dtype", None) is not None:
        dts.add(ctx.autocast_dtype)
    return max(dts, key=lambda d: torch.finfo(d).eps)


def forward_eps(ctx: ProbeContext) -> float:
    """``finfo(forward_dtype).eps``: 2^-23 in fp32, 2^-7 under bf16 (``forward_dtype``)."""
    return torch.finfo(forward_dtype(ctx)).eps
