"""Per-prompt X projections and exact targets on the enumerable policy (tests/exact_model.py), for
the coupled-sampling tests and docs/uncertainty.md's measurement (benchmarks/bench_coupling.py)."""
from __future__ import annotations

import dataclasses

import torch

from entprobe.math import paramvec as pv
from entprobe.pipeline.stages.x_spec import x_spec
from entprobe.rollouts.logprobs import token_logprobs
from tests.exact_model import MAX_NEW, ExactSetup, params_set_to

FD_EPS = 1e-5  # central differences in fp64: error ~ eps^2 |f'''| (1e-10), far below any Monte Carlo SE here


def theta(setup: ExactSetup) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in setup.params])


def direction(setup: ExactSetup, seed: int = 5) -> torch.Tensor:
    """A fixed unit direction in parameter space (the projection every check reads)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(theta(setup).numel(), generator=g, dtype=torch.float64)
    return d / d.norm()


@torch.no_grad()
def _forward(setup: ExactSetup, ids, att, rm):
    out = token_logprobs(setup.model, ids, att, rm, with_entropy=True)
    return out.logp, out.entropy


def _tangent(setup: ExactSetup, d: torch.Tensor, fn):
    th = theta(setup)
    with params_set_to(setup, th + FD_EPS * d):
        plus = fn()
    with params_set_to(setup, th - FD_EPS * d):
        minus = fn()
    return [(a - b) / (2 * FD_EPS) for a, b in zip(plus, minus)]


def x_projections(setup: ExactSetup, batch, d: torch.Tensor, mode: str, estimator: str) -> torch.Tensor:
    """``e_n = X_n . d`` [B] for each prompt of ``batch``, X built by the pipeline's ``XSpec`` (its
    coefficients at theta, the batch's coupling_blocks honoured), the tangents by central differences."""
    ids, att, rm = batch.flat("cpu")
    B, G, T = batch.input_ids.shape
    lp, ent = (t.view(B, G, T) for t in _forward(setup, ids, att, rm))
    dlp, dent = (t.view(B, G, T) for t in _tangent(setup, d, lambda: _forward(setup, ids, att, rm)))
    m = batch.response_mask.double()
    spec = x_spec(mode, estimator)
    if mode == "token_mean":
        spec = dataclasses.replace(spec, kappa=float((ent * m).sum() / m.sum()), scale=float(B * G / m.sum()))
    if spec.tokens:
        c = spec.token_coeffs(ent, batch)
        return (c.a * dlp + c.e * dent).sum((-1, -2))
    return (spec.weights(lp.sum(-1), batch) * dlp.sum(-1)).sum(-1)


def exact_functional(setup: ExactSetup, mode: str) -> torch.Tensor:
    """The functional at the current parameters, exactly (every response of every prompt)."""
    Ns, Ds, Fs = [], [], []
    for pr in setup.task.prompts:
        ids, att, rm = setup._tensors(pr.text)
        lp, ent = _forward(setup, ids, att, rm)
        S, L, sH = lp.sum(-1), rm.sum(-1).double(), (ent * rm).sum(-1)
        p = S.exp()
        Ns.append((p * sH).sum())
        Ds.append((p * L).sum())
        Fs.append({"sequence": -(p * S).sum(), "per_token_avg": -(p * S / L).sum(),
                   "seq_mean_token_mean": (p * sH / L).sum()}.get(mode, torch.tensor(0.0)))
    if mode == "token_mean":
        return torch.stack(Ns).mean() / torch.stack(Ds).mean()
    return torch.stack(Fs).mean()


def exact_target(setup: ExactSetup, d: torch.Tensor, mode: str) -> float:
    """``-grad F . d``: what the mean of ``x_projections`` estimates."""
    return -float(_tangent(setup, d, lambda: [exact_functional(setup, mode)])[0])


def stratified_mean_se(e: torch.Tensor, prompt_index: torch.Tensor) -> tuple[float, float]:
    """Mean of e [B] and its SE with the prompts stratified by which pool prompt they are (equal
    copies of each): ``SE^2 = sum_p var_p / n_p / P^2``."""
    ps = prompt_index.unique()
    var = sum(float(e[prompt_index == p].var()) / int((prompt_index == p).sum()) for p in ps)
    return float(e.mean()), (var / len(ps) ** 2) ** 0.5


def copies(setup: ExactSetup, m: int) -> torch.Tensor:
    """Each pool prompt m times (independent streams: each copy has its own position)."""
    return torch.arange(len(setup.task.prompts)).repeat(m)


MAX_TOKENS = MAX_NEW


# ----------------------------------------------------------------------------- an antithetic pair, exactly
def _next_token_probs(setup: ExactSetup, prompt_ids: list[int], prefix: tuple, cache: dict) -> torch.Tensor:
    key = tuple(prompt_ids) + (-1,) + prefix
    if key not in cache:
        with torch.no_grad():
            ids = torch.tensor([list(prompt_ids) + list(prefix)])
            cache[key] = setup.model(input_ids=ids).logits[0, -1].double().softmax(-1)
    return cache[key]


def _edges(p: torch.Tensor, order: str) -> tuple[list[float], list[int]]:
    """The inverse CDF's cell edges and tokens: token ``toks[i]`` for u in ``[c[i-1], c[i])``."""
    toks = p.sort(dim=-1, descending=True, stable=True).indices.tolist() if order == "probability" else list(range(len(p)))
    c, acc = [], 0.0
    for t in toks:
        acc += float(p[t])
        c.append(acc)
    return c, toks


def _pick(c: list[float], toks: list[int], u: float) -> int:
    for ci, t in zip(c, toks):
        if u < ci:
            return t
    return toks[-1]


def antithetic_pair_law(setup: ExactSetup, prompt: str, order: str = "probability") -> dict:
    """The exact joint law ``{(response a, response b): probability}`` of an antithetic pair
    (``u_b = 1 - u_a`` at every position) for ``prompt``: at each position [0, 1) is cut at both
    responses' inverse-CDF edges and each piece gives one token pair (a response that has ended
    draws nothing more; the other then draws from its own distribution)."""
    from entprobe.tasks.prompt_ids import encode_prompts

    pid, eos, cache = encode_prompts(setup.tokenizer, [prompt], "never")[0], setup.tokenizer.eos_token_id, {}
    law: dict = {}

    def done(r):
        return len(r) == MAX_NEW or (len(r) > 0 and r[-1] == eos)

    def walk(a: tuple, b: tuple, prob: float):
        if done(a) and done(b):
            law[(a, b)] = law.get((a, b), 0.0) + prob
            return
        if done(a) or done(b):
            live, other = (b, a) if done(a) else (a, b)
            for t, q in enumerate(_next_token_probs(setup, pid, live, cache).tolist()):
                if q > 0:
                    walk(*((other, live + (t,)) if done(a) else (live + (t,), other)), prob * q)
            return
        ca, ta = _edges(_next_token_probs(setup, pid, a, cache), order)
        cb, tb = _edges(_next_token_probs(setup, pid, b, cache), order)
        cuts = sorted({0.0, 1.0, *[min(x, 1.0) for x in ca], *[max(1.0 - x, 0.0) for x in cb]})
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                mid = (lo + hi) / 2
                walk(a + (_pick(ca, ta, mid),), b + (_pick(cb, tb, 1 - mid),), prob * (hi - lo))

    walk((), (), 1.0)
    return law
