"""Parameter-sized buffers: lists of tensors aligned with the trainable parameters.

Dots run per tensor in at least fp32 on the buffers' device; only the final scalar moves to the host.
P (Adam's diagonal preconditioner) is a buffer of the same layout; ``None`` means identity.
"""
from __future__ import annotations

from typing import Sequence

import torch

Buffer = list[torch.Tensor]


def trainable(model) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Names and parameters with requires_grad, in ``model.named_parameters()`` order."""
    pairs = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not pairs:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    return [n for n, _ in pairs], [p for _, p in pairs]


def zeros(params: Sequence[torch.Tensor], device, dtype=torch.float32) -> Buffer:
    return [torch.zeros(p.shape, device=device, dtype=dtype) for p in params]


def clone(buf: Buffer, device=None, dtype=None) -> Buffer:
    return [b.detach().to(device=device or b.device, dtype=dtype or b.dtype, copy=True) for b in buf]


def grads(params: Sequence[torch.Tensor]) -> Buffer:
    """Current ``.grad`` of each parameter (zeros where a parameter got none)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def add_grads_(buf: Buffer, params: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """``buf += scale * grad`` for every parameter that has a gradient (cast to buf's device/dtype).
    One fused ``_foreach_add_`` when every gradient already matches its buffer's device and dtype."""
    pairs = [(b, p.grad.detach()) for b, p in zip(buf, params) if p.grad is not None]
    if pairs and all(b.device == g.device and b.dtype == g.dtype for b, g in pairs):
        torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs], alpha=scale)
        return
    for b, p in zip(buf, params):
        if p.grad is not None:
            b.add_(p.grad.detach().to(b.device, b.dtype), alpha=scale)


def scale_(buf: Buffer, s: float) -> Buffer:
    for b in buf:
        b.mul_(s)
    return buf


def _flat_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both flattened in a common dtype of at least fp32 (fp64 stays fp64; bf16 is upcast),
    one tensor at a time so no full-model copy is ever made."""
    dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    return x.reshape(-1).to(dt), y.reshape(-1).to(dt)


def dot_terms(a: Buffer, b: Buffer, P: Buffer | None = None) -> torch.Tensor:
    """Per-parameter terms ``a_i . (P_i * b_i)`` as one fp64 tensor on a's first device.

    Each tensor's dot runs on its device in at least fp32 (no full-model copy is made); only the
    stacked terms move, so a caller pays one host sync for all of them."""
    terms = []
    for i, (x, y) in enumerate(zip(a, b)):
        y = y.to(x.device, non_blocking=True)
        if P is not None:
            y = y * P[i].to(x.device)
        terms.append(torch.dot(*_flat_pair(x, y)).double())
    if not terms:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([t.to(terms[0].device) for t in terms])


def dot(a: Buffer, b: Buffer, P: Buffer | None = None) -> float:
    """``sum_i a_i * P_i * b_i`` over all parameters (P None: identity): ``dot_terms`` summed in
    fp64 on the device; only the final scalar moves to the host."""
    return float(dot_terms(a, b, P).sum())


def dot_rows(rows: Buffer, b: Buffer) -> torch.Tensor:
    """``[dot(row_u, b) for u]`` for a buffer of stacked rows (``[n, *shape]`` per parameter), as
    ``dot`` does it: at least fp32 per tensor on the rows' device, the per-tensor terms summed in
    fp64. One matrix-vector product per parameter; returns [n] fp64 on the rows' device."""
    total = None
    for x, y in zip(rows, b):
        dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        term = (x.reshape(x.shape[0], -1).to(dt) @ y.to(x.device).reshape(-1).to(dt)).double()
        total = term if total is None else total + term
    return total


def mul(a: Buffer, P: Buffer | None, device=None) -> Buffer:
    """Elementwise ``P * a`` (a copy), optionally moved to ``device``."""
    if P is None:
        return clone(a, device)
    return [(x.to(device or x.device) * p.to(device or x.device)) for x, p in zip(a, P)]


def norm(a: Buffer) -> float:
    """``sqrt(sum_i |a_i|^2)``: per-tensor norms in at least fp32 (one multi-tensor op when the
    tensors share a device and dtype), combined in fp64; one host sync."""
    if not a:
        return 0.0
    xs = [x if x.dtype in (torch.float32, torch.float64) else x.float() for x in a]
    if len({(x.device, x.dtype) for x in xs}) == 1:
        per = torch.stack(torch._foreach_norm(xs)).double()
    else:
        per = torch.stack([torch.linalg.vector_norm(x).double().to(xs[0].device) for x in xs])
    return float(per.square().sum().sqrt())


def adam_preconditioner(exp_avg_sq: Buffer, step: int, beta2: float, eps: float,
                        device=None, dtype=torch.float32) -> Buffer:
    """``P = 1 / (sqrt(v_hat) + eps)`` with ``v_hat = exp_avg_sq / (1 - beta2**step)``."""
    if step < 1:
        raise ValueError(f"Adam state has step={step}; the preconditioner needs step >= 1")
    bc = 1.0 - beta2 ** step
    return [(1.0 / ((v.to(device=device, dtype=torch.float64) / bc).sqrt() + eps)).to(dtype)
            for v in exp_avg_sq]


# ---------------------------------------------------------------- several directions at once
DirectionSet = list[torch.Tensor]  # per parameter a [numel, k] matrix: k directions, column j is one


def stack_directions(bufs: Sequence[Buffer], device=None, dtype=None) -> DirectionSet:
    """k buffers -> one ``[numel, k]`` matrix per parameter (on ``device`` in ``dtype``, default
    the first buffer's), so that a gradient is read once for all k dots."""
    out = []
    for ts in zip(*bufs):
        dev, dt = device or ts[0].device, dtype or ts[0].dtype
        out.append(torch.stack([t.reshape(-1).to(dev, dt) for t in ts], 1))
    return out


def num_directions(dset: DirectionSet) -> int:
    return dset[0].shape[1] if dset else 0


def column(dset: DirectionSet, j: int, like: Sequence[torch.Tensor]) -> Buffer:
    """Direction j as a buffer shaped like ``like`` (a copy)."""
    return [d[:, j].reshape(p.shape).contiguous() for d, p in zip(dset, like)]


def dot_set(a: Buffer, dset: DirectionSet) -> torch.Tensor:
    """``[dot(a, direction_j) for j]`` as [k] fp64 on the directions' first device: per tensor one
    vector-matrix product in at least fp32, the terms summed in fp64."""
    total = None
    for x, d in zip(a, dset):
        dt = torch.promote_types(torch.promote_types(x.dtype, d.dtype), torch.float32)
        term = (x.reshape(-1).to(d.device, dt) @ d.to(dt)).double()
        total = term if total is None else total + term.to(total.device)
    return total


def dot_rows_set(rows: Buffer, dset: DirectionSet) -> torch.Tensor:
    """Per-unit dots of stacked rows (``[n, *shape]`` per parameter) with k directions: [n, k] fp64
    on the rows' device, one matrix product per parameter."""
    total = None
    for x, d in zip(rows, dset):
        dt = torch.promote_types(torch.promote_types(x.dtype, d.dtype), torch.float32)
        term = (x.reshape(x.shape[0], -1).to(dt) @ d.to(x.device, dt)).double()
        total = term if total is None else total + term
    return total
