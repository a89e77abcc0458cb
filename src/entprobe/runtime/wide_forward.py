"""Forward passes in the weights' own precision when it is wider than fp32 (``model.dtype=float64``).

HF's Llama-family models compute RMSNorm and the eager attention's softmax in fp32 whatever the
weights' dtype. For bf16 / fp16 weights that widens them; for fp64 weights it narrows them, so the
log-probs and entropies of an fp64 model carry fp32 rounding, ~eps32 per token. Two passes at nearby
parameters (theta and theta + Delta theta, the measured change) then differ by that rounding, which
does not average out over E's prompts, and below some lr it decides the paired test.

``widen_forward(model)`` makes those two steps compute in ``promote_types(dtype, float32)``:

- RMSNorm: ``w * (x / sqrt(mean(x^2) + eps))`` in the wider of x's dtype and fp32;
- eager attention: ``softmax(q k^T * scaling + mask)`` in the wider of q's dtype and fp32.

For fp32, bf16 and fp16 inputs both are the same calls as transformers' own, bit for bit, so
nothing changes for any other model in the process. It returns the dtype the forward now computes in
throughout, when every module of the model is one whose precision is known: then the rounding bound
of the measured change is that dtype's (``pipeline/stages/ground_truth.forward_dtype``). Otherwise it
returns None and the bound keeps fp32's eps (a model whose code has fp32 steps we do not know of).

    dt = widen_forward(model)   # torch.float64 for an fp64 Llama / Qwen2 / Mistral, else None
"""
from __future__ import annotations

import inspect
import sys
import types

import torch

WIDE_DTYPE_ATTR = "_entprobe_forward_dtype"  # set on the model: the dtype its forward computes in
WIDE_SOFTMAX_ATTR = "_entprobe_wide_softmax"  # set on a widened model's modules: softmax in q's dtype

# transformers' Llama-family RMSNorm (Llama, Qwen2/3, Mistral, ... copy it), fp32 inside
_RMSNORM_FP32_LINE = "hidden_states = hidden_states.to(torch.float32)"
_SOFTMAX_FP32_CALL = "softmax(attn_weights, dim=-1, dtype=torch.float32)"
_FP32_MARKS = ("torch.float32", ".float()")


def wide_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``w * (x / sqrt(mean(x^2, -1) + eps))`` computed in ``promote_types(x.dtype, float32)``:
    transformers' Llama RMSNorm for fp32 / bf16 / fp16 inputs, fp64 for fp64 ones."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * h.to(input_dtype)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, T, d] -> [b, kv_heads * n_rep, T, d] (grouped-query attention's key/value heads)."""
    if n_rep == 1:
        return x
    b, h, T, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, T, d).reshape(b, h * n_rep, T, d)


def wide_eager_attention(original):
    """transformers' eager attention ``softmax(q k^T * scaling + mask) v`` with the softmax in
    ``promote_types(q.dtype, float32)`` for the attention modules of a widened model
    (``WIDE_SOFTMAX_ATTR``); every other call, and inputs no wider than fp32, go to ``original``
    untouched, so other models in the process keep transformers' numbers."""
    if getattr(original, "_entprobe_wide", False):
        return original

    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if (not getattr(module, WIDE_SOFTMAX_ATTR, False)
                or torch.finfo(query.dtype).eps >= torch.finfo(torch.float32).eps):
            return original(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        n_rep = getattr(module, "num_key_value_groups", 1)
        k, v = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=query.dtype)
        w = torch.nn.functional.dropout(w, p=dropout, training=module.training)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    eager_attention_forward._entprobe_wide = True
    eager_attention_forward.__wrapped__ = original
    return eager_attention_forward


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _is_llama_rms_norm(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and _RMSNORM_FP32_LINE in _source(type(module).forward))


def widen_forward(model: torch.nn.Module) -> torch.dtype | None:
    """Make ``model``'s forward compute in its weights' dtype where that is wider than fp32 (see the
    module docstring), mark it (``WIDE_DTYPE_ATTR``) and return that dtype; None, with the model
    unmarked and unchanged, when its weights are no wider than fp32, its attention kernel is not
    eager / sdpa, or some module's code holds an fp32 step this function does not know (the
    rounding bound then stays fp32's). Idempotent."""
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dts or max(torch.finfo(d).eps for d in dts) >= torch.finfo(torch.float32).eps:
        return None
    dtype = max(dts, key=lambda d: torch.finfo(d).eps)  # the coarsest weights set the precision
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", "eager") not in ("eager", "sdpa"):
        return None  # flash / flex kernels: no fp64 path we know of
    norms, attention = [], []
    for module in model.modules():
        cls = type(module)
        if _is_llama_rms_norm(module):
            norms.append(module)
            continue
        if cls.__name__.endswith("RotaryEmbedding"):
            continue  # cos / sin of the positions: no parameter enters, the same at theta and theta+
        home = sys.modules.get(cls.__module__)
        eager = getattr(home, "eager_attention_forward", None)
        if eager is not None:
            src = _source(getattr(eager, "__wrapped__", eager))
            if any(mark in src.replace(_SOFTMAX_FP32_CALL, "") for mark in _FP32_MARKS):
                return None
            if _SOFTMAX_FP32_CALL in src:
                attention.append((module, home, eager))
        if any(mark in _source(cls.forward) for mark in _FP32_MARKS):
            return None  # an fp32 step this function does not know: nothing is changed
    for module in norms:
        module.forward = types.MethodType(wide_rms_norm_forward, module)
    for module, home, eager in attention:
        home.eager_attention_forward = wide_eager_attention(eager)
        setattr(module, WIDE_SOFTMAX_ATTR, True)
    setattr(model, WIDE_DTYPE_ATTR, dtype)
    return dtype


def wide_forward_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``widen_forward`` found the model's forward to compute in throughout (None: not
    widened, so HF's fp32 steps bound its precision)."""
    while model is not None:  # a DDP / FSDP wrapper's module, a PEFT model's base
        dt = getattr(model, WIDE_DTYPE_ATTR, None)
        if dt is not None:
            return dt
        inner = getattr(model, "module", None)
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        model = inner if isinstance(inner, torch.nn.Module) and inner is not model else None
    return None
