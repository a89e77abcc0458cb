"""Stage 2: per-unit projections a_u = X_u . P Ybar and b_u = Y_u . P Xbar (docs/variance.md).

Selected by ``probe.projection`` (``resolve_projection``); U is accumulated before E, so
``P Ybar`` is known during the X pass:
- ``stored``: the E side is projected during the X accumulation (one backward per unit, a device
  dot each; see accumulate.py); the Y pass also runs one backward per unit and keeps each unit's
  gradient on the model's device, so ``b_u = Y_u . P Xbar`` is a dot once Xbar is known.
  Memory: B_U (local) parameter-sized gradients.
Every side is projected onto several directions at once (``paramvec.DirectionSet``): E onto
``P Ybar`` and the parts of the update ``Delta theta``, U onto ``P Xbar`` and ``J * Xbar``; a
kept or batched gradient is read once for all of them, forward mode takes one pass per direction.
- ``fused``: the E side as above; the U side takes one forward-mode pass per direction,
  ``b_u = sum_g (A / (G Lmax)) * dS_g``, where ``dS`` is the directional derivative of S along
  ``P Xbar`` (``torch.autograd.forward_ad``, no backward, no parameter-sized host transfer).
- ``jvp``: plain Stage 1 passes, then forward-mode passes (one per direction). No per-unit backward
  and no kept gradients: the least memory.
- ``auto`` (default): ``stored`` when U's per-unit gradients fit ``unit_grads_budget_mb`` (and a
  quarter of the free CUDA memory) on every rank, else ``fused``.
- ``backward`` (reference): one backward per unit, the gradient moved to the
  buffers' device and dotted there.
- ``ghost``: the E side from layer hooks during one backward per microbatch (ghost_projection.py);
  U as ``stored`` when its gradients fit (``unit_grads_fit``), else as ``fused``. Not picked by ``auto``
  (not cheaper on CPU, docs/variance.md).

Cost (training-step units, benchmarks/README.md): the forward-mode pass is one forward carrying a tangent. Per linear layer it
does three matmuls (``W x``, ``dW x``, ``W dx``), as many as a forward+backward (``W x``,
``W^T g``, ``g x^T``), so it costs about a forward+backward over U: ~1/2 of a training step over
E ∪ U when B_E = B_U, the floor for any separate pass over one side. The E side adds a device
dot per unit, plus the price of one backward per prompt instead of per microbatch. On small
models host time per op dominates; ``_DualOperands`` keeps forward mode on PyTorch's C++ path.
"""
from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from entprobe.runtime import distributed as D
from entprobe.math import paramvec as pv
from entprobe.runtime import sharding
from entprobe.runtime.distributed import no_sync
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.config import ConfigError
from entprobe.pipeline.stages.context import ProbeContext, device_budget_bytes, model_dims
from entprobe.pipeline.stages.ghost_projection import ghost_supported
from entprobe.pipeline.stages.x_spec import Forward


def _math_sdpa():
    """Forward-mode AD needs the math SDPA kernel (fused kernels have no JVP rule)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)
    except Exception:
        return contextlib.nullcontext()


def unit_coeffs(ctx: ProbeContext, S: torch.Tensor, mb: RolloutBatch, side: str) -> torch.Tensor:
    """Per-response weights w [b, G] such that the unit vector is ``sum_g w[n,g] grad S[n,g]``
    (X in its score form, ``ctx.x.weights``; Y)."""
    if side == "X":
        return ctx.x.weights(S, mb)
    return ctx.y_weights(mb, S.device)


def _unit_tangents(ctx: ProbeContext, fwd: Forward, mb: RolloutBatch, side: str) -> torch.Tensor:
    """Per unit [b] (fp64) the directional derivative of the unit's X or Y along the dual
    parameters' tangent: ``sum_g w dS_g``, or for X in per-token form ``sum_{g,t} a dl_t + e dH_t``
    with the coefficients from the primal values."""
    if side == "X" and ctx.x.tokens:
        (lp, dlp), (ent, dent) = (fwAD.unpack_dual(t) for t in (fwd.lp, fwd.ent))
        c = ctx.x.token_coeffs(ent, mb)
        return (c.a.double() * dlp.double()).sum((-1, -2)) + (c.e.double() * dent.double()).sum((-1, -2))
    primal, tangent = fwAD.unpack_dual(fwd.S)
    return (unit_coeffs(ctx, primal, mb, side).double() * tangent.double()).sum(-1)


_T = torch.Tensor
_aten = torch.ops.aten
# ``tensor (op) python_number`` -> the ``.Scalar`` overload, whose forward formula has no second tangent
_SCALAR_OPS = {
    _T.add: _aten.add.Scalar, _T.__add__: _aten.add.Scalar, _T.__radd__: _aten.add.Scalar,
    torch.add: _aten.add.Scalar, _T.sub: _aten.sub.Scalar, _T.__sub__: _aten.sub.Scalar,
    torch.sub: _aten.sub.Scalar, _T.__rsub__: _aten.rsub.Scalar, _T.mul: _aten.mul.Scalar,
    _T.__mul__: _aten.mul.Scalar, _T.__rmul__: _aten.mul.Scalar, torch.mul: _aten.mul.Scalar,
    _T.div: _aten.div.Scalar, _T.__truediv__: _aten.div.Scalar, torch.div: _aten.div.Scalar,
}
_unpack_dual = torch._C._VariableFunctions._unpack_dual  # the C entry: no Python wrapper per call
_linear = torch.nn.functional.linear
_embedding = torch.nn.functional.embedding


def _has_tangent(t: torch.Tensor) -> bool:
    return _unpack_dual(t, 0)[1] is not None


def _writes_first_arg(func) -> bool:
    """In-place ops (``add_``, ``__iadd__``, ``__setitem__``): their first argument must stay itself."""
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


class _DualOperands(TorchFunctionMode):
    """Forward mode with backward()'s semantics, kept on its C++ formulas.

    Semantics: nn.Embedding's padding row gets no tangent through the lookup, as it gets no
    gradient there (``_without_padding_row``; without it b_u is off by 0.5% on SmolLM2).
    Host time (``_call``, values unchanged): when an op mixes a dual tensor with a plain one
    (the rotary cos/sin tables, the attention mask) or with a Python number (``x * scaling``,
    ``var + eps``, ``logits / T``), PyTorch gives the plain operand an *efficient zero* tangent,
    and ops on those run Python meta functions: ~0.5 ms of host time each, more than a small
    model's arithmetic per op. Here plain floating operands get a materialised zero tangent (once
    per tensor and microbatch: the same tables and mask feed every layer) and Python numbers go
    to the ``.Scalar`` overloads. In-place ops keep their target, and ``reset()`` between
    microbatches keeps memory flat. The builtin model's jvp pass runs ~1.8x faster with this.
    """

    def __init__(self):
        super().__init__()
        self._zeros: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (plain, its dual)
        self._padless: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (embedding, padless dual)

    def reset(self) -> None:
        self._zeros.clear()

    def _without_padding_row(self, weight: torch.Tensor, pad: int) -> torch.Tensor:
        """The embedding with its tangent's padding row zeroed, once per pass. backward() gives
        the padding row no gradient through the lookup (nn.Embedding's padding_idx), so the
        directional derivative must not move it there either. It matters when the row has a
        direction, i.e. with tied input/output embeddings (SmolLM2): the output side keeps it."""
        hit = self._padless.get(id(weight))
        if hit is None or hit[0] is not weight:
            primal, tangent = fwAD.unpack_dual(weight)
            tangent = tangent.clone()
            tangent[pad] = 0
            hit = self._padless[id(weight)] = (weight, fwAD.make_dual(primal, tangent))
        return hit[1]

    def _dual_of(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._zeros.get(id(t))
        if hit is None or hit[0] is not t:  # holding ``t`` keeps its id from being reused
            hit = self._zeros[id(t)] = (t, fwAD.make_dual(t, torch.zeros_like(t)))
        return hit[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if len(args) < 2:  # most calls: nothing to mix
            return func(*args, **kwargs)
        if func is _embedding and kwargs.get("padding_idx") is not None and _has_tangent(args[1]):
            args = (args[0], self._without_padding_row(args[1], kwargs["padding_idx"]))
        return self._call(func, args, kwargs)

    def _call(self, func, args, kwargs):
        """The host-time part: same values as ``func(*args, **kwargs)``, C++ formulas only."""
        a0 = args[0]
        if func is _linear and a0.dim() > 2 and not a0.is_contiguous():
            # a sliced input ([b, T_kept, h] of the logits) sends linear's forward formula to a
            # batched matmul against the weight expanded per row: ~8x slower than one 2-D matmul
            args = (a0.contiguous(), *args[1:])
        scalar_op = _SCALAR_OPS.get(func)
        if (scalar_op is not None and not kwargs and len(args) == 2 and isinstance(args[1], (int, float))
                and not isinstance(args[1], bool) and isinstance(a0, _T) and _unpack_dual(a0, 0)[1] is not None):
            return scalar_op(a0, args[1])
        if "out" in kwargs:
            return func(*args, **kwargs)
        # per argument: True (dual), False (plain tensor), None (not a tensor); one check each
        flags = [(_unpack_dual(a, 0)[1] is not None) if isinstance(a, _T) else None for a in args]
        if True in flags and False in flags:
            keep = 1 if _writes_first_arg(func) else 0
            args = tuple(self._dual_of(a) if f is False and i >= keep and a.is_floating_point() else a
                         for i, (a, f) in enumerate(zip(args, flags)))
        return func(*args, **kwargs)


class _Run(torch.nn.Module):
    """Runs ``fn(model)``: one ``functional_call`` then swaps the parameters for a whole pass."""

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self):
        return self.fn(self.model)


SMALL_MODEL_PARAMS = 10_000_000  # below this, time per op dominates on any device (benchmarks/README.md)


def _host_bound(ctx: ProbeContext) -> bool:
    """Small enough (< SMALL_MODEL_PARAMS) that host time per op, not arithmetic, sets the cost."""
    return sum(p.numel() for p in ctx.params) < SMALL_MODEL_PARAMS


UNIT_GRADS_ALWAYS_MB = 256.0  # kept per-unit gradients this small are never what limits memory


def resolve_projection(pcfg, ctx: ProbeContext, B_U_local: int) -> str:
    """The projection path for ``probe.projection``. ``auto``: ``stored`` when the largest local
    U shard's parameter-sized gradients fit ``unit_grads_budget_mb`` (and 1/4 of free CUDA memory)
    on every rank, and are at most ``unit_grads_max_copies`` parameter-sized copies or under
    ``UNIT_GRADS_ALWAYS_MB`` (one collective decides for all); else ``fused``. The copy cap keeps
    the probe's peak within ~2x a training process's (docs/memory.md). (Forward mode carries one
    direction a pass and the probe projects each side onto several -- P Ybar and the update's parts
    on E, P Xbar and J Xbar on U -- so ``jvp`` is not the cheap path on small models: builtin 3.4
    units against 2.2.)"""
    mode = pcfg.projection.value
    if sharding.sharded():  # the one projection path that runs sharded (config.py refuses the others)
        return "backward"
    if mode == "ghost" and not ghost_supported(ctx.model):
        raise ConfigError("probe.projection=ghost: the model uses gradient checkpointing, whose recomputed "
                          "forward the layer hooks would count twice; use probe.projection=auto")
    if mode != "auto":
        return mode
    return "stored" if unit_grads_fit(pcfg, ctx, B_U_local) else "fused"


def unit_grads_fit(pcfg, ctx: ProbeContext, B_U_local: int) -> bool:
    """Whether U's per-unit gradients may be kept (``resolve_projection``'s rule for ``stored``;
    one collective decides for every rank)."""
    B_max = -(-int(D.reduce_scalars(B_U_local)[0]) // D.world())  # shards differ by at most 1
    n = sum(p.numel() for p in ctx.params)
    need_mb = B_max * sum(p.numel() * p.element_size() for p in ctx.params) / 2**20
    # the Xbar and Ybar sums are not allocated yet: on the device they are reserved first
    reserved = 2 * n * ctx.buffers_dtype.itemsize if ctx.buffers_device == ctx.device else 0
    budget = min(pcfg.unit_grads_budget_mb, device_budget_bytes(ctx.device, reserved) / 2**20)
    fits = need_mb <= budget and (B_max <= pcfg.unit_grads_max_copies or need_mb <= UNIT_GRADS_ALWAYS_MB)
    return D.reduce_scalars(float(fits))[0] == D.world()


CUDA_HOST_BOUND_FLOPS = 2e13  # a microbatch backward below ~4 N tokens FLOPs is host-bound on a GPU


def resolve_unit_backward(pcfg, ctx: ProbeContext, batches: tuple[RolloutBatch, ...] = ()) -> str:
    """``loop`` or ``vmap`` for ``probe.unit_backward``. A batched backward (``vmap``) runs
    one backward's ops with ``b`` times its arithmetic and memory, a loop ``b`` backwards.

    ``auto``: on the CPU, ``vmap`` for models under ``SMALL_MODEL_PARAMS`` (larger ones pay the
    arithmetic in full). On CUDA, ``vmap`` while the microbatch backward stays host-bound,
    ``4 N mb_size G T < CUDA_HOST_BOUND_FLOPS`` over ``batches`` (N parameters, T padded tokens),
    and its ``mb_size`` unit gradients with their logits' gradients fit ``device_budget_bytes``:
    on an H100 with SmolLM2 (1 k-5 k tokens a microbatch) the loop costs 1.0-1.2 units a side,
    vmap 0.64-0.76 (benchmarks/README.md)."""
    mode = pcfg.unit_backward.value
    if mode != "auto":
        return mode
    if ctx.device.type != "cuda":
        return "vmap" if _host_bound(ctx) else "loop"
    n = sum(p.numel() for p in ctx.params)
    param_bytes = sum(p.numel() * p.element_size() for p in ctx.params)
    dims = model_dims(ctx.model)
    V = dims[0] if dims else 0
    tokens = max((ctx.mb_size * b.G * b.input_ids.shape[-1] for b in batches), default=0)
    host_bound = 4.0 * n * tokens < CUDA_HOST_BOUND_FLOPS
    fits = ctx.mb_size * (param_bytes + 4.0 * tokens * V) <= device_budget_bytes(ctx.device)
    return "vmap" if host_bound and fits else "loop"


def project_stored(unit_grads: list[pv.Buffer], directions: pv.DirectionSet) -> torch.Tensor:
    """Per-unit ``V_u . direction_j`` from kept per-unit gradients (row chunks ``[b, *shape]``, see
    ``Accumulated.unit_grads``): one matrix product per parameter and chunk on the device, one host
    transfer; [B, k] float64."""
    return torch.cat([pv.dot_rows_set(rows, directions) for rows in unit_grads]).cpu()


def project_jvp(ctx: ProbeContext, batch: RolloutBatch, directions: pv.DirectionSet, side: str,
                label: str, mb_size: int | None = None) -> torch.Tensor:
    """Per-unit ``V_u . direction_j`` (V = X or Y) from one forward-mode pass per direction
    (a tangent carries one direction); returns [B, k] float64.

    ``dS[n, g] = grad S[n, g] . direction`` is the tangent of S; ``V_u . direction =
    sum_g w[u, g] dS[u, g]`` with the unit's coefficients w (``unit_coeffs``). Microbatches of
    ``mb_size`` prompts (default ``ctx.mb_size``). No graph is kept: a layer's activations and
    tangents live only while it runs, but the logits and their tangent ([b G, T, V] each) do
    not shrink, so a larger microbatch is cheaper on small models yet can outgrow a training
    microbatch when the vocabulary is large (benchmarks/README.md).
    """
    entropy = "grad" if side == "X" and ctx.x.tokens else False
    return torch.stack([_jvp_pass(ctx, batch, directions.column(j), label, mb_size, entropy,
                                  lambda fwd, mb: _unit_tangents(ctx, fwd, mb, side)).cpu()
                        for j in range(directions.k)], 1)


def token_tangents(ctx: ProbeContext, batch: RolloutBatch, direction: pv.Buffer, label: str,
                   mb_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad l_t . direction, grad H_t . direction)`` for every token of ``batch`` [B, G, T] (fp64,
    CPU; 0 off the responses) from one forward-mode pass: every X of every functional and estimator
    projected onto the direction follows from them and its coefficients (benchmarks compare them)."""
    def per_mb(fwd, mb):
        return torch.stack([fwAD.unpack_dual(t).tangent.double() for t in (fwd.lp, fwd.ent)])
    out = _jvp_pass(ctx, batch, direction, label, mb_size, "grad", per_mb, cat_dim=1).cpu()
    return out[0], out[1]


def _jvp_pass(ctx: ProbeContext, batch: RolloutBatch, direction: pv.Buffer, label: str, mb_size: int | None,
              entropy, per_mb, cat_dim: int = 0) -> torch.Tensor:
    """One forward-mode pass along one direction: ``per_mb(dual forward, microbatch)`` of every
    microbatch, concatenated (dim ``cat_dim``)."""
    base = getattr(ctx.model, "module", ctx.model)  # DDP: call the wrapped module functionally
    names = [f"model.{n.removeprefix('module.')}" for n in ctx.names]
    operands = _DualOperands()

    def passes(model):
        out = []
        for start, mb in ctx.iterate(batch, mb_size or ctx.mb_size, label):
            operands.reset()
            fwd = ctx.forward_S(mb, f"{label} prompts [{start}, {start + mb.B})", model=model, with_entropy=entropy)
            out.append(per_mb(fwd, mb))  # stays on the device
        return torch.cat(out, cat_dim)

    with torch.no_grad(), fwAD.dual_level(), _math_sdpa(), operands:
        duals = {n: fwAD.make_dual(p.detach(), d.to(p.device, p.dtype))
                 for n, p, d in zip(names, ctx.params, direction)}
        proj = functional_call(_Run(base, passes), duals, args=(), strict=False)
    ctx.stats.count("jvp", batch.B * batch.G)
    return proj.cpu()


def project_backward(ctx: ProbeContext, batch: RolloutBatch, directions: pv.DirectionSet, side: str,
                     label: str) -> torch.Tensor:
    """Reference: per-unit backward, gradient copied to the directions' device, dotted there; [B, k].

    Under FSDP2 (runtime/sharding.py) a backward reduce-scatters the sum of all ranks' gradients, so the
    ranks take the global units in turn: every rank runs the owner's unit (the token batches are
    small and gathered), the others' log-probs multiplied by 0 (``context.filler``), and each
    rank dots its gradient shard with its direction shards (one all-reduce of k scalars). Every
    rank runs every unit: the per-unit pass does not get faster with more ranks, only smaller."""
    owners = D.gather_objects(batch) if sharding.sharded() else [batch]
    me = D.rank() if sharding.sharded() else 0
    out = []
    ctx.zero_grad()
    for owner, part in enumerate(owners):
        for start, mb in part.microbatches(1):
            if owner != me:
                mb.filler = True  # another rank's unit: log-probs times 0, not counted here
            with torch.enable_grad(), no_sync(ctx.model):  # probe pass: no DDP gradient all-reduce
                if side == "X":
                    fwd = ctx.forward_S(mb, f"{label} prompt {start}", with_entropy=ctx.x.entropy)
                    ctx.x.loss(fwd, mb).backward()
                else:
                    S = ctx.forward_S(mb, f"{label} prompt {start}").S
                    (unit_coeffs(ctx, S.detach(), mb, side) * S).sum().backward()
            proj = pv.dot_set(pv.grads(ctx.params), directions).cpu()
            if owner == me:
                ctx.stats.count("backward", mb.B * mb.G)
                out.append(proj)
            ctx.zero_grad()
    return torch.stack(out)
