"""Per-unit projections from ONE backward over a microbatch (``probe.projection=ghost``), read off
each layer's activations and output gradients with module hooks, as ghost-norm and in-run data
attribution methods read per-example gradients.

A unit's rows are independent of the other units' (no op mixes batch rows), so the output
gradient of a layer on unit u's rows is the gradient of unit u's loss alone, and a parameter's
per-unit gradient is a sum over u's tokens t (docs/variance.md):

- ``nn.Linear`` (input a_t, output gradient g_t): ``grad_u W = sum_t g_t a_t^T``, so
  ``grad_u W . V = sum_t g_t . (V a_t)`` (``ghost_linear``); where the b per-unit gradients fit
  ``MATERIALIZE_MAX_BYTES`` they are formed instead (one batched matmul, the same arithmetic as
  the weight gradient) and dotted; bias: ``sum_t g_t . v``.
- ``nn.Embedding``: ``sum_t V[token_t] . g_t`` over tokens other than ``padding_idx`` (which gets no
  gradient through the lookup).
- Norms whose output is elementwise affine in their weight (``nn.LayerNorm``, ``nn.RMSNorm``, Hugging
  Face ``*RMSNorm``): ``grad_u w = sum_t g_t * xhat_t`` with ``xhat = f(w=1) - f(w=0)`` (covers
  ``w * xhat`` and ``(1 + w) * xhat``); bias: ``sum_t g_t``.

The hooks also write each covered parameter's summed gradient into ``.grad`` (from the same
products: the per-unit gradients' sum, or ``g^T a`` added in place), with its ``requires_grad``
off during the pass, so autograd takes activation gradients only: the pass costs about a plain
forward+backward plus the dots. A parameter is covered when every module holding it is one of
these, computing as the torch class does (its own forward, no parameter but weight and bias; not
inside ``nn.MultiheadAttention``, which uses its ``out_proj`` weight without calling the layer)
(tied embeddings: the lookup and the output layer add their parts). The others
(``GhostHooks.uncovered``) take a batched backward restricted to them (``accumulate``). Not under
gradient checkpointing in train mode (its recomputed forward would fire the hooks twice;
``ghost_supported``).
"""
from __future__ import annotations

import contextlib

import torch
from torch.func import functional_call

from entprobe.math import paramvec as pv

# a layer's b per-unit gradients are formed when they take at most this: below glibc's largest
# mmap threshold, so the allocation is recycled warm (a larger one is a fresh mapping whose pages
# fault in on every call, benchmarks/README.md); SmolLM2's 28 M-parameter output layer takes ghost_linear
MATERIALIZE_MAX_BYTES = 32 * 2**20


def ghost_linear(a: torch.Tensor, g: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``[b, k]``: ``sum_t g[u, t] . (D_j a[u, t])`` for a: [b, n, in], g: [b, n, out], D: [k, out, in];
    one matmul per direction on the narrower side (``g D_j`` when out > in, else ``a D_j^T``),
    reading D in place (no permuted copy)."""
    b = a.shape[0]
    a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    wide = D.shape[1] > D.shape[2]
    cols = [((g2 @ Dj) * a2 if wide else (a2 @ Dj.T) * g2).reshape(b, -1).sum(1) for Dj in D]
    return torch.stack(cols, 1)


def linear_projection(a: torch.Tensor, g: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[b, k]`` projections, the summed gradient ``[out, in]`` or None). The b per-unit gradients
    ``g_u^T a_u`` are formed (one batched matmul: the weight gradient's arithmetic), dotted with D
    and summed when they take at most ``MATERIALIZE_MAX_BYTES``; else ``ghost_linear`` (k matmuls of
    the layer's forward size) and None: the caller adds ``g^T a`` to ``.grad`` in place."""
    b, out, inn = a.shape[0], D.shape[1], D.shape[2]
    if b * out * inn * D.element_size() <= MATERIALIZE_MAX_BYTES:
        Gu = torch.bmm(g.transpose(1, 2), a)
        return Gu.reshape(b, -1) @ D.reshape(D.shape[0], -1).T, Gu.sum(0)
    return ghost_linear(a, g, D), None


def embedding_projection(ids: torch.Tensor, g: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``[b, k]``: ``sum_t D_j[ids[u, t]] . g[u, t]`` (ids [b, n], g [b, n, h], D [k, V, h]); the
    caller zeroes g at the padding token (nn.Embedding gives its row no gradient)."""
    return torch.einsum("kbnh,bnh->bk", D[:, ids], g)


def bias_projection(g: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``[b, k]``: ``sum_t g[u, t] . D_j`` (g [b, n, h], D [k, h])."""
    return g.sum(1) @ D.T


def _is_scale_norm(m: torch.nn.Module) -> bool:
    own = dict(m.named_parameters(recurse=False))
    w = own.get("weight")
    return (isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(m).__name__.endswith("RMSNorm")) and \
        w is not None and w.dim() == 1 and set(own) <= {"weight", "bias"}


def _plain(m: torch.nn.Module, base: type) -> bool:
    """``m`` computes as ``base`` does: its forward is ``base``'s and it holds no parameter but
    weight and bias (a subclass that adds its own, as loralib's ``Linear`` does, is not a plain one)."""
    return type(m).forward is base.forward and set(dict(m.named_parameters(recurse=False))) <= {"weight", "bias"}


def _kind(m: torch.nn.Module) -> str | None:
    if isinstance(m, torch.nn.Linear) and _plain(m, torch.nn.Linear):
        return "linear"
    if isinstance(m, torch.nn.Embedding) and _plain(m, torch.nn.Embedding) and m.max_norm is None and \
            not m.scale_grad_by_freq and not m.sparse:
        return "embedding"
    if _is_scale_norm(m):
        return "norm"
    return None


def covered_params(model: torch.nn.Module, params: list[torch.Tensor]) -> tuple[set[int], list]:
    """(indices of ``params`` every holder of which is a covered module, [(module, kind)] of the
    covered modules holding one of them)."""
    index = {id(p): i for i, p in enumerate(params)}
    covered, bad, mods = set(), set(), []
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):  # reads its out_proj's weight itself, never calling it
            bad.update(index[id(p)] for p in m.parameters() if id(p) in index)
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        if not own:
            continue
        kind = _kind(m)
        (covered if kind else bad).update(own)
        if kind:
            mods.append((m, kind))
    return covered - bad, mods


def ghost_supported(model: torch.nn.Module) -> bool:
    """Hooks see each forward once: not under gradient checkpointing, which Hugging Face models
    apply in train mode only (the online probe's passes run in eval mode: supported there)."""
    base = getattr(model, "module", model)
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # the name transformers 5 gives it (the old one warns)
    return not (base.training and getattr(base, name, False))


class GhostHooks:
    """Module hooks that, during the backward of a microbatch, add each covered parameter's per-unit
    projections onto ``directions`` and write its summed gradient into ``.grad`` themselves: the
    covered parameters have ``requires_grad`` off inside the block, so autograd computes activation
    gradients only and no weight gradient twice (the per-unit gradients' sum is the gradient).
    ``start(b)`` before a microbatch's forward (b units, rows unit-major), ``take()`` after its
    backward: ``[b, k]`` in the directions' dtype, on their device. Use as a context manager."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], directions: pv.DirectionSet):
        self.model, self.directions = getattr(model, "module", model), directions
        self.params = params
        self.covered, self._mods = covered_params(self.model, params)
        self.uncovered = [i for i in range(len(params)) if i not in self.covered]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._handles: list = []
        self._acc: torch.Tensor | None = None
        self._b = 0
        self._busy = False
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Backward passes inside the block add nothing (the batched backward of the uncovered ones)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __enter__(self) -> "GhostHooks":
        for m, kind in self._mods:
            self._handles.append(m.register_forward_hook(self._forward_hook(kind)))
        for i in self.covered:
            self.params[i].requires_grad_(False)
        return self

    def __exit__(self, *exc) -> None:
        for i in self.covered:
            self.params[i].requires_grad_(True)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._acc = None

    def start(self, b: int) -> None:
        self._b = b
        self._acc = torch.zeros(b, self.directions.k, device=self.directions.device, dtype=self.directions.dtype)

    def take(self) -> torch.Tensor:
        out, self._acc = self._acc, None
        return out

    def _block(self, p: torch.Tensor | None) -> torch.Tensor | None:
        """The ``[k, *shape]`` directions of ``p`` if it is a covered parameter, else None."""
        i = self._index.get(id(p)) if p is not None else None
        if i is None or i not in self.covered:
            return None
        return self.directions.block(i).view(self.directions.k, *p.shape)

    def _units(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, ..., h] -> [b, n, h] in the directions' dtype (rows unit-major)."""
        return t.reshape(self._b, -1, t.shape[-1]).to(self.directions.dtype)

    def _forward_hook(self, kind: str):
        def hook(m, inputs, output):
            if self._acc is None or self._busy or not isinstance(output, torch.Tensor):
                return
            if not output.requires_grad:  # nothing before it is trained: the graph starts here
                if output.grad_fn is not None or not torch.is_grad_enabled() or not any(
                        self._block(p) is not None for p in m.parameters(recurse=False)):
                    return
                output.requires_grad_()
            x = inputs[0].detach()
            output.register_hook(lambda g: self._add(m, kind, x, g))
        return hook

    @staticmethod
    def _grad_add(p: torch.Tensor, t: torch.Tensor) -> None:
        """``p.grad += t`` (set when None), in the parameter's dtype."""
        if p.grad is None:
            p.grad = t.to(p.dtype) if t.dtype != p.dtype else t
        else:
            p.grad.add_(t.to(p.dtype))

    def _add(self, m: torch.nn.Module, kind: str, x: torch.Tensor, g: torch.Tensor) -> None:
        acc = self._acc
        if acc is None or self._paused:  # a backward outside start()/take(), or paused: nothing to record
            return
        gu = self._units(g.detach())
        Dw, Db = self._block(m.weight), self._block(getattr(m, "bias", None))
        if kind == "linear":
            if Dw is not None:
                a = self._units(x)
                proj, grad = linear_projection(a, gu, Dw)
                acc += proj
                if grad is not None:
                    self._grad_add(m.weight, grad)
                else:  # g^T a straight into .grad
                    w, g2, a2 = m.weight, gu.reshape(-1, gu.shape[-1]), a.reshape(-1, a.shape[-1])
                    if w.grad is None:
                        w.grad = (g2.T @ a2).to(w.dtype)
                    else:
                        w.grad.addmm_(g2.T.to(w.dtype), a2.to(w.dtype))
        elif kind == "embedding":
            if Dw is not None:
                ids = x.reshape(self._b, -1)
                if m.padding_idx is not None:
                    gu = gu * (ids != m.padding_idx).unsqueeze(-1).to(gu.dtype)
                acc += embedding_projection(ids, gu, Dw)
                w = m.weight  # tied to an output layer, its gradient is there already: added in place
                if w.grad is None:
                    w.grad = torch.zeros_like(w)
                w.grad.index_add_(0, ids.reshape(-1), gu.reshape(-1, gu.shape[-1]).to(w.grad.dtype))
        elif Dw is not None:  # norm: xhat, the weight's coefficient (the output is affine in it)
            gx = gu * self._units(self._xhat(m, x))
            acc += gx.sum(1) @ Dw.T
            self._grad_add(m.weight, gx.sum((0, 1)).view(m.weight.shape))
        if kind != "embedding" and Db is not None:
            acc += bias_projection(gu, Db)
            self._grad_add(m.bias, gu.sum((0, 1)).view(m.bias.shape))

    def _xhat(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``f(w=1) - f(w=0)`` (bias 0) of a norm on input x: the weight's coefficient."""
        self._busy = True
        try:
            with torch.no_grad():
                w = m.weight.detach()
                at, at0 = {"weight": torch.ones_like(w)}, {"weight": torch.zeros_like(w)}
                if getattr(m, "bias", None) is not None:
                    at["bias"] = at0["bias"] = torch.zeros_like(m.bias)
                return functional_call(m, at, (x,)) - functional_call(m, at0, (x,))
        finally:
            self._busy = False
