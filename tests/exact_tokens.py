"""Token-level exact enumeration on the policy of ``exact_model.py``: every response's per-position
log-prob l_t and full-vocabulary entropy H_t, their directional derivatives along a direction v of
parameter space (forward mode: ``dl = grad l . v``, ``dH = grad H . v``), and the exact expectation
of a per-token X over ordered groups of G responses.

    tok = enumerate_tokens(setup, v)               # per prompt: l, H, m, dl, dH [K, T]
    ka, ke = expected_token_coeffs(tok.prompts[p], G, coeff_fn)
    E[X_n] . v = (ka * dl + ke * dH).sum()         # exact, for prompt p

``coeff_fn(l, H, m) -> TokenCoeffs`` takes groups [n, G, T] (the production coefficient functions of
``entprobe.math.token_functionals``), so a test checks the production code against the exact target.
The functionals' exact values and derivatives come from the same enumeration (``functional``).

The direction leaves out the embedding's padding row: backward() never gives that row a gradient
(``nn.Embedding(padding_idx)``), so the probe's X has none there, and forward mode would move it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call

from entprobe.rollouts.logprobs import token_logprobs
from exact_model import ExactSetup


@dataclass
class PromptTokens:
    l: torch.Tensor  # [K, T] token log-probs on the response positions
    H: torch.Tensor  # [K, T] token entropies
    m: torch.Tensor  # [K, T] response mask (fp64)
    dl: torch.Tensor  # [K, T] grad l . v
    dH: torch.Tensor  # [K, T] grad H . v

    @property
    def S(self) -> torch.Tensor:
        return self.l.sum(-1)

    @property
    def q(self) -> torch.Tensor:
        return self.S.exp()

    @property
    def dS(self) -> torch.Tensor:
        return self.dl.sum(-1)


def without_padding_row(setup: ExactSetup, v: list[torch.Tensor]) -> list[torch.Tensor]:
    """v with the input embedding's padding row zeroed (module docstring)."""
    emb = setup.model.get_input_embeddings()
    out = []
    for p, d in zip(setup.params, v):
        d = d.clone()
        if p is emb.weight and emb.padding_idx is not None:
            d[emb.padding_idx] = 0
        out.append(d)
    return out


def enumerate_tokens(setup: ExactSetup, v: list[torch.Tensor] | None = None) -> list[PromptTokens]:
    """Per prompt, every response's l, H, m and their derivatives along v (zero without v)."""
    names, params = setup.names, setup.params
    v = [torch.zeros_like(p) for p in params] if v is None else without_padding_row(setup, v)
    out = []
    with torch.no_grad(), fwAD.dual_level():
        duals = {n: fwAD.make_dual(p.detach(), d.to(p.dtype)) for n, p, d in zip(names, params, v)}
        for pr in setup.task.prompts:
            ids, att, rm = setup._tensors(pr.text)
            model = _Bound(setup.model, duals)
            tl = token_logprobs(model, ids, att, rm, with_entropy="grad")
            cols = rm.bool().any(0).nonzero().squeeze(-1)
            (l, dl), (H, dH) = (fwAD.unpack_dual(t[:, cols]) for t in (tl.logp, tl.entropy))
            zero = torch.zeros_like(l)
            out.append(PromptTokens(l.clone(), H.clone(), rm[:, cols].double(),
                                    (dl if dl is not None else zero).clone(), (dH if dH is not None else zero).clone()))
    return out


class _Bound(torch.nn.Module):
    """The model called with the dual parameters (``torch.func.functional_call``)."""

    def __init__(self, model, duals):
        super().__init__()
        self.inner, self.duals = model, duals

    def forward(self, *args, **kwargs):
        return functional_call(self.inner, self.duals, args=args, kwargs=kwargs, strict=False)


def expected_token_coeffs(pt: PromptTokens, G: int, coeff_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``kappa[r, t] = E[sum_g c[g, t] 1{y_g = r}]`` over ordered groups of G responses drawn from
    ``q = exp(S)`` (a and e coefficients of ``coeff_fn``), enumerated in chunks of the first
    response: ``E[X_n] . v = (kappa_a * dl + kappa_e * dH).sum()``."""
    q, K = pt.q, pt.S.numel()
    rest = torch.tensor(list(itertools.product(range(K), repeat=G - 1)), dtype=torch.long).view(-1, G - 1)
    p_rest = q[rest].prod(-1)
    ka, ke = torch.zeros_like(pt.l), torch.zeros_like(pt.l)
    for r1 in range(K):
        idx = torch.cat([torch.full((rest.shape[0], 1), r1), rest], 1)  # [n, G]
        c = coeff_fn(pt.l[idx], pt.H[idx], pt.m[idx])
        w = (q[r1] * p_rest)[:, None, None]
        ka.index_add_(0, idx.reshape(-1), (w * c.a).reshape(-1, pt.l.shape[-1]))
        ke.index_add_(0, idx.reshape(-1), (w * c.e).reshape(-1, pt.l.shape[-1]))
    return ka, ke


def functional(prompts: list[PromptTokens], mode: str) -> tuple[float, float, dict]:
    """The exact functional over the prompt pool (uniform over prompts) and its derivative along
    v: ``sequence`` E[sum H], ``token_mean`` E[sum H] / E[L], ``seq_mean_token_mean`` E[sum H / L];
    also token_mean's N and D (the population constants of its X)."""
    N = dN = D = dD = 0.0
    for pt in prompts:
        q, dq = pt.q, pt.q * pt.dS
        L = pt.m.sum(-1)
        h = (pt.H * pt.m).sum(-1)
        dh = (pt.dH * pt.m).sum(-1)
        if mode == "seq_mean_token_mean":
            h, dh = h / L, dh / L
        N += float(q @ h) / len(prompts)
        dN += float(dq @ h + q @ dh) / len(prompts)
        D += float(q @ L) / len(prompts)
        dD += float(dq @ L) / len(prompts)
    if mode == "token_mean":
        return N / D, (dN - N / D * dD) / D, {"N": N, "D": D}
    return N, dN, {}
