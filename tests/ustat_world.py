"""The enumerated world of the single-batch U-statistic's tests (test_ustat.py, test_ustat_mc.py):
the tiny policy of ``exact_model.py`` with a real AdamW state, every response's gradient tabulated
once (3 prompts x 156 responses), so that a Monte Carlo draw is a few index operations and
X_u . P Y_v comes from the Gram matrix J P J^T; ``stage`` runs the pipeline's single-batch stage on
a real sampled batch of the same world.
"""
from __future__ import annotations

import itertools
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from entprobe.math import paramvec as pv
from entprobe.math import ustat as um
from entprobe.config import ImportanceConfig, ProbeConfig
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.modes.single_batch import run_single_batch
from exact_model import adamw_with_state, make_setup

LR = 1e-3
N_PROMPTS, N_RESP = 3, 156


# ---------------------------------------------------------------- the enumerated world
@dataclass
class World:
    setup: object
    opt: torch.optim.Optimizer
    P: pv.Buffer
    S: torch.Tensor  # [3 * 156] log pi of every (prompt, response)
    R: torch.Tensor  # [3 * 156] rewards
    L: torch.Tensor  # [156] generated lengths (EOS counts)
    J: torch.Tensor  # [3 * 156, D] gradients of S
    K: torch.Tensor  # [3 * 156, 3 * 156] J P J^T
    index: dict  # response tokens -> enumeration index

    def gidx(self, batch) -> torch.Tensor:
        """[B, G] table rows of a sampled batch's responses."""
        out = torch.zeros(batch.B, batch.G, dtype=torch.long)
        for n in range(batch.B):
            for g in range(batch.G):
                toks = tuple(batch.input_ids[n, g][batch.response_mask[n, g].bool()].tolist())
                out[n, g] = int(batch.prompt_index[n]) * N_RESP + self.index[toks]
        return out

    def kernel(self, gidx, cx, cy, k: int = 1) -> torch.Tensor:
        """H[u, v] = X_u . P Y_v for units of k consecutive prompts (block means)."""
        Cx = torch.zeros(gidx.shape[0], self.K.shape[0], dtype=torch.float64).scatter_add_(1, gidx, cx)
        Cy = torch.zeros_like(Cx).scatter_add_(1, gidx, cy)
        Cx, Cy = Cx.view(-1, k, Cx.shape[1]).mean(1), Cy.view(-1, k, Cy.shape[1]).mean(1)
        return Cx @ self.K @ Cy.T

    def draws(self, B: int, G: int, n: int, seed: int, cross_fit: bool = False):
        """n independent batches from the exact distribution (prompts uniform, G responses each):
        per-unit coefficient rows over the table, Cx, Cy [n, B, 468]."""
        gen = torch.Generator().manual_seed(seed)
        pr = torch.randint(N_PROMPTS, (n, B), generator=gen)
        probs = self.S.view(N_PROMPTS, N_RESP).exp()[pr].reshape(-1, N_RESP)
        i = torch.multinomial(probs, G, replacement=True, generator=gen).view(n, B, G)
        gidx = pr.unsqueeze(-1) * N_RESP + i
        r = self.R[gidx]
        c = um.unit_coefficients(self.S[gidx].view(-1, G), self.L[i].view(-1, G), self.L[i].amax(-1).view(-1),
                                 (r - r.mean(-1, keepdim=True)).view(-1, G), "sequence", cross_fit)
        Cx = torch.zeros(n, B, self.K.shape[0], dtype=torch.float64).scatter_add_(2, gidx, c.cx.view(n, B, G))
        Cy = torch.zeros_like(Cx).scatter_add_(2, gidx, c.cy.view(n, B, G))
        return Cx, Cy

    def exact_target(self, G: int) -> float:
        """E[X].P.E[Y] exactly. E[X] = -grad H (sequence mode) = mean_p sum_t pi S grad S. E[Y | p] =
        E[A_1 / Lmax grad S_1] with A_1 = (G-1)/G (r_1 - mean of the other G-1 rewards) and Lmax over
        the group: the other G-1 responses enter only through (sum of rewards, max length), whose
        distribution is built by a small dynamic programme."""
        pi = self.S.exp()
        mu_x = ((pi * self.S).unsqueeze(1) * self.J).sum(0) / N_PROMPTS
        mu_y = torch.zeros_like(mu_x)
        for p in range(N_PROMPTS):
            rows = slice(p * N_RESP, (p + 1) * N_RESP)
            q: dict = defaultdict(float)  # law of one response's (reward, length)
            for pr, rr, ll in zip(pi[rows].tolist(), self.R[rows].tolist(), self.L.tolist()):
                q[(rr, ll)] += pr
            dist: dict = {(0.0, 0.0): 1.0}  # law of (sum of rewards, max length) of the others
            for _ in range(G - 1):
                new: dict = defaultdict(float)
                for ((s, m), w), ((rr, ll), w2) in itertools.product(dist.items(), q.items()):
                    new[(s + rr, max(m, ll))] += w * w2
                dist = new
            w = torch.zeros(N_RESP, dtype=torch.float64)
            for (s, m), pw in dist.items():
                w += pw * (G - 1) / G * (self.R[rows] - s / (G - 1)) / self.L.clamp(min=m)
            mu_y += ((pi[rows] * w).unsqueeze(1) * self.J[rows]).sum(0) / N_PROMPTS
        return float(mu_x @ (self.Pflat * mu_y))

    @property
    def Pflat(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.P])


@pytest.fixture(scope="module")
def world() -> World:
    return build_world()


def build_world(table: bool = True) -> World:
    """The tiny policy after 20 real AdamW DR-GRPO steps (P far from identity), and the table."""
    setup = make_setup()
    opt = adamw_with_state(setup)
    st, g = [opt.state[p] for p in setup.params], opt.param_groups[0]
    P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], int(st[0]["step"]), g["betas"][1], g["eps"],
                               dtype=torch.float64)
    if not table:
        return World(setup, opt, P, *([None] * 6))
    resp = setup.all_responses()
    S, R, J = [], [], []
    for pr in setup.task.prompts:
        s = setup.response_logprobs(pr.text)
        grads = torch.autograd.grad(s, setup.params, grad_outputs=torch.eye(N_RESP, dtype=s.dtype),
                                    is_grads_batched=True, allow_unused=True)
        J.append(torch.cat([(torch.zeros((N_RESP, *p.shape), dtype=s.dtype) if j is None else j)
                            .reshape(N_RESP, -1) for j, p in zip(grads, setup.params)], 1))
        S.append(s.detach())
        R.append(torch.tensor([setup.task.reward(setup.tokenizer.decode(t, skip_special_tokens=True), pr)
                               for t in resp], dtype=torch.float64))
    J, Pf = torch.cat(J), torch.cat([p.reshape(-1) for p in P])
    L = torch.tensor([len(t) for t in resp], dtype=torch.float64)
    return World(setup, opt, P, torch.cat(S), torch.cat(R), L, J, (J * Pf) @ J.T,
                 {tuple(t): i for i, t in enumerate(resp)})


def stage(world: World, batch, mb_size: int = 2, gt: bool = False, mode: str = "sequence", E=None, **pkw) -> dict:
    ctx = world.setup.ctx(mode, mb_size=mb_size)
    geo = Geometry(world.opt, LR, world.P)
    return run_single_batch(ctx, batch, geo, ProbeConfig(mode="single_batch", **pkw),
                            ImportanceConfig(enabled=gt), Path(tempfile.mkdtemp(prefix="ustat_")), E=E)


# Stage vs enumeration: P reaches 1/eps = 1e8 on embedding rows the 20 training steps never
# touched, so X.P.Y sums terms of ~1e8 that cancel to ~1e3; both sides agree to ~1e-8 relative.
REL_STAGE = 1e-6


def close(x: float, y: float, rel: float = 1e-9) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y), 1e-12)
