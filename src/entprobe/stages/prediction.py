"""The prediction of the real next step, before it is taken: ``deltaH_pred = -Xbar . Delta theta(Ybar)``
with ``Delta theta`` the update the loaded optimizer will apply to the U gradient (step_math.py),
split into gradient / momentum / weight-decay parts, each with its standard error.

Per-unit contributions (units are prompts):
- E side, exactly: ``e_u = -X_u . Delta theta_part`` (mean over E = the part's prediction);
- U side, by the delta method: ``u_v = -Y_v . (J_part * Xbar)`` with J the diagonal Jacobian
  ``d Delta theta_part / d Ybar`` (the part's prediction moves by ``mean_v u_v - const`` to first
  order when U changes).
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

import torch

from entprobe import estimators as est
from entprobe import paramvec as pv
from entprobe.stages.context import ProbeContext
from entprobe.stages.ground_truth import _plain_adamw
from entprobe.stages.snapshot import restore, take
from entprobe.step_math import PARTS, AdamWHyper, StepModel, adamw_jacobian, adamw_update, sgd_update


def _state_of(opt: torch.optim.Optimizer, p: torch.Tensor, dev, dt):
    """(m, v, step) of AdamW's state for p on ``dev`` in ``dt``; zeros and step 0 without state."""
    st = opt.state.get(p)
    if not st or "exp_avg" not in st:
        z = torch.zeros(p.shape, device=dev, dtype=dt)
        return z, z, 0.0
    step = st["step"]
    return st["exp_avg"].to(dev, dt), st["exp_avg_sq"].to(dev, dt), float(step)


def _step_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> float:
    st = opt.state.get(p)
    return float(st["step"]) if st and "exp_avg" in st else 0.0


def _plain_sgd(opt: torch.optim.Optimizer) -> bool:
    return type(opt) is torch.optim.SGD and all(
        not g.get("momentum", 0.0) and not g.get("nesterov", False) and not g.get("maximize", False)
        for g in opt.param_groups)


def build_step_model(ctx: ProbeContext, optimizer: torch.optim.Optimizer, lr: float, Ybar: pv.Buffer,
                     P: pv.Buffer | None, step_mode: str, max_grad_norm: float | None) -> StepModel:
    """``Delta theta(Ybar)`` and its Jacobian on the buffers' device (at least fp32).

    ``preconditioned_sgd``: ``lr P Ybar``; plain AdamW / plain SGD: closed form per param group
    (the groups' own lr, decay, betas, eps and each parameter's step count). Anything else (other
    optimizers, gradient clipping, which rescales by the global norm): the optimizer's own step
    from the snapshot with gradient ``-Ybar``, restored bit-exactly; no Jacobian then."""
    dev = ctx.buffers_device
    dts = [torch.promote_types(y.dtype, torch.float32) for y in Ybar]
    if step_mode == "preconditioned_sgd":
        parts = {"gradient": [lr * (y.to(dev, dt) if P is None else y.to(dev, dt) * P[i].to(dev, dt))
                              for i, (y, dt) in enumerate(zip(Ybar, dts))]}
        jac = {"gradient": [torch.full_like(parts["gradient"][i], lr) if P is None else lr * P[i].to(dev, dt)
                            for i, dt in enumerate(dts)]}
        return StepModel(parts, jac, "preconditioned_sgd")
    if not max_grad_norm and (_plain_adamw(optimizer) or _plain_sgd(optimizer)):
        return _closed_form(ctx, optimizer, Ybar, dts)
    # generic: the optimizer's own step on a snapshot
    snap = take(ctx.params, optimizer, dev)
    try:
        for p, y in zip(ctx.params, Ybar):
            p.grad = (-y).to(p.device, p.dtype).contiguous()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(ctx.params, max_grad_norm)
        optimizer.step()
        delta = [(p.detach().to(dev, dt) - s.to(dev, dt)) for p, s, dt in zip(ctx.params, snap.params, dts)]
    finally:
        restore(ctx.params, optimizer, snap)
    return StepModel({"update": delta}, None, "optimizer_step")


def _closed_form(ctx: ProbeContext, optimizer: torch.optim.Optimizer, Ybar: pv.Buffer, dts) -> StepModel:
    """AdamW / SGD per run of parameters that share a param group, a step count and a dtype: on
    one flat vector when the run is small (host time per op dominates there), else per tensor."""
    dev = ctx.buffers_device
    adam = _plain_adamw(optimizer)
    index = {id(p): i for i, p in enumerate(ctx.params)}
    runs: dict[tuple, list[int]] = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            i = index.get(id(p))
            if i is not None:
                runs.setdefault((gi, _step_of(optimizer, p) if adam else 0.0, dts[i]), []).append(i)
    missing = sorted(set(range(len(ctx.params))) - {i for idx in runs.values() for i in idx})
    if missing:
        raise ValueError(f"parameters not in the optimizer's param groups: {[ctx.names[i] for i in missing[:3]]}")
    jac_keys = ("gradient", "momentum") if adam else ("gradient",)
    parts = {k: [None] * len(ctx.params) for k in PARTS}
    jac = {k: [None] * len(ctx.params) for k in jac_keys}
    for (gi, step, dt), idx in runs.items():
        g = optimizer.param_groups[gi]
        small = sum(ctx.params[i].numel() for i in idx) <= pv.FLAT_MAX_NUMEL
        chunks = [idx] if small else [[i] for i in idx]
        for ch in chunks:
            def flat(ts):
                return torch.cat([t.reshape(-1).to(dev, dt) for t in ts])
            y, theta = flat([Ybar[i] for i in ch]), flat([ctx.params[i].detach() for i in ch])
            if adam:
                states = [_state_of(optimizer, ctx.params[i], dev, dt) for i in ch]
                m, v = flat([st[0] for st in states]), flat([st[1] for st in states])
                h = AdamWHyper(float(g["lr"]), float(g.get("weight_decay", 0.0)), float(g["betas"][0]),
                               float(g["betas"][1]), float(g["eps"]), step)
                upd, jj = adamw_update(y, m, v, theta, h), adamw_jacobian(y, m, v, h)
            else:
                upd = sgd_update(y, theta, float(g["lr"]), float(g.get("weight_decay", 0.0)))
                jj = {"gradient": torch.full_like(y, float(g["lr"]))}
            sizes = [ctx.params[i].numel() for i in ch]
            for out, src in ((parts, upd), (jac, jj)):
                for k in out:
                    for i, t in zip(ch, src[k].split(sizes)):
                        out[k][i] = t.view(ctx.params[i].shape)
    if not any(float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups):
        del parts["weight_decay"]
    if not adam:
        del parts["momentum"]
    return StepModel(parts, jac, "adamw_closed_form" if adam else "sgd_closed_form")


def e_directions(step: StepModel) -> list[str]:
    """Names of the E-side directions (the update's parts), in column order."""
    return list(step.parts)


def u_direction(step: StepModel, Xbar: pv.Buffer) -> pv.Buffer | None:
    """``J * Xbar`` with J the diagonal Jacobian of the whole update in Ybar (the U side of the
    delta method); None when the Jacobian is unknown (an optimizer's own step)."""
    if step.jacobian is None:
        return None
    jac = list(step.jacobian.values())
    return [sum(j[i] for j in jac) * x.to(jac[0][i].device, jac[0][i].dtype) for i, x in enumerate(Xbar)]


def prediction_results(step: StepModel, step_dots: list[float], e: torch.Tensor | None,
                       u: torch.Tensor | None) -> dict:
    """The prediction and its parts, ``-Xbar . Delta theta_part`` (``step_dots`` are the fp64 dots
    ``Xbar . Delta theta_part`` in ``e_directions`` order), with SEs from the per-unit contributions
    ``e`` [B_E, parts] (same order, already negated) and ``u`` [B_U] (``-Y_v . (J * Xbar)``), when
    given."""
    names = e_directions(step)
    vals = {k: -x for k, x in zip(names, step_dots)}
    res: dict = {"deltaH_pred": sum(vals.values()), "pred/step_model": step.kind}
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
    if len(names) > 1:
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
