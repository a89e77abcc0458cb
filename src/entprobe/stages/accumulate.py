"""Stage 1: microbatched sums of X over E and of Y over U (seed 002), by backward() only.

``sum_X = sum_{n in E} X_n`` and ``sum_Y = sum_{n in U} Y_n`` land in parameter-sized buffers
(device/dtype from config). Gradients are zeroed before and after each microbatch; under DDP
forward and backward run inside ``no_sync()``. When a projection direction is given, each unit is its
own backward and ``X_u . direction`` is taken on the device before the gradient is added to the sum
(the fused variance path: the E side of Stage 2 costs no extra pass). With ``keep_unit_grads`` each
unit is its own backward too and its gradient is kept on the model's device (the ``stored`` variance
path: ``Y_u . P Xbar`` once Xbar is known, no second pass over U).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from entprobe import paramvec as pv
from entprobe.distributed import no_sync
from entprobe.estimators import weighted_S, x_loss, y_loss
from entprobe.rollout import RolloutBatch
from entprobe.stages.context import ProbeContext


@dataclass
class Accumulated:
    sum_buf: pv.Buffer  # sum over local units of X_n (or raw Y_n), buffers_device/dtype
    S: torch.Tensor  # [B, G] sequence log-probs at theta (detached, CPU fp32)
    token_logp: torch.Tensor  # [B, G, T] token log-probs at theta
    entropy: torch.Tensor | None  # [B, G, T] exact token entropies (X pass only)
    proj: torch.Tensor | None  # [B] per-unit projections onto the direction, if one was given
    B: int  # local units
    unit_grads: list[pv.Buffer] | None = None  # per-unit gradients (model device), if kept


def x_loss_of(ctx: ProbeContext) -> Callable[[torch.Tensor, RolloutBatch], torch.Tensor]:
    """``L_X(S, mb) = sum_n (1/G) sum_g detach(S_w - LOO mean S_w) * S`` for the context's mode."""
    def fn(S, mb):
        Sw = weighted_S(S, mb.gen_lengths.to(S.device), mb.Lmax.to(S.device), ctx.weighting_mode)
        return x_loss(S, Sw)
    return fn


def y_loss_of(ctx: ProbeContext) -> Callable[[torch.Tensor, RolloutBatch], torch.Tensor]:
    """``L_Y(S, mb) = sum_n (1/G) sum_g (A / Lmax) * S``."""
    return lambda S, mb: y_loss(S, mb.advantages.to(S.device), mb.Lmax.to(S.device))


def _check_grads(ctx: ProbeContext, what: str) -> None:
    gs = [p.grad for p in ctx.params if p.grad is not None]
    if not gs:
        raise RuntimeError(f"{what}: the probe loss produced no gradient for any trainable parameter")
    norms = torch.stack([n.float() for n in torch._foreach_norm(gs)])
    if not torch.isfinite(norms).all():
        bad = [n for n, p in zip(ctx.names, ctx.params)
               if p.grad is not None and not torch.isfinite(p.grad).all()][:3]
        raise FloatingPointError(f"{what}: NaN/Inf gradient in {bad}")


def accumulate(ctx: ProbeContext, batch: RolloutBatch, loss_of, label: str,
               direction: pv.Buffer | None = None, with_entropy: bool = False,
               keep_unit_grads: bool = False) -> Accumulated:
    """Sum the probe gradients of ``batch`` into a buffer, microbatch by microbatch.

    With ``direction`` (a buffer on the model's device) every unit gets its own backward and its
    projection ``grad_u . direction`` is recorded on the device; parameter-sized data still moves to
    the buffers only once per microbatch. With ``keep_unit_grads`` every unit gets its own backward
    and its gradient tensors are kept (moved out of ``.grad``, no copy); the microbatch's sum is
    formed on the device and reaches the buffers once per microbatch.
    """
    if batch.B == 0:
        raise ValueError(f"{label}: the batch is empty")
    if batch.G < 2:
        raise ValueError(f"{label}: G={batch.G}; need >= 2 responses per prompt")
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{label}: probe passes cannot run under torch.inference_mode()")
    buf = pv.zeros(ctx.params, ctx.buffers_device, ctx.buffers_dtype)
    S_all, lp_all, ent_all, proj, units = [], [], [], [], []
    ctx.zero_grad()
    for start, mb in ctx.iterate(batch, ctx.mb_size, label):
        # With a direction each unit is its own backward; .grad keeps summing over the microbatch
        # and a unit's projection is the increase of grad . direction (no extra buffer, and the
        # sum reaches the buffers once per microbatch, not once per unit).
        per_unit = direction is not None or keep_unit_grads
        pieces = mb.microbatches(1) if per_unit else [(0, mb)]
        before, mb_units = 0.0, []
        for off, piece in pieces:
            what = f"{label} microbatch prompts [{start + off}, {start + off + piece.B})"
            with torch.enable_grad(), no_sync(ctx.model):  # forward too: DDP arms its all-reduce there
                S, lp, ent = ctx.forward_S(piece, what, with_entropy=with_entropy)
                loss = loss_of(S, piece)
                if not loss.requires_grad:
                    raise RuntimeError(f"{what}: the probe loss has no gradient path (is autograd "
                                       "disabled, or are all parameters frozen?)")
                loss.backward()
            ctx.stats.count("backward", piece.B * piece.G)
            if keep_unit_grads:
                _check_grads(ctx, what)
                mb_units.append([g.detach() for g in pv.grads(ctx.params)])
                ctx.zero_grad()  # the next unit's backward starts from None: no copy of this one
                if direction is not None:
                    proj.append(pv.dot(mb_units[-1], direction))
            elif direction is not None:
                _check_grads(ctx, what)
                now = pv.dot(pv.grads(ctx.params), direction)
                proj.append(now - before)
                before = now
            S_all.append(S.detach().cpu())
            lp_all.append(lp.detach().cpu())
            if ent is not None:
                ent_all.append(ent.detach().cpu())
        if keep_unit_grads:  # the microbatch's sum, on the device, stands in for .grad
            for p, *gs in zip(ctx.params, *mb_units):
                p.grad = gs[0].clone()
                for g in gs[1:]:
                    p.grad.add_(g)
            units.extend(mb_units)
        _check_grads(ctx, f"{label} microbatch prompts [{start}, {start + mb.B})")
        pv.add_grads_(buf, ctx.params)
        ctx.zero_grad()
    return Accumulated(buf, torch.cat(S_all), torch.cat(lp_all), torch.cat(ent_all) if ent_all else None,
                       torch.tensor(proj, dtype=torch.float64) if direction is not None else None, batch.B,
                       units if keep_unit_grads else None)
