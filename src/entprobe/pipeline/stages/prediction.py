"""The prediction of the real next step, before it is taken: ``deltaH_pred = -Xbar . Delta theta(Ybar)``
with ``Delta theta`` the update the loaded optimizer will apply to the U gradient (math/adamw.py),
split into gradient / momentum / weight-decay parts, each with its standard error.

Per-unit contributions (units are prompts):
- E side, exactly: ``e_u = -X_u . Delta theta_part`` (mean over E = the part's prediction);
- U side, by the delta method: ``u_v = -Y_v . (J * Xbar)`` with J the diagonal Jacobian
  ``d Delta theta / d Ybar`` of the whole update (the prediction moves by ``mean_v u_v - const``
  to first order when U changes).
Two targets, two standard errors:
- ``SE_deltaH_pred`` (the headline; ``ci95_pred_*``, Student-t with B_E - 1 degrees of freedom):
  the first-order change ``grad H . Delta theta(Ybar_U)`` of the step the optimizer takes on this
  U, the step the ground truth measures. Given U the prediction is linear in Xbar, so it is exactly
  unbiased and its SE is the E side's, ``sqrt(Var(mean e))``.
- ``SE_deltaH_pred_expected`` (``ci95_pred_expected_*``, Welch-Satterthwaite degrees of freedom):
  ``grad H . Delta theta(E[Y])``, the step with the expected gradient, for which U is one draw:
  ``sqrt(Var(mean e) + Var(mean u))``. Conservative at small B (the product term
  ``tr(Sigma_X J Sigma_Y J) / (B_E B_U)`` enters both sides) and biased by the update's curvature
  in Ybar at O(1/B_U) (docs/uncertainty.md has the measured coverage).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from entprobe.runtime import distributed as D
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.math import unit_dots as ud
from entprobe.runtime.sharding import like_param, local, reduce_shards
from entprobe.pipeline.stages.accumulate import accumulate, global_mean, prepare_x, x_loss_of
from entprobe.reporting.attribution import headline
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.step_split import plain_adamw
from entprobe.pipeline.stages.snapshot import restore, take
from entprobe.pipeline.stages.variance import resolve_projection, resolve_unit_backward
from entprobe.math.adamw import (AdamWHyper, StepModel, adamw_jacobian_times_into, adamw_update_into, clip_factor,
                                 clip_slope)


def _state_of(opt: torch.optim.Optimizer, p: torch.Tensor, dev, dt):
    """(m, v) of AdamW's state for p on ``dev`` in ``dt`` (this rank's shards under FSDP2); zeros
    without state (never stepped)."""
    st = opt.state.get(p)
    if not st or "exp_avg" not in st:
        z = torch.zeros(local(p).shape, device=dev, dtype=dt)
        return z, z
    return local(st["exp_avg"]).to(dev, dt), local(st["exp_avg_sq"]).to(dev, dt)


def _step_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> float:
    st = opt.state.get(p)
    return float(st["step"]) if st and "exp_avg" in st else 0.0


def torch_own_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` is torch's own Adam/AdamW/SGD step (a subclass that does not override
    ``step`` keeps it; torch's profiling wrapper is seen through). A subclass with its own step may
    update differently from the closed form: it is stepped on a snapshot instead."""
    own = {inspect.unwrap(c.step) for c in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)}
    return inspect.unwrap(type(opt).step) in own


def _plain_sgd(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, torch.optim.SGD) and all(
        not g.get("momentum", 0.0) and not g.get("nesterov", False) and not g.get("maximize", False)
        for g in opt.param_groups)


# the step models whose update is exactly lr times a function of Ybar and the state (up to
# rounding): a job's prediction at another lr is a rescaling (pipeline/lr_share.py). Gradient
# clipping keeps them so: its factor min(1, c / (||Ybar|| + 1e-6)) does not depend on the lr.
LINEAR_IN_LR = ("preconditioned_sgd", "adamw_closed_form", "sgd_closed_form")


def step_model_kind(optimizer: torch.optim.Optimizer, step_mode: str) -> str:
    """Which ``StepModel`` ``build_step_model`` makes for this optimizer and settings (its ``kind``);
    with or without gradient clipping, which the closed forms fold in."""
    if step_mode == "preconditioned_sgd":
        return "preconditioned_sgd"
    if not torch_own_step(optimizer):
        return "optimizer_step"
    if plain_adamw(optimizer):
        return "adamw_closed_form"
    if _plain_sgd(optimizer):
        return "sgd_closed_form"
    return "optimizer_step"


def build_step_model(ctx: ProbeContext, optimizer: torch.optim.Optimizer, lr: float, Ybar: pv.Buffer,
                     P: pv.Buffer | None, step_mode: str, max_grad_norm: float | None) -> StepModel:
    """``Delta theta(Ybar)`` (written on demand, at least fp32) and ``J^T x``.

    ``preconditioned_sgd``: ``lr P Ybar``; plain AdamW / plain SGD: closed form per param group
    (the groups' own lr, decay, betas, eps and each parameter's step count), at the clipped
    gradient ``s Ybar`` with ``max_grad_norm`` (math/adamw.py: ``s = min(1, c / (||Ybar|| +
    1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` before the real step). Anything else (other
    optimizers): the optimizer's own step from a snapshot with gradient ``-Ybar`` (clipped by
    ``clip_grad_norm_``), restored bit-exactly; no Jacobian then."""
    kind = step_model_kind(optimizer, step_mode)
    if kind == "preconditioned_sgd":
        def scaled_into(xs, out):
            for i, (x, o) in enumerate(zip(xs, out)):
                torch.mul(x.to(o.device, o.dtype), lr, out=o)
                if P is not None:
                    o.mul_(P[i].to(o.device, o.dtype))
        return StepModel(["gradient"], lambda outs: scaled_into(Ybar, outs["gradient"]), scaled_into,
                         "preconditioned_sgd")
    if kind != "optimizer_step":
        return _closed_form(ctx, optimizer, Ybar, max_grad_norm)

    def step_into(outs):  # the optimizer's own step on a snapshot
        snap = take(ctx.params, optimizer, ctx.buffers_device)
        try:
            for p, y in zip(ctx.params, Ybar):
                p.grad = like_param(p, (-y).to(p.device, p.dtype).contiguous())
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ctx.params, max_grad_norm)
            optimizer.step()
            for p, s, o in zip(ctx.params, snap.params, outs["update"]):
                torch.sub(local(p.detach()).to(o.device, o.dtype), s.to(o.device, o.dtype), out=o)
        finally:
            restore(ctx.params, optimizer, snap)
    return StepModel(["update"], step_into, None, "optimizer_step")


def _clipping(Ybar: pv.Buffer, max_grad_norm: float | None) -> tuple[float, float, dict]:
    """``(s, kappa, facts)`` of clipping at ``max_grad_norm`` (math/adamw.py): the factor, the slope
    ``ds/dy = kappa y`` and the results that report them; ``(1, 0, {})`` without clipping. The
    norm is the whole gradient's, summed over every rank's shards under FSDP2 (``pv.norm``)."""
    if not max_grad_norm:
        return 1.0, 0.0, {}
    norm = pv.norm(Ybar)
    s = clip_factor(norm, max_grad_norm)
    return s, clip_slope(norm, max_grad_norm), {"pred/grad_norm": norm, "pred/grad_clip_factor": s}


def _closed_form(ctx: ProbeContext, optimizer: torch.optim.Optimizer, Ybar: pv.Buffer,
                 max_grad_norm: float | None) -> StepModel:
    """AdamW / SGD per run of parameters that share a param group and a step count: on one flat
    vector when the run is small (host time per op dominates there; results copied into place),
    else tensor by tensor straight into the caller's buffers with reused scratch space. With
    clipping, at ``s Ybar`` (the gradient scaled in a third scratch: Ybar is the caller's)."""
    adam = plain_adamw(optimizer)
    s, kappa, facts = _clipping(Ybar, max_grad_norm)
    index = {id(p): i for i, p in enumerate(ctx.params)}
    runs: dict[tuple, list[int]] = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            i = index.get(id(p))
            if i is not None:
                runs.setdefault((gi, _step_of(optimizer, p) if adam else 0.0), []).append(i)
    missing = sorted(set(range(len(ctx.params))) - {i for idx in runs.values() for i in idx})
    if missing:
        raise ValueError(f"parameters not in the optimizer's param groups: {[ctx.names[i] for i in missing[:3]]}")
    chunks = []  # (parameter indices, hyper-parameters)
    for (gi, step), idx in runs.items():
        g = optimizer.param_groups[gi]
        h = AdamWHyper(float(g["lr"]), float(g.get("weight_decay", 0.0)), *(
            (float(g["betas"][0]), float(g["betas"][1]), float(g["eps"])) if adam else (0.0, 0.0, 0.0)), step)
        small = sum(local(ctx.params[i]).numel() for i in idx) <= pv.FLAT_MAX_NUMEL
        chunks += [(idx, h)] if small else [([i], h) for i in idx]
    names = ["gradient"] + (["momentum"] if adam else []) + (
        ["weight_decay"] if any(float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups) else [])

    def chunk_inputs(dev, dt):
        """Per chunk ``(ch, h, n, ins, scratch)``: its flat inputs (y at the clipped gradient, theta,
        AdamW's m and v) on ``dev`` in ``dt``, and two chunk-sized scratch tensors."""
        biggest = max(sum(local(ctx.params[i]).numel() for i in ch) for ch, _ in chunks)
        scratch = [torch.empty(biggest, device=dev, dtype=dt) for _ in range(2 if s == 1.0 else 3)]
        for ch, h in chunks:
            n = sum(local(ctx.params[i]).numel() for i in ch)

            def flat(ts):
                if len(ts) == 1:
                    return ts[0].reshape(-1).to(dev, dt)
                return torch.cat([t.reshape(-1).to(dev, dt) for t in ts])
            st = [_state_of(optimizer, ctx.params[i], dev, dt) for i in ch] if adam else None
            y = flat([Ybar[i] for i in ch])
            ins = {"y": y if s == 1.0 else torch.mul(y, s, out=scratch[2][:n]),
                   "theta": flat([local(ctx.params[i].detach()) for i in ch])}
            if adam:
                ins["m"], ins["v"] = flat([x[0] for x in st]), flat([x[1] for x in st])
            yield ch, h, n, ins, [x[:n] for x in scratch[:2]]

    def run_chunks(outs: dict[str, pv.Buffer], fn) -> None:
        """``fn(ch, h, ins, out_flat, scratch)`` per chunk on flat inputs; results land in ``outs``."""
        first = next(iter(outs.values()))
        for ch, h, n, ins, scratch in chunk_inputs(first[0].device, first[0].dtype):
            dev, dt = first[0].device, first[0].dtype
            direct = len(ch) == 1
            flat_out = {k: (o[ch[0]].view(-1) if direct else torch.empty(n, device=dev, dtype=dt))
                        for k, o in outs.items()}
            fn(ch, h, ins, flat_out, scratch)
            if not direct:
                for k, o in outs.items():
                    for i, t in zip(ch, flat_out[k].split([local(ctx.params[i]).numel() for i in ch])):
                        o[i].copy_(t.view(o[i].shape))

    def update(ch, h, ins, out, scratch):
        if adam:
            adamw_update_into(ins["y"], ins["m"], ins["v"], ins["theta"], h, out, scratch[0])
            return
        torch.mul(ins["y"], h.lr, out=out["gradient"])
        if "weight_decay" in out:
            torch.mul(ins["theta"], -h.lr * h.weight_decay, out=out["weight_decay"])

    def jacobian(ch, h, ins, out, scratch):
        if adam:
            adamw_jacobian_times_into(ins["y"], ins["m"], ins["v"], h, ins["x"], out["jx"], *scratch)
        else:
            torch.mul(ins["x"], h.lr, out=out["jx"])

    def jacobian_times_into(xs: pv.Buffer, out: pv.Buffer) -> None:
        """``J^T x = s J_0 x + kappa (Ybar . J_0 x) Ybar`` (math/adamw.py; ``J_0 x`` without clipping):
        ``J_0`` the diagonal Jacobian at ``s Ybar``, the dot over every parameter (and shard)."""
        def fn(ch, h, ins, o, scratch):
            ins["x"] = (xs[ch[0]].reshape(-1) if len(ch) == 1 else torch.cat([xs[i].reshape(-1) for i in ch])
                        ).to(o["jx"].device, o["jx"].dtype)
            jacobian(ch, h, ins, o, scratch)
        run_chunks({"jx": out}, fn)
        if s == 1.0:
            return
        coef = kappa * pv.dot(Ybar, out) if kappa else 0.0
        for o, y in zip(out, Ybar):
            o.mul_(s)
            if coef:
                o.add_(y.to(o.device, o.dtype), alpha=coef)

    def unit_dots(xs: pv.Buffer, Ys: pv.Buffer | None, alpha: float, beta: float, jd: pv.Buffer) -> torch.Tensor:
        """math/unit_dots.py's values for one prompt, summed over the chunks (and shards)."""
        dev, dt = jd[0].device, jd[0].dtype
        total = torch.zeros(len(ud.SLOTS), dtype=torch.float64, device=dev)

        def cat(ts):  # tensors of one chunk as one flat tensor on dev (a view for one tensor there)
            return (ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])).to(dev)
        for ch, h in chunks:
            st = [_state_of(optimizer, ctx.params[i], dev, dt) for i in ch] if adam else None
            total += ud.unit_dots(
                cat([xs[i] for i in ch]), cat([Ybar[i] for i in ch]),
                cat([Ys[i] for i in ch]) if Ys is not None else None,
                cat([jd[i] for i in ch]), h, adam, alpha, beta,
                cat([x[0] for x in st]) if adam else None, cat([x[1] for x in st]) if adam else None,
                cat([local(ctx.params[i].detach()) for i in ch]) if h.weight_decay else None)
        return reduce_shards(total)

    def dots_with(xs: pv.Buffer) -> tuple[float, float]:
        """``(x . Delta theta, sum_i |x_i| sum_part |Delta theta_part,i|)`` in fp64, chunk by chunk
        (the update recomputed in chunk-sized buffers: nothing parameter-sized is written)."""
        dev = xs[0].device
        dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        for ch, h, n, ins, scratch in chunk_inputs(dev, dt):
            out = {k: torch.empty(n, device=dev, dtype=dt) for k in names}
            update(ch, h, ins, out, scratch)
            x = torch.cat([xs[i].reshape(-1) for i in ch]).to(dev, torch.float64)
            total[0] += sum(x @ o.double() for o in out.values())
            total[1] += x.abs() @ sum(o.double().abs() for o in out.values())
        total = reduce_shards(total)
        return float(total[0]), float(total[1])

    def carries_nothing() -> bool:  # at a zero gradient SGD has no momentum part; AdamW's, -(lr/bc1) b1 m / D
        ms = [(optimizer.state.get(p) or {}).get("exp_avg") for p in ctx.params] if adam else []  # (D >= eps > 0)
        nonzero = torch.tensor(float(sum(int(torch.count_nonzero(local(m))) for m in ms if m is not None)))
        return all(float(g.get("eps", 1.0)) > 0 for g in optimizer.param_groups) and float(reduce_shards(nonzero)) == 0

    return StepModel(names, lambda outs: run_chunks(outs, update), jacobian_times_into,
                     "adamw_closed_form" if adam else "sgd_closed_form", facts, unit_dots if s == 1.0 else None,
                     dots_with, carries_nothing)


def update_dots(ctx: ProbeContext, step: StepModel, xs: pv.Buffer) -> tuple[float, float]:
    """``(x . Delta theta, sum_i |x_i| sum_part |Delta theta_part,i|)`` in fp64 for the step model's
    update: the closed forms' ``dots_with`` (chunk by chunk), else the update written into
    parameter-sized buffers (the snapshot step: it holds a copy of the parameters already)."""
    if step.dots_with is not None:
        return step.dots_with(xs)
    dev = xs[0].device
    dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
    outs = {k: [torch.empty(local(p).shape, device=dev, dtype=dt) for p in ctx.params] for k in step.names}
    step.write(outs)
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    for i, x in enumerate(xs):  # one tensor at a time: no parameter-sized |x| or |Delta theta|
        xi = x.reshape(-1).to(dev, torch.float64)
        parts = [o[i].reshape(-1).double() for o in outs.values()]
        total[0] += sum(xi @ p for p in parts)
        total[1] += xi.abs() @ sum(p.abs() for p in parts)
    total = reduce_shards(total)
    return float(total[0]), float(total[1])


def directions(ctx: ProbeContext, first: list, step: StepModel | None, device,
               storage: pv.DirectionSet | None = None) -> pv.DirectionSet:
    """A ``DirectionSet`` whose first rows are ``first`` (callables ``fill(out_buffer)``) and whose
    next rows are the step's parts (``step.names`` order), each written in place into its row
    (into ``storage`` when given: see ``paramvec.empty_directions``)."""
    like = ctx.params
    dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
    dset = pv.empty_directions(len(first) + (len(step.names) if step is not None else 0), like, device, dt,
                               storage)
    for j, fill in enumerate(first):
        fill(dset.column(j))
    if step is not None:
        step.write({k: dset.column(len(first) + j) for j, k in enumerate(step.names)})
    return dset


def mul_into(a: pv.Buffer, P: pv.Buffer | None):
    """A filler ``out = P * a`` (a copy of a when P is None) for ``directions``."""
    def fill(out: pv.Buffer) -> None:
        for i, (x, o) in enumerate(zip(a, out)):
            if P is None:
                o.copy_(x)
            else:
                torch.mul(x.to(o.device, o.dtype), P[i].to(o.device, o.dtype), out=o)
    return fill


def prediction_results(names: list[str], kind: str, step_dots: list[float], e: torch.Tensor | None,
                       u: torch.Tensor | None, facts: dict | None = None) -> dict:
    """The prediction and its parts, ``-Xbar . Delta theta_part`` (``step_dots`` are the fp64 dots
    ``Xbar . Delta theta_part`` in the order of the step model's part ``names``; ``kind`` and
    ``facts``: the step model's), with SEs from the per-unit contributions ``e`` [B_E, parts] (same
    order, already negated) and ``u`` [B_U] (``-Y_v . (J^T Xbar)``), when given."""
    vals = {k: -x for k, x in zip(names, step_dots)}
    res: dict = {"deltaH_pred": sum(vals.values()), "pred/step_model": kind, **(facts or {})}
    if len(names) > 1:
        res.update({f"deltaH_pred_{k}": v for k, v in vals.items()})
        res["pred/dominant_part"] = max(vals, key=lambda k: abs(vals[k]))
    if e is None:
        return res
    B_E = e.shape[0]
    VE = est.mean_variance(e.sum(1))
    se = math.sqrt(VE)
    lo, hi = est.interval(res["deltaH_pred"], se, B_E - 1)
    res.update({"SE_deltaH_pred": se, "ci95_pred_low": lo, "ci95_pred_high": hi, "SE_deltaH_pred_E": se})
    if len(names) > 1 and e.shape[1] == len(names):  # per part (e of the total alone: point values only)
        for j, k in enumerate(names):
            res[f"SE_deltaH_pred_{k}"] = math.sqrt(est.mean_variance(e[:, j]))
    if u is None:
        res["SE_deltaH_pred_U"] = float("nan")
        return res
    VU = est.mean_variance(u)
    df = est.welch_df([(VE, B_E), (VU, u.shape[0])])
    lo, hi = est.interval(res["deltaH_pred"], math.sqrt(VE + VU), df)
    res.update({"SE_deltaH_pred_U": math.sqrt(VU), "SE_deltaH_pred_expected": math.sqrt(VE + VU),
                "ci95_pred_expected_low": lo, "ci95_pred_expected_high": hi, "pred/expected_df": df})
    return res


@dataclass
class HeldOutPrediction:
    res: dict  # gt/B_E and ``prediction_results`` (deltaH_pred, its parts, E-side SEs)
    Xbar: pv.Buffer  # the global mean of E's X (buffers device)
    S: torch.Tensor  # [B_E, G] this rank's E sequence log-probs at theta
    entropy: torch.Tensor | None  # [B_E, G, T] token entropies at theta (None: not asked for)
    e: torch.Tensor  # [B_E, parts] per-prompt contributions ``-X_n . Delta theta_part`` (gathered);
    # [B_E, 1] (the whole update's) when predicted with ``total_only``
    token_logp: torch.Tensor | None = None  # [B_E, G, T] this rank's E token log-probs at theta


def _sum_rows_into_first(dset: pv.DirectionSet) -> None:
    """Row 0 := the sum of rows 1..k-1 (the update's parts: the whole update)."""
    first = dset.column(0)
    for o, x in zip(first, dset.column(1)):
        o.copy_(x)
    for j in range(2, dset.k):
        for o, x in zip(first, dset.column(j)):
            o.add_(x)


def held_out_unit_backward(pcfg, ctx: ProbeContext, E: RolloutBatch) -> str:
    """How the X pass over held-out E takes its per-prompt projections: ``ghost`` when
    ``probe.projection=ghost`` (layer hooks in one backward per microbatch), else
    ``probe.unit_backward`` (``resolve_unit_backward``)."""
    if pcfg.projection.value == "ghost":
        resolve_projection(pcfg, ctx, 0)  # its checks (gradient checkpointing)
        return "ghost"
    return resolve_unit_backward(pcfg, ctx, (E,))


def predict_on_held_out(ctx: ProbeContext, E: RolloutBatch, step: StepModel, pcfg,
                        with_entropy: bool = True, total_only: bool = False) -> HeldOutPrediction:
    """``deltaH_pred = -Xbar_E . Delta theta`` of a step known before it is taken, on responses E it
    was not fit to: one X pass over E projects each prompt onto the update's parts (the E side of
    every SE) and keeps E's log-probs (and, ``with_entropy``, token entropies) at theta for the
    measurement after the step. ``total_only``: each prompt is projected onto the whole update
    only (one direction instead of one per part: ``SE_deltaH_pred`` needs no more); the parts'
    values ``deltaH_pred_<part>`` stay, their SEs are not computed."""
    with ctx.phase("step_parts"):  # the update's parts, written into the projection directions
        total = total_only and len(step.names) > 1
        dirE = directions(ctx, [lambda out: None] if total else [], step, ctx.device)
        if total:
            _sum_rows_into_first(dirE)
    prepare_x(ctx, E)  # token_mean's constants from E
    with ctx.phase("accumulate_X_E"):
        accX = accumulate(ctx, E, x_loss_of(ctx), "X over held-out E", directions=dirE.first(1) if total else dirE,
                          with_entropy=ctx.x.entropy if (ctx.x.measures_tokens or with_entropy) else False,
                          unit_backward=held_out_unit_backward(pcfg, ctx, E))
        Xbar, B_E = global_mean(accX.sum_buf, accX.B)
    step_dots = pv.dot_set(Xbar, dirE).tolist()[1 if total else 0:]  # Xbar . Delta theta_part
    # each parameter tensor's part of the headline, -Xbar_i . Delta theta_i (nats): attr_pred/*
    step_terms = sum(pv.dot_terms(dirE.column(j), Xbar) for j in range(1 if total else 0, dirE.k))
    del dirE
    e = -D.gather_units(accX.proj)
    res = {"gt/B_E": B_E, **prediction_results(step.names, step.kind, step_dots, e, None, step.facts),
           **headline(list(ctx.names), [-float(t) for t in step_terms], pcfg.top_k_params)}
    return HeldOutPrediction(res, Xbar, accX.S, accX.entropy, e, accX.token_logp)
