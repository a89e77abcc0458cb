"""Teacher-forced log-probabilities of generated tokens, microbatch by microbatch.

``log pi(t_k | prefix) = log_softmax(logits_{k-1} / temperature)[t_k]`` for every position k with
``response_mask[k] = 1`` (generated tokens, EOS included), 0 elsewhere. Position ids come from the
attention mask (``cumsum - 1``), so left and right padding give the same numbers.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor  # [N, T] log-prob of token t under the model, 0 off the response
    entropy: torch.Tensor | None  # [N, T] exact token entropy over the vocabulary, 0 off the response


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


def autocast_dtype(model_cfg, device: torch.device) -> torch.dtype | None:
    """The autocast dtype the model's forward passes run under, from ``model.autocast``:
    ``bf16`` / ``fp16`` on any device (the CPU included), ``off`` none, and ``auto`` bf16 on CUDA
    when ``model.autocast_bf16`` is true, none elsewhere (what every run did before the key)."""
    mode = getattr(model_cfg, "autocast", "auto")
    mode = getattr(mode, "value", mode)
    if mode == "auto":
        return torch.bfloat16 if model_cfg.autocast_bf16 and device.type == "cuda" else None
    return AUTOCAST_DTYPES[mode]


def autocast_ctx(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device``'s type with ``dtype``; a no-op with dtype None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over attended tokens only: ``cumsum(mask) - 1``, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


ENTROPY_CHUNK_ROWS = 256  # rows of [rows, V] logits per step of the entropy's forward and backward


class _PickedAndEntropy(torch.autograd.Function):
    """``(l, H)`` of logits z [R, V] and targets [R]: ``l = z[target] - logsumexp(z)`` and
    ``H = -sum_v p_v log p_v``, with ``dl/dz = onehot - p`` and ``dH/dz = -p (log p + H)``.
    Saves only z (the model's own output) and the entropies, and recomputes the softmax
    ``ENTROPY_CHUNK_ROWS`` rows at a time in every direction, so that the [R, V] temporaries are one
    chunk's (the gradient itself aside). Out of place throughout: the batched backward
    (``is_grads_batched``, the ``vmap`` unit path) runs through it."""

    @staticmethod
    def _chunks(n: int):
        return [slice(i, i + ENTROPY_CHUNK_ROWS) for i in range(0, n, ENTROPY_CHUNK_ROWS)]

    @staticmethod
    def forward(ctx, z, targets):
        picked, ent = [], []
        for sl in _PickedAndEntropy._chunks(z.shape[0]):
            lp = torch.log_softmax(z[sl], -1)
            picked.append(lp.gather(-1, targets[sl, None]).squeeze(-1))
            ent.append(-(lp.exp() * lp).sum(-1))
        picked, ent = torch.cat(picked), torch.cat(ent)
        ctx.save_for_backward(z, targets, ent)
        ctx.save_for_forward(z, targets, ent)
        return picked, ent

    @staticmethod
    def backward(ctx, g_picked, g_ent):
        z, targets, ent = ctx.saved_tensors
        R = z.shape[0]
        out = []
        for sl in _PickedAndEntropy._chunks(R):
            lp = torch.log_softmax(z[sl], -1)
            p = lp.exp()
            gp, ge = g_picked[..., sl, None], g_ent[..., sl, None]  # leading dims: batched backward
            onehot = torch.zeros_like(lp).scatter(-1, targets[sl, None], 1.0)
            out.append(gp * (onehot - p) - ge * p * (lp + ent[sl, None]))
        return torch.cat(out, -2), None

    @staticmethod
    def jvp(ctx, dz, _):
        """Forward mode (the jvp projections): ``dl = dz[target] - p . dz``, ``dH = -p (log p + H) . dz``."""
        z, targets, ent = ctx.saved_tensors
        d_picked, d_ent = [], []
        for sl in _PickedAndEntropy._chunks(z.shape[0]):
            lp = torch.log_softmax(z[sl], -1)
            pdz = lp.exp() * dz[sl]
            d_picked.append(dz[sl].gather(-1, targets[sl, None]).squeeze(-1) - pdz.sum(-1))
            d_ent.append(-((lp + ent[sl, None]) * pdz).sum(-1))
        return torch.cat(d_picked), torch.cat(d_ent)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   response_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool | str = False, autocast_dtype: torch.dtype | None = None
                   ) -> TokenLogprobs:
    """Per-token log-probs (and optionally entropies) of the response tokens of ``input_ids``.

    Shapes: input_ids, attention_mask, response_mask are [N, T]; outputs are [N, T] in fp32
    (fp64 for an fp64 model).
    Gradients flow when called outside ``no_grad``. Only the logits from the first response
    column on are materialised in fp32 (``logits_to_keep``), which bounds memory on long prompts.
    ``with_entropy``: True, the entropies without a graph (a diagnostic); ``"grad"``, log-probs and
    entropies both differentiable through ``_PickedAndEntropy`` (one saved logits tensor, the
    softmax recomputed in chunks: memory flat in the vocabulary beyond the logits themselves).
    """
    if torch.is_inference_mode_enabled():  # it implies grad off, so test the mode itself
        raise RuntimeError("probe forward passes cannot run under torch.inference_mode(): "
                           "autograd needs the graph; use torch.no_grad() for evaluation only")
    N, T = input_ids.shape
    resp = response_mask.bool()
    cols = resp.any(0).nonzero()
    if cols.numel() == 0:
        raise ValueError("response_mask selects no token: every response is empty")
    first = int(cols[0])
    if first == 0:
        raise ValueError("a response token sits at column 0 and has no prefix to condition on")
    keep = T - first + 1  # logits at positions first-1 .. T-1 predict tokens first .. T
    with autocast_ctx(input_ids.device, autocast_dtype):
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                    logits_to_keep=keep)
    logits = out.logits[:, :-1]  # [N, T-first, V] predicts tokens first..T-1
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # fp32 (fp64 stays)
    targets = input_ids[:, first:]  # [N, T-first]
    mask = resp[:, first:]
    if with_entropy == "grad":
        V = logits.shape[-1]
        picked, ent = _PickedAndEntropy.apply(logits.reshape(-1, V), targets.reshape(-1))
        pad = picked.new_zeros((N, first))
        logp = torch.cat([pad, torch.where(mask, picked.view(N, -1), 0.0)], dim=1)
        entropy = torch.cat([pad, torch.where(mask, ent.view(N, -1), 0.0)], dim=1)
        return TokenLogprobs(logp, entropy)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    pad = picked.new_zeros((N, first))
    logp = torch.cat([pad, torch.where(mask, picked, 0.0)], dim=1)
    entropy = None
    if with_entropy:  # a diagnostic: no graph (it would keep [N, T, V] tensors alive until backward)
        with torch.no_grad():
            p_log = logits.detach() - lse.detach().unsqueeze(-1)
            ent = -p_log.exp().mul_(p_log).sum(-1)  # -sum p log p, one [N, T, V] temporary fewer
            entropy = torch.cat([pad.detach(), torch.where(mask, ent, 0.0)], dim=1)
    return TokenLogprobs(logp, entropy)


def check_finite(S: torch.Tensor, what: str) -> None:
    """Raise a clear error naming ``what`` when S holds NaN or Inf."""
    if not torch.isfinite(S).all():
        bad = (~torch.isfinite(S)).nonzero()[:5].tolist()
        raise FloatingPointError(f"non-finite log-probs in {what} at [unit, response] {bad}: "
                                 "check the checkpoint (NaN weights?) or lower the dtype precision")
