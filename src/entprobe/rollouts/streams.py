"""The sampler's random streams: counter-based 32-bit hashes (integer arithmetic only, the same on
every machine), one stream per response keyed by (seed, prompt position, response index), and the
inverse-CDF pick of a token from a uniform (rollouts/sampling.py draws with them,
rollouts/coupled_uniforms.py couples them)."""
from __future__ import annotations

import torch


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``0 <= x < 2**32``, in halves so no product leaves int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser (a bijection of 32-bit words with full avalanche), in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_keys(seed: int, prompt_pos: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """The 32-bit key [N] of each row's stream: a hash of (seed, the prompt's position in the
    batch, the response's index in its group). Integer arithmetic only: the same on every machine."""
    seed = int(seed) % (1 << 64)
    h = _mix32(torch.full_like(prompt_pos, seed & _M32) ^ 0x2545F491)
    for word in (torch.full_like(prompt_pos, seed >> 32), prompt_pos, response):
        h = _mix32((h + 0x9E3779B9) & _M32 ^ (word & _M32))
    return h


def keyed_uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row for draw ``step``: 53 bits from two hashes of
    (row key, step, word). Row r's value depends on its key and the step only (counter-based)."""
    s = _mix32(keys ^ _mix32(torch.full_like(keys, (int(step) * 2 + 1) & _M32)))
    hi, lo = _mix32(s ^ 0x68E31DA4), _mix32(s ^ 0xB5297A4D)
    return ((hi >> 5) * 67108864 + (lo >> 6)).double() / 9007199254740992.0  # (27 bits * 2^26 + 26) / 2^53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token [N] drawn from each row of ``probs`` [N, V] (unnormalised, >= 0) by its uniform ``u``
    [N]: the first index whose float64 cumulative sum exceeds ``u * total``. A zero-probability
    entry never is that index (its cumulative sum equals the one before it)."""
    cdf = probs.double().cumsum(-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
