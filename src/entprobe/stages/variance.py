"""Stage 2: per-unit projections a_u = X_u . P Ybar and b_u = Y_u . P Xbar (seed 000 Part A).

Two ways, selected by ``probe_rework.projection``:
- ``fused`` (default): the E side is projected during the X accumulation (see accumulate.py); the
  U side takes one forward-mode pass, ``b_u = sum_g (A / (G Lmax)) * dS_g``, where ``dS`` is the
  directional derivative of S along ``P Xbar`` (``torch.autograd.forward_ad``, no backward, no
  parameter-sized host transfer).
- ``backward`` (reference, seed-literal): one backward per unit, the gradient moved to the
  buffers' device and dotted there.
"""
from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call

from entprobe import paramvec as pv
from entprobe.estimators import weighted_S, x_unit_coeffs, y_unit_coeffs
from entprobe.rollout import RolloutBatch
from entprobe.stages.context import ProbeContext


def _math_sdpa():
    """Forward-mode AD needs the math SDPA kernel (fused kernels have no JVP rule)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    except Exception:
        return contextlib.nullcontext()


def unit_coeffs(ctx: ProbeContext, S: torch.Tensor, mb: RolloutBatch, side: str) -> torch.Tensor:
    """Per-response weights w [b, G] such that the unit vector is ``sum_g w[n,g] grad S[n,g]``."""
    if side == "X":
        Sw = weighted_S(S, mb.gen_lengths.to(S.device), mb.Lmax.to(S.device), ctx.weighting_mode)
        return x_unit_coeffs(Sw)
    return y_unit_coeffs(mb.advantages.to(S.device), mb.Lmax.to(S.device))


def project_jvp(ctx: ProbeContext, batch: RolloutBatch, direction: pv.Buffer, side: str,
                label: str) -> torch.Tensor:
    """Per-unit ``V_u . direction`` (V = X or Y) from one forward-mode pass; returns [B] float64."""
    base = getattr(ctx.model, "module", ctx.model)  # DDP: call the wrapped module functionally
    names = [n.removeprefix("module.") for n in ctx.names]
    out = []
    with torch.no_grad(), fwAD.dual_level(), _math_sdpa():
        duals = {n: fwAD.make_dual(p.detach(), d.to(p.device, p.dtype))
                 for n, p, d in zip(names, ctx.params, direction)}

        def call(**kw):
            return functional_call(base, duals, args=(), kwargs=kw, strict=False)

        for start, mb in ctx.iterate(batch, ctx.mb_size, label):
            S, _, _ = ctx.forward_S(mb, f"{label} prompts [{start}, {start + mb.B})", model=call)
            primal, tangent = fwAD.unpack_dual(S)
            w = unit_coeffs(ctx, primal, mb, side)
            out.append((w.double() * tangent.double()).sum(-1).cpu())
    ctx.stats.count("jvp", batch.B * batch.G)
    return torch.cat(out)


def project_backward(ctx: ProbeContext, batch: RolloutBatch, direction: pv.Buffer, side: str,
                     label: str) -> torch.Tensor:
    """Reference: per-unit backward, gradient copied to the direction's device, dotted there."""
    out = []
    ctx.zero_grad()
    for start, mb in ctx.iterate(batch, 1, label):
        with torch.enable_grad():
            S, _, _ = ctx.forward_S(mb, f"{label} prompt {start}")
            w = unit_coeffs(ctx, S.detach(), mb, side)
            (w * S).sum().backward()
        ctx.stats.count("backward", mb.B * mb.G)
        host = [g.detach().to(d.device, d.dtype) for g, d in zip(pv.grads(ctx.params), direction)]
        out.append(pv.dot(host, direction))
        ctx.zero_grad()
    return torch.tensor(out, dtype=torch.float64)
