"""Stage 1: microbatched sums of X over E and of Y over U by backward() only.

``sum_X = sum_{n in E} X_n`` and ``sum_Y = sum_{n in U} Y_n`` land in parameter-sized buffers
(device/dtype from config). Gradients are zeroed before and after each microbatch -- or, when
the buffers have the parameters' device and dtype, summed in ``.grad`` across microbatches and
adopted as the buffer (the same additions; no per-microbatch copy); under DDP forward and backward
run inside ``no_sync()``. When projection directions are given, each unit is its own backward and
``X_u . direction`` is the increase of ``.grad . direction`` over the unit's backward (the fused
variance path: the E side of Stage 2 costs no extra pass, and no gradient is copied). With
``keep_unit_grads`` each unit is its own backward too and its gradient is kept on the model's
device (the ``stored`` variance path: ``Y_u . P Xbar`` once Xbar is known, no second pass over U).
With ``unit_backward="ghost"`` a microbatch is one backward and module hooks read each unit's
projections off the layers' activations and output gradients (ghost_projection.py).

Non-finite gradients are caught without an extra pass where a cheaper witness exists: a unit's
projections onto finite directions are finite iff its gradient is (NaN and Inf propagate into
every dot), and a sum of kept unit gradients is finite iff each unit is; the units are searched
only when a check fails, so the error still names the microbatch and the parameters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from entprobe.runtime import distributed as D
from entprobe.math import paramvec as pv
from entprobe.runtime import sharding
from entprobe.runtime.distributed import no_sync
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.context import ProbeContext, is_filler
from entprobe.pipeline.stages.x_spec import Forward
from entprobe.pipeline.stages.ghost_projection import GhostHooks


@dataclass
class Accumulated:
    sum_buf: pv.Buffer  # sum over local units of X_n (or raw Y_n), buffers_device/dtype
    S: torch.Tensor  # [B, G] sequence log-probs at theta (detached, CPU fp32)
    token_logp: torch.Tensor  # [B, G, T] token log-probs at theta
    entropy: torch.Tensor | None  # [B, G, T] exact token entropies (X pass only)
    proj: torch.Tensor | None  # [B, k] per-unit projections onto the k directions, if given
    B: int  # local units
    unit_grads: list[pv.Buffer] | None = None  # kept per-unit gradients (model device) as row chunks:
    # each chunk a buffer of [b, *shape] tensors, b units (a vmap microbatch, or 1 unit of a loop)


def x_loss_of(ctx: ProbeContext) -> Callable[[Forward, RolloutBatch], torch.Tensor]:
    """``L_X(fwd, mb)``: the context's X (``ctx.x``, stages/x_spec.py) summed over the microbatch's
    units, ``sum_g detach(w) S`` or ``sum_{g,t} a l_t + e H_t``: its gradient is ``sum_n X_n``,
    E[X_n] = -grad H_n."""
    return ctx.x.loss


def y_loss_of(ctx: ProbeContext) -> Callable[[Forward, RolloutBatch], torch.Tensor]:
    """``L_Y(fwd, mb) = sum_n sum_g w[n,g] S[n,g]`` with the context's objective's weights
    (entprobe: ``w = A / (G Lmax)``; rollouts/objectives.py): its gradient is ``sum_n Y_n``."""
    return lambda fwd, mb: ctx.y_loss(fwd.S, mb)


def prepare_x(ctx: ProbeContext, batch: RolloutBatch) -> None:
    """``ctx.x`` for an X pass over ``batch``: ``token_mean``'s constants (``kappa`` = the batch's
    ``sum H / sum L``, ``scale`` = 1 / its mean length, over all ranks) from the entropies the
    sampler recorded, else kappa from the trainer's (``batch.entropy_mean``: its forward's, over the
    same tokens at the same parameters), else from a forward without a graph over the batch (phase
    ``x_constants``). Nothing to do for the other functionals."""
    if ctx.x.mode != "token_mean":
        return
    m = batch.response_mask.double()
    H = batch.sampler_entropy
    if H is None and batch.entropy_mean is not None:  # already over every rank's tokens (TRL reduces it)
        sum_L, n = D.reduce_scalars(float(m.sum()), float(batch.B * batch.G))
        ctx.x = dataclasses.replace(ctx.x, kappa=float(batch.entropy_mean), scale=n / sum_L)
        return
    if H is None:
        with ctx.phase("x_constants"), torch.no_grad():
            H = torch.cat([ctx.forward_S(mb, f"token entropies [{s}, {s + mb.B})", with_entropy=True).ent.cpu()
                           for s, mb in ctx.iterate(batch, ctx.nograd_mb(batch, False), "token entropies")
                           if not is_filler(mb)])
    sum_H, sum_L, n = D.reduce_scalars(float((H.double() * m).sum()), float(m.sum()), float(batch.B * batch.G))
    ctx.x = dataclasses.replace(ctx.x, kappa=sum_H / sum_L, scale=n / sum_L)


def check_grads(ctx: ProbeContext, what: str) -> None:
    gs = [p.grad for p in ctx.params if p.grad is not None]
    if not gs:
        raise RuntimeError(f"{what}: the probe loss produced no gradient for any trainable parameter")
    norms = torch.stack(torch._foreach_norm(gs)) if len({g.dtype for g in gs}) == 1 else \
        torch.stack([n.float() for n in torch._foreach_norm(gs)])
    if not torch.isfinite(norms).all():
        _name_non_finite(ctx, [p.grad for p in ctx.params], what)


def _name_non_finite(ctx: ProbeContext, grads: list, what: str) -> None:
    """Raise naming (up to 3 of) the parameters whose gradient in ``grads`` holds NaN/Inf, if any."""
    bad = [n for n, g in zip(ctx.names, grads) if g is not None and not torch.isfinite(g).all()][:3]
    if bad:
        raise FloatingPointError(f"{what}: NaN/Inf gradient in {bad}")


def require_grad_path(loss: torch.Tensor, what: str) -> None:
    """A probe loss without a gradient path (autograd disabled, or every parameter frozen) is an
    error that says so, before a backward pass that would fail with torch's own message."""
    if not loss.requires_grad:
        raise RuntimeError(f"{what}: the probe loss has no gradient path (is autograd disabled, or are all "
                           "parameters frozen?)")


def _vmap_unit_grads(ctx: ProbeContext, mb: RolloutBatch, loss_of, what: str, with_entropy: bool):
    """One forward over the microbatch, then every unit's gradient from one batched backward
    (``autograd.grad(..., is_grads_batched=True)``: vmap over the unit losses). As many ops as one
    backward, ``b`` times its arithmetic: the cheaper way on models whose time is per-op host time.
    Returns S, token log-probs, entropies and ``[b, *shape]`` gradients per parameter."""
    with torch.enable_grad(), no_sync(ctx.model):
        fwd = ctx.forward_S(mb, what, with_entropy=with_entropy)
        S, lp, ent = fwd
        losses = torch.stack([loss_of(fwd.unit(u), mb.select(u)) for u in range(mb.B)])
        require_grad_path(losses, what)
        eye = torch.eye(mb.B, dtype=losses.dtype, device=losses.device)
        gb = torch.autograd.grad(losses, ctx.params, grad_outputs=eye, is_grads_batched=True,
                                 allow_unused=True)
    gb = [g if g is not None else p.new_zeros((mb.B, *p.shape)) for g, p in zip(gb, ctx.params)]
    return S, lp, ent, gb


def _check_projections(ctx: ProbeContext, proj: torch.Tensor, what: str, grads: pv.Buffer | None = None) -> None:
    """A unit's projections onto finite directions are finite iff its gradient is; on failure the
    gradient (``grads``, else ``.grad``) names the parameters, or, if it is finite, the directions
    are to blame."""
    if bool(torch.isfinite(proj).all()):
        return
    _name_non_finite(ctx, grads if grads is not None else [p.grad for p in ctx.params], what)
    raise FloatingPointError(f"{what}: non-finite projection of a finite gradient: a projection direction "
                             "holds NaN/Inf (check the optimizer state and the weights)")


def _check_unit_sum(ctx: ProbeContext, buf: pv.Buffer, units: list[pv.Buffer], labels: list[str]) -> None:
    """Kept unit gradients are all finite iff their sum is (up to an overflow of the sum itself,
    which is reported as such); one pass over the sum, the units searched only on failure."""
    if math.isfinite(pv.norm(buf)):
        return
    for chunk, what in zip(units, labels):
        _name_non_finite(ctx, chunk, what)
    raise FloatingPointError(f"{labels[0].split(' microbatch')[0]}: the sum of the unit gradients overflows "
                             "(every unit is finite); use a wider buffers dtype")


def _add_units_(buf: pv.Buffer, units: list[pv.Buffer]) -> None:
    """``buf += sum of the units`` (row chunks, ``[b, *shape]``): in place when the buffers live
    on the units' device, else summed there first so that one parameter-sized transfer per
    microbatch reaches the buffers."""
    for i, b in enumerate(buf):
        gs = [r[i][0] if r[i].shape[0] == 1 else r[i].sum(0) for r in units]
        if gs[0].device != b.device:
            total = gs[0].clone()
            for g in gs[1:]:
                total.add_(g)
            gs = [total]
        for g in gs:
            b.add_(g.to(b.device, b.dtype))


def accumulate(ctx: ProbeContext, batch: RolloutBatch, loss_of, label: str,
               directions: pv.DirectionSet | None = None, with_entropy: bool | str = False,
               keep_unit_grads: bool = False, unit_backward: str = "loop") -> Accumulated:
    """Sum the probe gradients of ``batch`` into a buffer, microbatch by microbatch.

    With ``directions`` (k directions stacked per parameter on the model's device,
    ``stages.prediction.directions``) every unit gets its own gradient and its projections
    ``grad_u . direction_j`` are recorded on the device (one read of the gradient for all k); parameter-sized data still moves to
    the buffers only once per microbatch. With ``keep_unit_grads`` every unit's gradient tensors
    are kept on the model's device (no copy); the microbatch's sum is formed there and reaches the
    buffers once per microbatch. Per-unit gradients come from one backward per unit
    (``unit_backward="loop"``) or one batched backward per microbatch (``"vmap"``); with
    ``"ghost"`` (directions only) the projections are read off the layers during one plain backward
    per microbatch (``ghost_projection.GhostHooks``, which also write the gradient sum).
    """
    if batch.B == 0:
        raise ValueError(f"{label}: the batch is empty")
    if batch.G < 2:
        raise ValueError(f"{label}: G={batch.G}; need >= 2 responses per prompt")
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{label}: probe passes cannot run under torch.inference_mode()")
    if unit_backward not in ("loop", "vmap", "ghost"):
        raise ValueError(f"unit_backward={unit_backward!r}; use loop, vmap or ghost")
    if unit_backward == "ghost" and (directions is None or keep_unit_grads):
        raise ValueError(f"{label}: unit_backward=ghost projects onto directions and keeps no unit gradient")
    S_all, lp_all, ent_all, proj, units, unit_labels = [], [], [], [], [], []
    per_unit = directions is not None or keep_unit_grads
    if per_unit and sharding.sharded():
        raise ValueError(f"{label}: per-unit gradients (probe.projection=stored/fused) do not run under "
                         "ddp.strategy=fsdp2; use probe.projection=backward")
    vmap = per_unit and unit_backward == "vmap"
    ghost = per_unit and unit_backward == "ghost"  # projections from hooks in one backward (ghost_projection.py)
    running = directions is not None and not keep_unit_grads and not vmap and not ghost  # by increase
    # Buffers of the parameters' own device and dtype: .grad is the sum (backward accumulates
    # into it, the same additions in the same order), adopted as the buffer at the end.
    in_grad = (not per_unit or running or ghost) and all(
        p.device == ctx.buffers_device and p.dtype == ctx.buffers_dtype for p in ctx.params)
    buf = None if in_grad else pv.zeros(ctx.params, ctx.buffers_device, ctx.buffers_dtype)
    ctx.zero_grad()
    before = 0.0  # grad . directions so far (running projections)
    hooks = GhostHooks(ctx.model, ctx.params, directions) if ghost else contextlib.nullcontext()
    with hooks:
        for start, mb in ctx.iterate(batch, ctx.mb_size, label):
            # loop: each unit is its own backward; .grad keeps summing (over the microbatch, or over
            # the batch when it is the buffer) and a unit's projection is the increase of
            # grad . direction (no extra buffer, no copy of the unit's gradient).
            pieces = [(0, mb)] if vmap or ghost or not per_unit else mb.microbatches(1)
            mb_units = []
            if not in_grad:
                before = 0.0
            for off, piece in pieces:
                what = f"{label} microbatch prompts [{start + off}, {start + off + piece.B})"
                if ghost:
                    S, lp, ent, p_mb = _ghost_unit_grads(ctx, hooks, piece, loss_of, what, with_entropy)
                    proj.append(p_mb)
                    ctx.stats.count("backward", piece.B * piece.G)
                elif vmap:
                    S, lp, ent, gb = _vmap_unit_grads(ctx, piece, loss_of, what, with_entropy)
                    for p, g in zip(ctx.params, gb):
                        p.grad = g.sum(0)
                    check_grads(ctx, what)
                    if directions is not None:
                        proj.append(pv.dot_rows_set(gb, directions))
                    if keep_unit_grads:
                        mb_units.append(gb)
                    ctx.stats.count("backward", piece.B * piece.G)
                else:
                    with torch.enable_grad(), no_sync(ctx.model):  # forward too: DDP arms its all-reduce there
                        fwd = ctx.forward_S(piece, what, with_entropy=with_entropy)
                        S, lp, ent = fwd
                        loss = loss_of(fwd, piece)
                        require_grad_path(loss, what)
                        loss.backward()
                    ctx.stats.count("backward", 0 if is_filler(piece) else piece.B * piece.G)
                    if keep_unit_grads:
                        mb_units.append([g.detach().unsqueeze(0) for g in pv.grads(ctx.params)])  # a view
                        unit_labels.append(what)
                        ctx.zero_grad()  # the next unit's backward starts from None: no copy of this one
                        if directions is not None:
                            proj.append(pv.dot_rows_set(mb_units[-1], directions))
                            _check_projections(ctx, proj[-1], what, mb_units[-1])
                    elif directions is not None:
                        now = pv.dot_set(pv.grads(ctx.params), directions)
                        proj.append((now - before).unsqueeze(0))
                        _check_projections(ctx, proj[-1], what)
                        before = now
                if is_filler(piece):  # FSDP2: a collective pass that adds nothing
                    continue
                S_all.append(S.detach().cpu())
                lp_all.append(lp.detach().cpu())
                if ent is not None:
                    ent_all.append(ent.detach().cpu())
            units.extend(mb_units)
            if keep_unit_grads and not vmap:  # .grad is empty; the units are checked through their sum
                _add_units_(buf, mb_units)
                continue
            if not running:  # running: every unit's projections were checked
                check_grads(ctx, f"{label} microbatch prompts [{start}, {start + mb.B})")  # the running sum
            if not in_grad:
                pv.add_grads_(buf, ctx.params)
                ctx.zero_grad()
    if keep_unit_grads and not vmap and directions is None:
        _check_unit_sum(ctx, buf, units, unit_labels)
    if in_grad:
        buf = [g.detach() for g in pv.grads(ctx.params)]
        ctx.zero_grad()
    return Accumulated(buf, torch.cat(S_all), torch.cat(lp_all), torch.cat(ent_all) if ent_all else None,
                       torch.cat([x.cpu() for x in proj]) if directions is not None else None, batch.B,
                       units if keep_unit_grads else None)


def _ghost_unit_grads(ctx: ProbeContext, hooks: GhostHooks, piece: RolloutBatch, loss_of, what: str,
                      with_entropy: bool):
    """One forward and one backward over ``piece``; its units' projections from ``hooks`` (the
    covered parameters) plus, for the uncovered ones, a batched backward restricted to them."""
    hooks.start(piece.B)
    with torch.enable_grad(), no_sync(ctx.model):
        fwd = ctx.forward_S(piece, what, with_entropy=with_entropy)
        S, lp, ent = fwd
        loss = loss_of(fwd, piece)
        require_grad_path(loss, what)
        extra = None
        if hooks.uncovered:
            ps = [ctx.params[i] for i in hooks.uncovered]
            losses = torch.stack([loss_of(fwd.unit(u), piece.select(u)) for u in range(piece.B)])
            eye = torch.eye(piece.B, dtype=losses.dtype, device=losses.device)
            with hooks.paused():
                gb = torch.autograd.grad(losses, ps, grad_outputs=eye, is_grads_batched=True, allow_unused=True,
                                         retain_graph=True)
            d = hooks.directions
            extra = sum(g.reshape(piece.B, -1).to(d.dtype) @ d.block(i).T
                        for i, g in zip(hooks.uncovered, gb) if g is not None)
        loss.backward()
    proj = hooks.take()
    return S, lp, ent, proj if extra is None or isinstance(extra, int) else proj + extra


def global_mean(buf: pv.Buffer, B_local: int) -> tuple[pv.Buffer, int]:
    """All-reduce a sum buffer once per tensor and divide by the global unit count. Under FSDP2
    the buffer already holds this rank's shard of the global sum (the backward's reduce-scatter)."""
    if not sharding.sharded():
        D.reduce_sum_(buf)
    B = int(D.reduce_scalars(B_local)[0])
    return pv.scale_(buf, 1.0 / B), B
