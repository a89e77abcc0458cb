"""Parameter-sized buffers: lists of tensors aligned with the trainable parameters.

Dots run per tensor in at least fp32 on the buffers' device; only the final scalar moves to the host.
P (Adam's diagonal preconditioner) is a buffer of the same layout; ``None`` means identity.
Under FSDP2 (runtime/sharding.py) a buffer holds this rank's shard of each parameter-sized tensor, laid
out like the parameter's local shard; every dot, norm and projection is the local one plus one
all-reduce of its scalars (``sharding.reduce_shards``), so it equals the unsharded value.
"""
from __future__ import annotations

from typing import Sequence

import torch

from entprobe.runtime.sharding import local, reduce_shards

Buffer = list[torch.Tensor]


def trainable(model) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Names and parameters with requires_grad, in ``model.named_parameters()`` order."""
    pairs = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not pairs:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    return [n for n, _ in pairs], [p for _, p in pairs]


def zeros(params: Sequence[torch.Tensor], device, dtype=torch.float32) -> Buffer:
    """Zeros shaped like each parameter's (local shard of the) tensor."""
    return [torch.zeros(local(p).shape, device=device, dtype=dtype) for p in params]


def clone(buf: Buffer, device=None, dtype=None) -> Buffer:
    return [b.detach().to(device=device or b.device, dtype=dtype or b.dtype, copy=True) for b in buf]


def grads(params: Sequence[torch.Tensor]) -> Buffer:
    """Current ``.grad`` of each parameter, this rank's shard under FSDP2 (zeros where a parameter
    got none)."""
    return [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]


def add_grads_(buf: Buffer, params: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """``buf += scale * grad`` for every parameter that has a gradient (cast to buf's device/dtype).
    One fused ``_foreach_add_`` when every gradient already matches its buffer's device and dtype."""
    pairs = [(b, local(p.grad.detach())) for b, p in zip(buf, params) if p.grad is not None]
    if pairs and all(b.device == g.device and b.dtype == g.dtype for b, g in pairs):
        torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs], alpha=scale)
        return
    for b, g in pairs:
        b.add_(g.to(b.device, b.dtype), alpha=scale)


def scale_(buf: Buffer, s: float) -> Buffer:
    for b in buf:
        b.mul_(s)
    return buf


_FP64_CHUNK = 1 << 24  # elements per piece of an fp64 dot: 128 MiB a copy, whatever the tensor's size


def _dot1(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x . y`` (flattened) in a common dtype of at least ``dtype`` (fp32: bf16 is upcast, fp64
    stays fp64), as an fp64 scalar; one tensor at a time, so no full-model copy is ever made, and
    an fp64 upcast in pieces of ``_FP64_CHUNK`` elements, so not even a whole tensor's."""
    dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), dtype)
    x, y = x.reshape(-1), y.reshape(-1)
    if dt != torch.float64 or x.numel() <= _FP64_CHUNK:
        return torch.dot(x.to(dt), y.to(dt)).double()
    return torch.stack([torch.dot(x[k:k + _FP64_CHUNK].to(dt), y[k:k + _FP64_CHUNK].to(dt))
                        for k in range(0, x.numel(), _FP64_CHUNK)]).sum()


def dot_terms(a: Buffer, b: Buffer, P: Buffer | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-parameter terms ``a_i . (P_i * b_i)`` as one fp64 tensor on a's first device.

    Each tensor's dot runs on its device in at least ``dtype`` (``_dot1``; no full-model copy is
    made); only the stacked terms move, so a caller pays one host sync for all of them."""
    terms = []
    for i, (x, y) in enumerate(zip(a, b)):
        y = y.to(x.device, non_blocking=True)
        if P is not None:
            y = y * P[i].to(x.device)
        terms.append(_dot1(x, y, dtype))
    if not terms:
        return torch.zeros(0, dtype=torch.float64)
    return reduce_shards(torch.stack([t.to(terms[0].device) for t in terms]))


def dot(a: Buffer, b: Buffer, P: Buffer | None = None, dtype: torch.dtype = torch.float32) -> float:
    """``sum_i a_i * P_i * b_i`` over all parameters (P None: identity): ``dot_terms`` summed in
    fp64 on the device; only the final scalar moves to the host. ``dtype=torch.float64``: the
    products too (those of fp32 or bf16 numbers are exact there), so the difference of two dots
    with nearby ``b`` (``Xbar . theta_plus - Xbar . theta``) is the dot with the difference to
    fp64 rounding, where fp32 products and sums would lose it in the rounding of the large dots."""
    return float(dot_terms(a, b, P, dtype).sum())


def where_at_least(c: Buffer, threshold: float) -> list[tuple[int, torch.Tensor]]:
    """``[(i, flat indices where c_i >= threshold)]`` for the tensors that have any. A tensor whose
    largest value is below the threshold costs one read and no allocation (the selected
    coordinates are usually few: Adam's never-updated rows)."""
    out = []
    for i, z in enumerate(c):
        if z.numel() and float(z.amax()) >= threshold:
            out.append((i, (z.reshape(-1) >= threshold).nonzero().squeeze(1)))
    return out


def dot_at(a: Buffer, b: Buffer, index: list[tuple[int, torch.Tensor]]) -> float:
    """``sum a_i b_i`` over the coordinates of ``index`` (``where_at_least``), in at least fp32 per
    tensor, summed in fp64."""
    total = torch.zeros((), dtype=torch.float64)
    for i, idx in index:
        x, y = a[i].reshape(-1), b[i].reshape(-1).to(a[i].device)
        dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        idx = idx.to(x.device)
        total += torch.dot(x[idx].to(dt), y[idx].to(dt)).double().cpu()
    return float(reduce_shards(total))



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
    return float(reduce_shards(per.square().sum()).sqrt())


def _adam_p(v: torch.Tensor, bc: float, eps: float, device, dtype) -> torch.Tensor:
    """``1 / (sqrt(v / bc) + eps)`` for one tensor, computed in fp64."""
    return (1.0 / ((v.to(device=device, dtype=torch.float64) / bc).sqrt() + eps)).to(dtype)


def adam_preconditioner(exp_avg_sq: Buffer, step: int, beta2: float, eps: float,
                        device=None, dtype=torch.float32) -> Buffer:
    """``P = 1 / (sqrt(v_hat) + eps)`` with ``v_hat = exp_avg_sq / (1 - beta2**step)``, as a buffer."""
    if step < 1:
        raise ValueError(f"Adam state has step={step}; the preconditioner needs step >= 1")
    bc = 1.0 - beta2 ** step
    return [_adam_p(v, bc, eps, device, dtype) for v in exp_avg_sq]


class LiveAdamPreconditioner(Sequence):
    """``P`` as ``adam_preconditioner`` computes it, one tensor at a time when read (``P[i]``,
    iteration), from the optimizer's own ``exp_avg_sq`` of parameter i: the probe holds no
    parameter-sized copy of P. ``step``, ``beta2`` and ``eps`` are fixed when it is made; reading
    it between a real optimizer step and that step's restore would see the stepped moments (the
    ground-truth stage reads it only before its step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], step: int,
                 beta2: float, eps: float, device=None, dtype=torch.float32):
        if step < 1:
            raise ValueError(f"Adam state has step={step}; the preconditioner needs step >= 1")
        self.optimizer, self.params = optimizer, list(params)
        self.bc, self.eps, self.device, self.dtype = 1.0 - beta2 ** step, eps, device, dtype

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, i: int) -> torch.Tensor:
        v = local(self.optimizer.state[self.params[i]]["exp_avg_sq"])  # this rank's shard under FSDP2
        return _adam_p(v, self.bc, self.eps, self.device, self.dtype)


# ---------------------------------------------------------------- several directions at once
FLAT_MAX_NUMEL = 10_000_000  # below this, per-tensor loops cost more host time than one flat copy


class DirectionSet:
    """k parameter-sized directions: a gradient is read once for all k dots. Stored as one
    ``[k, N]`` matrix ``mat`` (N = total numel, parameters in order; parameter i's block is
    ``mat[:, off_i:off_i + n_i]``) when N <= ``FLAT_MAX_NUMEL`` (one matrix product for all
    parameters), else as one ``[k, n_i]`` tensor per parameter (``blocks``): separate allocations,
    each small enough to come from the allocator's heap and be reused warm, where one [k, N]
    matrix of a 135M-parameter model is a 2 GB mapping whose pages fault in anew on every probe."""

    def __init__(self, shapes: list[torch.Size], mat: torch.Tensor | None = None,
                 blocks: list[torch.Tensor] | None = None):
        if (mat is None) == (blocks is None):
            raise ValueError("DirectionSet: give mat or blocks")
        self.mat, self.blocks, self.shapes = mat, blocks, shapes
        self.offsets = [0]
        for sh in shapes:
            self.offsets.append(self.offsets[-1] + sh.numel())

    @property
    def k(self) -> int:
        return self.mat.shape[0] if self.mat is not None else self.blocks[0].shape[0]

    @property
    def device(self) -> torch.device:
        return (self.mat if self.mat is not None else self.blocks[0]).device

    @property
    def dtype(self) -> torch.dtype:
        return (self.mat if self.mat is not None else self.blocks[0]).dtype

    def block(self, i: int) -> torch.Tensor:
        """Parameter i's ``[k, n_i]`` block (rows contiguous)."""
        if self.mat is not None:
            return self.mat[:, self.offsets[i]:self.offsets[i + 1]]
        return self.blocks[i]

    def column(self, j: int) -> Buffer:
        """Direction j as a buffer of views shaped like the parameters."""
        return [self.block(i)[j].view(sh) for i, sh in enumerate(self.shapes)]

    def first(self, k: int) -> "DirectionSet":
        """The first k directions, sharing this set's storage."""
        if self.mat is not None:
            return DirectionSet(self.shapes, mat=self.mat[:k])
        return DirectionSet(self.shapes, blocks=[b[:k] for b in self.blocks])


class OneAtATime:
    """k directions written one at a time into one buffer, for passes that read one direction each
    (forward mode: one tangent a pass): ``column(j)`` writes direction j with ``fills[j](buffer)``
    over the previous one and returns the buffer, so the passes hold one parameter-sized copy
    instead of k. Each column must be used up before the next is asked for."""

    def __init__(self, fills: list, like: Sequence[torch.Tensor], device, dtype):
        self.fills, self.buffer = fills, [torch.empty(local(t).shape, device=device, dtype=dtype) for t in like]

    @property
    def k(self) -> int:
        return len(self.fills)

    def column(self, j: int) -> Buffer:
        self.fills[j](self.buffer)
        return self.buffer


def is_zero(dset: DirectionSet) -> bool:
    """Whether every entry of every direction is exactly 0 (a NaN is not), over all shards: one
    count of nonzeros per storage tensor and one all-reduce. (A set held as factors,
    math/factored_directions.py, answers for itself, as in ``dot_set`` and ``dot_rows_set``.)"""
    if hasattr(dset, "is_zero"):
        return dset.is_zero()
    parts = [dset.mat] if dset.mat is not None else dset.blocks
    nonzero = torch.stack([torch.count_nonzero(t) for t in parts]).sum().double()
    return float(reduce_shards(nonzero)) == 0.0


def empty_directions(k: int, like: Sequence[torch.Tensor], device, dtype,
                     storage: DirectionSet | None = None) -> DirectionSet:
    """An uninitialised ``DirectionSet`` of k directions shaped like ``like``; fill its columns.
    ``storage`` (a set of >= k directions of the same shapes, device and dtype no longer needed)
    is reused instead of a fresh allocation (a parameter-sized allocation is a page-faulted pass
    on CPU)."""
    shapes = [local(t).shape for t in like]
    N = sum(sh.numel() for sh in shapes)
    if storage is not None and storage.k >= k and storage.shapes == shapes and \
            storage.device == torch.device(device) and storage.dtype == dtype:
        return storage.first(k)
    if N <= FLAT_MAX_NUMEL:
        return DirectionSet(shapes, mat=torch.empty((k, N), device=device, dtype=dtype))
    return DirectionSet(shapes, blocks=[torch.empty((k, sh.numel()), device=device, dtype=dtype) for sh in shapes])


def stack_directions(bufs: Sequence[Buffer], device=None, dtype=None) -> DirectionSet:
    """k buffers -> a ``DirectionSet`` on ``device`` in ``dtype`` (default: the first tensor's)."""
    first = bufs[0][0]
    dset = empty_directions(len(bufs), bufs[0], device or first.device, dtype or first.dtype)
    for j, buf in enumerate(bufs):
        for t, out in zip(buf, dset.column(j)):
            out.copy_(t.reshape(out.shape))
    return dset


def _dt(x: torch.Tensor, d: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, d.dtype), torch.float32)


def dot_set(a: Buffer, dset: DirectionSet) -> torch.Tensor:
    """``[dot(a, direction_j) for j]`` as [k] fp64 on the directions' device: one matrix-vector
    product over the concatenated tensors for small models, else one per tensor (terms in fp64)."""
    if hasattr(dset, "dot"):
        return dset.dot(a)
    dev, dt = dset.device, _dt(a[0], dset.block(0))
    if dset.mat is not None:
        flat = torch.cat([x.reshape(-1).to(dev, dt) for x in a])
        return reduce_shards((dset.mat.to(dt) @ flat).double())
    total = torch.zeros(dset.k, dtype=torch.float64, device=dev)
    for i, x in enumerate(a):
        total += (dset.block(i).to(dt) @ x.reshape(-1).to(dev, dt)).double()
    return reduce_shards(total)


def dot_rows_set(rows: Buffer, dset: DirectionSet) -> torch.Tensor:
    """Per-unit dots of stacked rows (``[n, *shape]`` per parameter) with the k directions:
    [n, k] fp64 on the rows' device (one matrix product, per tensor for large models)."""
    if hasattr(dset, "dot_rows"):
        return dset.dot_rows(rows).to(rows[0].device)
    dev = rows[0].device
    dt = _dt(rows[0], dset.block(0))
    n = rows[0].shape[0]
    if dset.mat is not None:
        flat = torch.cat([x.reshape(n, -1).to(dt) for x in rows], 1)
        return reduce_shards((flat @ dset.mat.to(dev, dt).T).double())
    total = torch.zeros((n, dset.k), dtype=torch.float64, device=dev)
    for i, x in enumerate(rows):
        total += (x.reshape(n, -1).to(dt) @ dset.block(i).to(dev, dt).T).double()
    return reduce_shards(total)
