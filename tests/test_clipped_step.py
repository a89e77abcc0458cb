"""Gradient clipping in closed form (math/adamw.py, ``step_model._closed_form``): the update of
``torch.nn.utils.clip_grad_norm_(params, c)`` then ``AdamW.step()`` (or ``SGD.step()``) is the
closed form at ``s Ybar``, ``s = min(1, c / (||Ybar|| + 1e-6))``, and the gradient of
``x . Delta theta(Ybar)`` (the U side of the SE) carries the rank-one term of ds/dy.

- Against torch's own clip and step: clipping binding and not, weight decay on, a state with
  history, two param groups (other lr, decay, betas, eps), a parameter never stepped; fp64, so the
  two computations differ by a few roundings of each coordinate (derived bound below).
- ``J^T x`` against autograd through the same closed form (torch's formula for s in tensors).
- The pipeline keeps the closed form with clipping (``adamw_closed_form``, the clip factor
  reported) and its prediction is the step the ground truth takes; the what-if scales lr factors.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import fp_tol
from entprobe.math.adamw import AdamWHyper, adamw_update, clip_factor, clip_slope, clipped_vjp
from entprobe.pipeline.stages.prediction import LINEAR_IN_LR, build_step_model, step_model_kind
from entprobe.pipeline.stages.snapshot import restored_after

SHAPES = [(5, 3), (7,), (4, 2), (6,)]


def model_with_history(opt_cls=torch.optim.AdamW, seed: int = 0):
    """Four fp64 parameters in two param groups, a state of 3 real steps on the first three (the
    fourth never got a gradient: no state), and a context as ``build_step_model`` reads it."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]
    if opt_cls is torch.optim.AdamW:
        groups = [{"params": params[:2], "weight_decay": 0.1},
                  {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}]
        opt = torch.optim.AdamW(groups, lr=1e-2)
    else:
        opt = torch.optim.SGD([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}], lr=1e-2)
    for _ in range(3):
        for p in params[:3]:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        params[3].grad = None
        opt.step()
    for p in params:
        p.grad = None
    ctx = SimpleNamespace(params=params, names=[f"p{i}" for i in range(len(params))],
                          buffers_device=torch.device("cpu"), buffers_dtype=torch.float64)
    return params, opt, ctx, gen


def torch_step(params, opt, Y, max_norm):
    """``theta_plus - theta`` of torch's clip and step with gradient ``-Y``, everything restored."""
    with restored_after(params, opt, "cpu"):
        for p, y in zip(params, Y):
            p.grad = -y.clone()
        theta = [p.detach().clone() for p in params]
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return [p.detach() - t for p, t in zip(params, theta)]


def closed_form(ctx, opt, Y, max_norm):
    """The step model's parts, written into zero buffers, and the model."""
    step = build_step_model(ctx, opt, float(opt.param_groups[0]["lr"]), Y, None, "optimizer", max_norm)
    parts = {k: [torch.zeros_like(y) for y in Y] for k in step.names}
    step.write(parts)
    return parts, step


@pytest.mark.numerics
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("bind", [True, False])
def test_the_closed_form_is_torchs_clip_and_step(opt_cls, bind):
    params, opt, ctx, gen = model_with_history(opt_cls)
    Y = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    norm = math.sqrt(sum(float(y.square().sum()) for y in Y))
    c = 0.3 * norm if bind else 10.0 * norm
    assert (clip_factor(norm, c) < 0.31) == bind and step_model_kind(opt, "optimizer") in LINEAR_IN_LR
    parts, step = closed_form(ctx, opt, Y, c)
    assert step.kind == ("adamw_closed_form" if opt_cls is torch.optim.AdamW else "sgd_closed_form")
    assert step.facts["pred/grad_clip_factor"] == clip_factor(norm, c) and step.facts["pred/grad_norm"] == pytest.approx(norm)
    real = torch_step(params, opt, Y, c)
    for i, r in enumerate(real):
        got = sum(parts[k][i] for k in step.names)
        # each coordinate: torch's chain (clip multiply, moments, root, denominator, quotient,
        # decay, the add to theta and the difference read off it) and the closed form's (its own
        # chain, the parts' sum): under 32 roundings of the largest of theta, the parts and the
        # step, in fp64. A wrong clip factor moves the gradient part by 1e-2 of itself or more.
        scale = params[i].detach().abs() + sum(parts[k][i].abs() for k in step.names) + r.abs()
        assert ((got - r).abs() <= fp_tol(torch.float64, 1.0, 32, worst_case=True) * scale).all(), (i, got - r)
    # without clipping the factor is 1 and the update the unclipped closed form, bit for bit
    if not bind:
        free, _ = closed_form(ctx, opt, Y, None)
        assert all(torch.equal(parts[k][i], free[k][i]) for k in step.names for i in range(len(Y)))


def jacobian_terms(params, opt, yflat: torch.Tensor, xflat: torch.Tensor, c: float) -> torch.Tensor:
    """Per coordinate, the sum of the absolute values of the terms that make ``J^T x`` (fp64): the
    diagonal ``(lr / bc1) [(1 - beta1) (1/D + |y| q) + beta1 |m| q] |x|`` at ``z = s y`` (q =
    ``(1 - beta2) |z| / (D^2 sqrt(bc2) sqrt(v'))``, math/adamw.py) times s, and the rank-one term's
    ``|kappa| |y_i| sum_j |y_j| (its diagonal terms)_j``."""
    norm = float(yflat.norm())
    s, kappa = clip_factor(norm, c), clip_slope(norm, c)
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    diag, off = [], 0
    for p in params:
        z = yflat[off:off + p.numel()] * s
        x = xflat[off:off + p.numel()]
        off += p.numel()
        g, st = group[id(p)], opt.state.get(p, {})
        b1, b2 = g["betas"]
        t = float(st.get("step", 0.0)) + 1
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        m = st["exp_avg"].reshape(-1) if st else torch.zeros_like(z)
        v = st["exp_avg_sq"].reshape(-1) if st else torch.zeros_like(z)
        root = (b2 * v + (1 - b2) * z * z).sqrt()
        D = root / bc2 ** 0.5 + g["eps"]
        q = torch.where(root > 0, (1 - b2) * z.abs() / (D * D * bc2 ** 0.5 * root.clamp_min(1e-300)), 0.0)
        diag.append(g["lr"] / bc1 * ((1 - b1) * (1 / D + z.abs() * q) + b1 * m.abs() * q) * x.abs())
    d = torch.cat(diag)
    return s * d + abs(kappa) * yflat.abs() * float((yflat.abs() * d).sum())


@pytest.mark.numerics
@pytest.mark.parametrize("bind", [True, False])
def test_the_gradient_of_x_dot_the_clipped_update_is_autograds(bind):
    """``jacobian_times_into(x)`` = ``J^T x``, the gradient in Ybar of ``x . Delta theta(Ybar)``,
    against autograd through torch's clip formula and ``adamw_update`` (fp64), and against
    ``torch.func.jacfwd``'s whole Jacobian on the same function."""
    params, opt, ctx, gen = model_with_history()
    Y = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    x = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    norm = math.sqrt(sum(float(y.square().sum()) for y in Y))
    c = 0.3 * norm if bind else 10.0 * norm
    group = {id(p): g for g in opt.param_groups for p in g["params"]}

    def update_at(z: torch.Tensor) -> torch.Tensor:  # the unclipped update at z, flat (J_0 at z = s y)
        out, off = [], 0
        for p in params:
            y = z[off:off + p.numel()].view(p.shape)
            off += p.numel()
            g, st = group[id(p)], opt.state.get(p, {})
            zero = torch.zeros_like(p)
            h = AdamWHyper(g["lr"], g["weight_decay"], *g["betas"], g["eps"], float(st.get("step", 0.0)))
            d = adamw_update(y, st.get("exp_avg", zero), st.get("exp_avg_sq", zero), p.detach(), h)
            out.append(sum(d.values()).reshape(-1))
        return torch.cat(out)

    def update(yflat: torch.Tensor) -> torch.Tensor:  # the clipped update: torch's factor, in tensors
        return update_at(yflat * torch.clamp(c / (yflat.norm() + 1e-6), max=1.0))

    yflat = torch.cat([y.reshape(-1) for y in Y])
    xflat = torch.cat([v.reshape(-1) for v in x])
    J = torch.func.jacfwd(update)(yflat)
    want = J.T @ xflat
    _, step = closed_form(ctx, opt, Y, c)
    out = [torch.empty_like(y) for y in Y]
    step.jacobian_times_into(x, out)
    got = torch.cat([o.reshape(-1) for o in out])
    # J^T x in fp64 by two computations of the same terms: per coordinate the diagonal's terms
    # (which cancel to eps / D^2 on a parameter never stepped) and the rank-one dot over all of
    # them: 64 roundings of their absolute values (``jacobian_terms``) bound it; the rank-one
    # term is 1e-1 of the whole here, so leaving it out fails
    terms = jacobian_terms(params, opt, yflat, xflat, c)
    assert ((got - want).abs() <= fp_tol(torch.float64, 1.0, 64, worst_case=True) * terms).all()
    diag = torch.diagonal(J) * xflat
    if bind:
        assert float((want - diag).norm()) > 1e-2 * float(want.norm())  # J is not diagonal where clipping binds
        # the reference form in math/adamw.py: the same numbers on one flat vector
        sf = clip_factor(norm, c)
        J0 = torch.func.jacfwd(update_at)(yflat * sf)
        ref = clipped_vjp(yflat, torch.diagonal(J0) * xflat, sf, clip_slope(norm, c))
        assert ((ref - want).abs() <= fp_tol(torch.float64, 1.0, 64, worst_case=True) * terms).all()
    else:
        assert clip_slope(norm, c) == 0.0
        assert ((got - diag).abs() <= fp_tol(torch.float64, 1.0, 64, worst_case=True) * terms).all()
