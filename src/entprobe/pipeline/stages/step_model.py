"""The model of the update the loaded optimizer will apply to a gradient (``StepModel``, math/adamw.py):
AdamW and SGD in closed form per run of parameters sharing a param group and a step count (with the
trainer's gradient clipping), else the optimizer's own step on a snapshot of the parameters, split into
gradient / momentum / weight-decay parts. ``step_model_kind`` says which a run gets, ``LINEAR_IN_LR``
which are exactly linear in the lr at a fixed gradient.
"""
from __future__ import annotations

import torch

from entprobe.math import paramvec as pv
from entprobe.math import unit_dots as ud
from entprobe.runtime.sharding import like_param, local, reduce_shards
from entprobe.pipeline.stages.chunked_step import chunked_step_applies, step_on
from entprobe.pipeline.stages.chunked_step import torch_own_step  # noqa: F401 (prediction.py imports it here)
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.step_split import plain_adamw
from entprobe.pipeline.stages.snapshot import restore, take
from entprobe.math.adamw import (AdamWHyper, StepModel, adamw_factors_into, adamw_jacobian_times_into,
                                 adamw_update_into, clip_factor, clip_slope)


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
    ``clip_grad_norm_``), restored bit-exactly; no Jacobian then. Where the ground truth's step is
    chunked (stages/chunked_step.py: torch's own Adam / AdamW / SGD, unsharded, no hooks), so is
    this one, and its snapshot holds the weights only (Adam with amsgrad: 1 copy instead of 4)."""
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

    def step_into(outs):  # the optimizer's own step on a snapshot (of the weights only, when chunked)
        chunked = chunked_step_applies(optimizer, ctx.params, ctx.buffers_device, "optimizer")
        snap = take(ctx.params, optimizer, ctx.buffers_device, live_state=chunked)
        try:
            for p, y in zip(ctx.params, Ybar):
                p.grad = like_param(p, (-y).to(p.device, p.dtype).contiguous())
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ctx.params, max_grad_norm)
            step_on(optimizer, snap)
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
        if not adam:
            torch.mul(ins["x"], h.lr, out=out["jx"])
            return
        # block by block (ud.BLOCK elements): the 13 elementwise passes stay in cache, and only the first
        # block of the scratch tensors is touched (a fresh parameter-sized scratch is page-faulted in full:
        # 0.6 s for 28 M elements on a 2-core VM, against 0.08 s for the blocked passes over them)
        n = ins["y"].numel()
        for a in range(0, n, ud.BLOCK):
            b = min(a + ud.BLOCK, n)
            adamw_jacobian_times_into(ins["y"][a:b], ins["m"][a:b], ins["v"][a:b], h, ins["x"][a:b], out["jx"][a:b],
                                      scratch[0][:b - a], scratch[1][:b - a])

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

    def dots_with(xs: pv.Buffer) -> tuple[float, float, float, float]:
        """``(x . Delta theta, sum_i |x_i| sum_part |Delta theta_part,i|, x . theta, sum_i |x_i| |theta_i|)``
        in fp64, in one blocked pass (math/unit_dots.py ``check_dots``): nothing parameter-sized is
        written, and every input is read once."""
        dev = xs[0].device
        total = torch.zeros(len(ud.CHECK_SLOTS), dtype=torch.float64, device=dev)

        def cat(ts):  # tensors of one chunk as one flat tensor on dev (a view for one tensor there)
            return (ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])).to(dev)
        for ch, h in chunks:
            st = [_state_of(optimizer, ctx.params[i], dev, None) for i in ch] if adam else None  # own dtype
            y = cat([Ybar[i] for i in ch])
            total += ud.check_dots(cat([xs[i] for i in ch]), y if s == 1.0 else y * s,
                                   cat([local(ctx.params[i].detach()) for i in ch]), h, adam,
                                   cat([x[0] for x in st]) if adam else None, cat([x[1] for x in st]) if adam else None)
        total = reduce_shards(total)
        return float(total[:3].sum()), float(total[3]), float(total[4]), float(total[5])

    def factors_into(out: pv.Buffer) -> tuple[list[tuple[float, float, float]], list[torch.Tensor | None], pv.Buffer]:
        """``out[i] = R_i`` (math/adamw.py ``adamw_factors_into``) tensor by tensor, each
        parameter's constants, AdamW's live ``exp_avg`` (None: no state, a zero momentum) and the
        Ybar they are factors of (unclipped: the clipping factor is in the constants)."""
        coefs: list = [None] * len(ctx.params)
        ms: list = [None] * len(ctx.params)
        for ch, h in chunks:
            for i in ch:
                o, p = out[i], ctx.params[i]
                st = optimizer.state.get(p) or {}
                v = local(st["exp_avg_sq"]).to(o.device, o.dtype) if "exp_avg_sq" in st else torch.zeros_like(o)
                coefs[i] = adamw_factors_into(Ybar[i].to(o.device, o.dtype).view(o.shape), v.view(o.shape), h, o, s)
                ms[i] = local(st["exp_avg"]) if "exp_avg" in st else None
        return coefs, ms, Ybar

    def carries_nothing() -> bool:  # at a zero gradient SGD has no momentum part; AdamW's, -(lr/bc1) b1 m / D
        ms = [(optimizer.state.get(p) or {}).get("exp_avg") for p in ctx.params] if adam else []  # (D >= eps > 0)
        nonzero = torch.tensor(float(sum(int(torch.count_nonzero(local(m))) for m in ms if m is not None)))
        return all(float(g.get("eps", 1.0)) > 0 for g in optimizer.param_groups) and float(reduce_shards(nonzero)) == 0

    return StepModel(names, lambda outs: run_chunks(outs, update), jacobian_times_into,
                     "adamw_closed_form" if adam else "sgd_closed_form", facts, unit_dots if s == 1.0 else None,
                     dots_with, carries_nothing, factors_into if adam else None)
