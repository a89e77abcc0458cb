"""The measured step split into gradient, momentum and weight-decay parts (``importance.split_step``),
and ``Xbar . (theta_plus - theta)`` (``deltaH1_step``): the first-order change of the step really
taken, read off the parameters before they are restored, with a bound on its rounding
(``step_rounding_bound``).

Plain AdamW splits in closed form from the snapshot's moments; other optimizers repeat their own
step with a zero gradient on the snapshot (pipeline/stages/ground_truth.py restores after either;
chunked, stages/chunked_step.py, when the snapshot refers to the live state).
"""
from __future__ import annotations

import math

import torch

from entprobe.math import paramvec as pv
from entprobe.runtime import sharding
from entprobe.runtime.sharding import local
from entprobe.pipeline.stages.chunked_step import step_on
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.snapshot import restore


def xbar_dot_step(Xbar: pv.Buffer, params, snap_params) -> float:
    """``Xbar . (theta_now - theta_snapshot)``, one tensor at a time on Xbar's device in at least
    fp32 (the difference of two nearby floats is exact or within half an ulp of itself; an fp64
    model stays fp64), the per-tensor terms summed in fp64 (and over the shards under FSDP2).
    No parameter-sized copy is kept."""
    total = torch.zeros((), dtype=torch.float64)
    for x, p, s in zip(Xbar, params, snap_params):
        dt = torch.promote_types(torch.promote_types(p.dtype, x.dtype), torch.float32)
        d = local(p.detach()).to(x.device, dt) - s.to(x.device, dt)
        total += torch.dot(x.reshape(-1).to(dt), d.reshape(-1)).double().cpu()
    return float(sharding.reduce_shards(total))


def step_rounding_bound(Xbar: pv.Buffer, params, snap_params) -> float:
    """A bound on ``|Xbar . r|``, r the rounding of the step the parameters took: the update is
    added in the parameters' dtype (AdamW: the decay and the update, two roundings of at most half
    an ulp each), so ``|r_i| <= ulp(max(|theta_i|, |theta+_i|))`` and the bound is
    ``sum_i |Xbar_i| ulp_i`` (fp64 over tensors, summed over FSDP2 shards). When the step is below
    the parameters' resolution it rounds away altogether, and this bound holds the lost change."""
    total = torch.zeros((), dtype=torch.float64)
    for x, p, s in zip(Xbar, params, snap_params):
        now = local(p.detach()).to(x.device)
        big = torch.maximum(now.abs(), s.to(x.device, now.dtype).abs())
        ulp = torch.nextafter(big, torch.full_like(big, math.inf)) - big
        total += (x.reshape(-1).abs().double() * ulp.reshape(-1).double()).sum().cpu()
    return float(sharding.reduce_shards(total))


def _decoupled_decay(opt: torch.optim.Optimizer) -> bool:
    """AdamW-style decay ``p *= 1 - lr * wd`` before the update, so it separates exactly."""
    return isinstance(opt, torch.optim.Adam) and all(g.get("decoupled_weight_decay", False)
                                                     for g in opt.param_groups)


ANALYTIC_ADAMW_SPLIT = True  # tests switch it off to compare with the repeated step


def plain_adamw(opt: torch.optim.Optimizer) -> bool:
    """torch's Adam with decoupled decay (AdamW) and none of the variants the closed form omits."""
    return _decoupled_decay(opt) and not any(
        g.get(k, False) for g in opt.param_groups for k in ("amsgrad", "maximize", "capturable", "differentiable"))


@torch.no_grad()
def _adamw_zero_grad_parts(ctx: ProbeContext, opt, Xbar: pv.Buffer, snap) -> tuple[float, float]:
    """Momentum and weight-decay parts of ``-Xbar . Delta0`` for AdamW's step with a zero gradient
    from the snapshot's state, in closed form (no restore, no second step): with ``t = step + 1``,
    ``bc_k = 1 - beta_k^t``, ``Delta0 = -lr wd theta - (lr / bc1) * beta1 m / (sqrt(beta2 v) /
    sqrt(bc2) + eps)``; the first term is the decay part, the second the momentum part.
    On the parameters' device in at least fp32 (multi-tensor ops over the tensors that share a
    param group, step count, device and dtype), per-tensor dots summed in fp64."""
    index = {id(p): i for i, p in enumerate(ctx.params)}
    batches: dict[tuple, list[int]] = {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            i = index.get(id(p))
            if i is None:
                continue
            st = snap.state.get(i)
            has = st is not None and "exp_avg" in st  # no state yet: m = v = 0, the update is 0
            step = (st["step"][0] if isinstance(st["step"], tuple) else st["step"]) if has else None
            dt = torch.promote_types(torch.promote_types(p.dtype, Xbar[i].dtype), torch.float32)
            key = (gi, None if step is None else float(step), p.device, dt)
            batches.setdefault(key, []).append(i)

    def dot(xs, ys) -> float:  # as pv.dot: per tensor in dt, no product tensor, summed in fp64 (and shards)
        return float(sharding.reduce_shards(torch.stack(
            [torch.dot(x.reshape(-1), y.reshape(-1)).double() for x, y in zip(xs, ys)]).sum().cpu()))

    momentum = decay = 0.0
    for (gi, step, dev, dt), idx in batches.items():
        g = opt.param_groups[gi]
        lr, wd, eps = float(g["lr"]), float(g.get("weight_decay", 0.0)), float(g["eps"])
        b1, b2 = (float(b) for b in g["betas"])
        X = [Xbar[i].to(dev, dt) for i in idx]
        if wd:
            decay += lr * wd * dot(X, [snap.params[i].to(dev, dt) for i in idx])  # -Xbar . (-lr wd theta)
        if step is not None:
            t = step + 1.0
            # one parameter-sized temporary: q = beta1 m / (sqrt(beta2 v / bc2) + eps), built in place
            q = torch._foreach_mul([snap.state[i]["exp_avg_sq"][0].to(dev, dt) for i in idx], b2 / (1.0 - b2 ** t))
            torch._foreach_sqrt_(q)
            torch._foreach_add_(q, eps)
            torch._foreach_reciprocal_(q)
            torch._foreach_mul_(q, [snap.state[i]["exp_avg"][0].to(dev, dt) for i in idx])
            momentum += lr * b1 / (1.0 - b1 ** t) * dot(X, q)  # -Xbar . (-(lr / bc1) beta1 m / denom)
    return momentum, decay


def _repeated_zero_grad_part(ctx: ProbeContext, opt, Xbar: pv.Buffer, snap, decay: bool) -> float:
    """``-Xbar . Delta0`` from the optimizer's own step with a zero gradient, repeated on the
    snapshot (weight decay switched off unless ``decay``); leaves theta_0 + Delta0 in place. On a
    live-state snapshot the step is chunked (``step_on``): the state stays the snapshot's."""
    restore(ctx.params, opt, snap)
    saved_wd = [g.get("weight_decay", 0.0) for g in opt.param_groups]
    if not decay:
        for g in opt.param_groups:
            g["weight_decay"] = 0.0
    for p in ctx.params:
        p.grad = torch.zeros_like(p)
    try:
        step_on(opt, snap)
    finally:
        for g, wd in zip(opt.param_groups, saved_wd):
            g["weight_decay"] = wd
    return -xbar_dot_step(Xbar, ctx.params, snap.params)


def split_step(ctx: ProbeContext, opt: torch.optim.Optimizer, Xbar: pv.Buffer, snap, total: float
               ) -> dict[str, float]:
    """Split ``deltaH1_step`` into the step a zero gradient would take from the snapshot
    (momentum + weight decay) and the remainder (the gradient part), so the three sum to it.
    Plain AdamW: both parts in closed form (``_adamw_zero_grad_parts``). Other optimizers: the
    zero-gradient step is repeated with the optimizer itself; decoupled decay (AdamW variants)
    moves theta by exactly ``-lr * wd * theta``, so its part is ``lr * wd * Xbar . theta`` per param
    group; otherwise (e.g. SGD or Adam with coupled decay) the step is repeated once more with weight
    decay off. (The zero-gradient step also decays Adam's second moment, so the 'gradient' part
    carries the change of the denominator the new gradient causes.)"""
    if plain_adamw(opt) and ANALYTIC_ADAMW_SPLIT:
        mom, wd_part = _adamw_zero_grad_parts(ctx, opt, Xbar, snap)
        mom_wd = mom + wd_part
    else:
        mom_wd = _repeated_zero_grad_part(ctx, opt, Xbar, snap, decay=True)
        if _decoupled_decay(opt):
            index = {id(p): i for i, p in enumerate(ctx.params)}
            wd_part = 0.0
            for g in opt.param_groups:
                idx = [index[id(p)] for p in g["params"] if id(p) in index]
                if g.get("weight_decay", 0.0) and idx:
                    xt = pv.dot([Xbar[i] for i in idx], [snap.params[i] for i in idx])
                    wd_part += g["lr"] * g["weight_decay"] * xt  # -Xbar . (-lr wd theta)
            mom = mom_wd - wd_part
        else:
            mom = _repeated_zero_grad_part(ctx, opt, Xbar, snap, decay=False)
            wd_part = mom_wd - mom
        ctx.zero_grad()
    return {"deltaH1_step_gradient": total - mom_wd, "deltaH1_step_momentum": mom,
            "deltaH1_step_weight_decay": wd_part}
