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

import math
from dataclasses import dataclass

import torch

from entprobe.runtime import distributed as D
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.math.factored_directions import FactoredDirections, PartCoefficients
from entprobe.runtime import sharding
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.runtime.sharding import local, reduce_shards
from entprobe.pipeline.stages.accumulate import accumulate, global_mean, prepare_x, x_loss_of
from entprobe.reporting.attribution import headline
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.variance import resolve_projection, resolve_unit_backward
from entprobe.math.adamw import StepModel
from entprobe.pipeline.stages.step_model import (  # noqa: F401  (re-exported: callers import them from here)
    LINEAR_IN_LR, build_step_model, step_model_kind, torch_own_step)


def update_dots(ctx: ProbeContext, step: StepModel, xs: pv.Buffer) -> tuple[float, float, float, float]:
    """``(x . Delta theta, sum_i |x_i| sum_part |Delta theta_part,i|, x . theta, sum_i |x_i| |theta_i|)``
    in fp64 for the step model's update (what the online step check compares the step taken with):
    the closed forms' ``dots_with`` (one blocked pass), else the update written into parameter-sized
    buffers (the snapshot step: it holds a copy of the parameters already)."""
    if step.dots_with is not None:
        return step.dots_with(xs)
    dev = xs[0].device
    dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
    outs = {k: [torch.empty(local(p).shape, device=dev, dtype=dt) for p in ctx.params] for k in step.names}
    step.write(outs)
    total = torch.zeros(4, dtype=torch.float64, device=dev)
    for i, x in enumerate(xs):  # one tensor at a time: no parameter-sized |x| or |Delta theta|
        xi = x.reshape(-1).to(dev, torch.float64)
        th = local(ctx.params[i]).detach().reshape(-1).to(dev, torch.float64)
        parts = [o[i].reshape(-1).double() for o in outs.values()]
        total[0] += sum(xi @ p for p in parts)
        total[1] += xi.abs() @ sum(p.abs() for p in parts)
        total[2] += xi @ th
        total[3] += xi.abs() @ th.abs()
    total = reduce_shards(total)
    return float(total[0]), float(total[1]), float(total[2]), float(total[3])


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


FACTORED_MIN_NUMEL = pv.FLAT_MAX_NUMEL  # below: the parts written out (memory is no limit; fewer host calls)


def factored_directions(ctx: ProbeContext, first: list, step: StepModel, device, total: bool = False
                        ) -> FactoredDirections | None:
    """The directions ``directions(ctx, first, step, device)`` writes (with ``total``: ``first``,
    then the whole update), with the update's parts held as factors of Ybar, AdamW's ``exp_avg``
    and the weights (math/factored_directions.py: ``len(first) + 1`` stored rows instead of
    ``len(first)`` + parts), when the step is plain AdamW's closed form, the model has more than
    ``FACTORED_MIN_NUMEL`` parameters, and the held tensors are where the directions are (the
    device, in their dtype), unsharded; else None."""
    dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
    dev = torch.device(device)

    def elsewhere(t: torch.Tensor) -> bool:
        return t.device.type != dev.type or (t.device.index or 0) != (dev.index or 0) or t.dtype != dt
    if step.factors_into is None or sharding.sharded() or len(first) > 1 or \
            sum(local(p).numel() for p in ctx.params) <= FACTORED_MIN_NUMEL:
        return None
    if any(elsewhere(local(p)) for p in ctx.params):
        return None
    rows = pv.empty_directions(len(first) + 1, ctx.params, dev, dt)
    coefs, ms, ybar = step.factors_into(rows.column(len(first)))
    if any(elsewhere(t) for t in ybar) or any(m is not None and elsewhere(m) for m in ms):
        return None  # Ybar or AdamW's state elsewhere or in another dtype: a conversion per dot would cost more
    for j, fill in enumerate(first):
        fill(rows.column(j))
    return FactoredDirections(rows, ybar, ms, [local(p.detach()) for p in ctx.params],
                              [PartCoefficients(*c) for c in coefs], list(step.names), total)


def update_terms(dset, Xbar: pv.Buffer, first: int = 1) -> torch.Tensor:
    """Per parameter tensor ``Xbar_i . Delta theta_i`` (the parts from row ``first`` on, summed):
    the headline's attribution, for written-out or factored directions."""
    if isinstance(dset, FactoredDirections):
        return dset.part_terms(Xbar)
    return sum(pv.dot_terms(dset.column(j), Xbar) for j in range(first, dset.k))


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
    unit_backward = held_out_unit_backward(pcfg, ctx, E)
    with ctx.phase("step_parts"):  # the update's parts, written into the projection directions
        total = total_only and len(step.names) > 1
        # held as factors (large models, AdamW), unless layer hooks read the written-out rows
        dirE = factored_directions(ctx, [], step, ctx.device) if unit_backward != "ghost" else None
        if dirE is None:
            dirE = directions(ctx, [lambda out: None] if total else [], step, ctx.device)
            if total:
                _sum_rows_into_first(dirE)
    prepare_x(ctx, E)  # token_mean's constants from E
    with ctx.phase("accumulate_X_E"):
        projected = dirE.with_total(True) if total and isinstance(dirE, FactoredDirections) else \
            dirE.first(1) if total else dirE
        accX = accumulate(ctx, E, x_loss_of(ctx), "X over held-out E", directions=projected,
                          with_entropy=ctx.x.entropy if (ctx.x.measures_tokens or with_entropy) else False,
                          unit_backward=unit_backward)
        Xbar, B_E = global_mean(accX.sum_buf, accX.B)
    skip = 1 if total and not isinstance(dirE, FactoredDirections) else 0  # the written-out total row
    step_dots = pv.dot_set(Xbar, dirE).tolist()[skip:]  # Xbar . Delta theta_part
    # each parameter tensor's part of the headline, -Xbar_i . Delta theta_i (nats): attr_pred/*
    step_terms = update_terms(dirE, Xbar, skip)
    del dirE, projected
    e = -D.gather_units(accX.proj)
    res = {"gt/B_E": B_E, **prediction_results(step.names, step.kind, step_dots, e, None, step.facts),
           **headline(list(ctx.names), [-float(t) for t in step_terms], pcfg.top_k_params)}
    return HeldOutPrediction(res, Xbar, accX.S, accX.entropy, e, accX.token_logp)
