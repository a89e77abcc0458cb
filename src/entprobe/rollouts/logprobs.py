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


def autocast_ctx(device: torch.device, dtype: torch.dtype | None):
    """bf16/fp16 autocast on CUDA when requested; a no-op on CPU or with dtype None."""
    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=dtype)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over attended tokens only: ``cumsum(mask) - 1``, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   response_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, autocast_dtype: torch.dtype | None = None
                   ) -> TokenLogprobs:
    """Per-token log-probs (and optionally entropies) of the response tokens of ``input_ids``.

    Shapes: input_ids, attention_mask, response_mask are [N, T]; outputs are [N, T] in fp32
    (fp64 for an fp64 model).
    Gradients flow when called outside ``no_grad``. Only the logits from the first response
    column on are materialised in fp32 (``logits_to_keep``), which bounds memory on long prompts.
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
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    mask = resp[:, first:]
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
