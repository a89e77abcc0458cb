"""Exact targets on the enumerable policy of ``exact_model.py`` for every weighting mode, and a fast
simulator of the two-batch probe built from the same pure functions the pipeline calls.

Every response's gradient is enumerated once (``Enumerated.J``, [3 K, D]); a unit's X_u and Y_u are
weighted sums of those rows with the production weights (``estimators.x_unit_coeffs`` /
``y_unit_coeffs``), so thousands of (E, U) draws cost a few matrix products. Exact expectations
over a group of G responses enumerate all K^G ordered groups (K = 156: 24 k groups at G = 2, 3.8 M
at G = 3, in chunks).

    orc = make_oracle(mode="dr_grpo", G=3)
    orc.minus_grad_H              # -grad H in the mode's functional [D], exact
    orc.mean_unit("X")            # E[X_n] [D], exact (equal to -grad H: tests/test_prediction.py)
    w, objs = preset_weights(orc, ocfg, f)   # a trainer preset's Y weights of draws f (objectives.prepare)
    orc.population_ascent(ocfg, B)  # the limit of that preset's Ybar over many prompts [D], exact
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from entprobe.math import estimators as est
from entprobe.rollouts import objectives as ob
from entprobe.math import paramvec as pv
from entprobe.rollouts.sampling import RolloutBatch, assemble, encode_prompts, group_advantages
from entprobe.math.adamw import AdamWHyper, adamw_jacobian, adamw_update
from exact_model import MAX_NEW, ExactSetup, adamw_with_state, enumerate_responses, make_setup, params_set_to

N_PROMPTS = 3


def group_entropy(S: torch.Tensor, L: torch.Tensor, mode: str, G: int) -> torch.Tensor:
    """One prompt's H = -E[(1/G) sum_g S_w[g]] over groups of G responses drawn from q = exp(S),
    differentiable in S [K]. Separable modes: ``-sum_t q S_w``; dr_grpo (the group's Lmax):
    ``-sum over ordered groups of prod q * S_{t_1} / Lmax(group)`` (by symmetry)."""
    q = S.exp()
    if mode == "sequence":
        return -(q * S).sum()
    if mode == "per_token_avg":
        return -(q * S / L).sum()
    K = S.numel()
    total = S.new_zeros(())
    for t1 in range(K):  # chunks over the first response keep the K^G tensors small
        shape = (K,) * (G - 1)
        Lo, qo = torch.full(shape, float(L[t1]), dtype=L.dtype), q[t1].expand(shape)
        for j in range(G - 1):
            view = [1] * (G - 1)
            view[j] = K
            Lo = torch.maximum(Lo, L.view(view))
            qo = qo * q.view(view)
        total = total + (qo * S[t1] / Lo).sum()
    return -total


def expected_weight(S: torch.Tensor, L: torch.Tensor, R: torch.Tensor, G: int, coeff_fn) -> torch.Tensor:
    """``kappa(t) = E[sum_g w_g 1{t_g = t}]`` over ordered groups of G responses from q = exp(S):
    ``E[sum_g w_g grad S_{t_g}] = kappa . J``. ``coeff_fn(S_g, L_g, R_g) -> w`` [n, G] on groups
    (the production weight function). Groups are enumerated in chunks of the first response."""
    q = S.exp()
    K = S.numel()
    kappa = torch.zeros(K, dtype=torch.float64)
    rest = torch.cartesian_prod(*[torch.arange(K)] * (G - 1)).view(-1, G - 1)  # [K^(G-1), G-1]
    p_rest = q[rest].prod(-1)
    for t1 in range(K):
        idx = torch.cat([torch.full((rest.shape[0], 1), t1), rest], 1)  # [n, G]
        w = coeff_fn(S[idx], L[idx], R[idx])  # [n, G]
        prob = q[t1] * p_rest
        kappa.index_add_(0, idx.reshape(-1), (prob.unsqueeze(-1) * w).reshape(-1))
    return kappa


@dataclass
class Oracle:
    setup: ExactSetup
    opt: torch.optim.AdamW
    mode: str
    G: int
    J: torch.Tensor  # [3K, D]
    S: torch.Tensor  # [3K]
    R: torch.Tensor
    L: torch.Tensor
    K: int
    m: torch.Tensor = field(init=False)  # flat AdamW state
    v: torch.Tensor = field(init=False)
    theta: torch.Tensor = field(init=False)
    hyper: AdamWHyper = field(init=False)
    minus_grad_H: torch.Tensor = field(init=False)  # [D]

    def __post_init__(self):
        ps = self.setup.params
        self.m = torch.cat([self.opt.state[p]["exp_avg"].reshape(-1) for p in ps])
        self.v = torch.cat([self.opt.state[p]["exp_avg_sq"].reshape(-1) for p in ps])
        self.theta = torch.cat([p.detach().reshape(-1) for p in ps])
        g = self.opt.param_groups[0]
        self.hyper = AdamWHyper(g["lr"], g["weight_decay"], g["betas"][0], g["betas"][1], g["eps"],
                                float(self.opt.state[ps[0]]["step"]))
        self.minus_grad_H = -self.dH_dS() @ self.J

    def rows(self, p: int) -> slice:
        return slice(p * self.K, (p + 1) * self.K)

    def H(self, S: torch.Tensor | None = None) -> torch.Tensor:
        """Exact H in the mode's functional at log-probs S [3K] (default: theta's)."""
        S = self.S if S is None else S
        return torch.stack([group_entropy(S[self.rows(p)], self.L[self.rows(p)], self.mode, self.G)
                            for p in range(N_PROMPTS)]).mean()

    def dH_dS(self) -> torch.Tensor:
        """dH / dS_t for every response [3K] (H depends on theta only through the S_t)."""
        S = self.S.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(self.H(S), S)
        return g

    def coeff(self, side: str):
        if side == "X":
            return lambda S, L, R: est.x_unit_coeffs(S, L, L.amax(-1), self.mode)
        return lambda S, L, R: est.y_unit_coeffs(R - R.mean(-1, keepdim=True), L.amax(-1))

    def mean_unit(self, side: str) -> torch.Tensor:
        """E[X_n] or E[Y_n] (dr_grpo advantages r - mean r) exactly [D]."""
        kap = torch.cat([expected_weight(self.S[self.rows(p)], self.L[self.rows(p)], self.R[self.rows(p)],
                                         self.G, self.coeff(side)) for p in range(N_PROMPTS)])
        return (kap @ self.J) / N_PROMPTS

    def population_ascent(self, ocfg, B: int) -> torch.Tensor:
        """The limit in probability of a trainer preset's ``Ybar`` over batches of B prompts as B
        grows, exactly [D]: the point its delta method expands about. Per-group weights are the
        production ones (``preset_advantages``, ``Objective.unit_weights``); the batch statistics
        are replaced by their limits: a token mean's ``Tbar`` by ``E[T_n] = G E[L]``, TRL's batch
        reward std by the population std of r (prompts uniform, responses from pi). For uncoupled
        presets this is ``E[Y_n]`` (``token_sum``'s constant B kept: its Ybar sums over prompts)."""
        q = self.S.exp() / N_PROMPTS  # probability of each response of the mixture
        obj = ob.bind(ocfg, torch.zeros(B, self.G), torch.ones(B, self.G), MAX_NEW)
        if obj.aggregation == "token_mean":
            obj = dataclasses.replace(obj, constant=self.G * float(q @ self.L))
        adv = functools.partial(ob.preset_advantages, ocfg)
        preset = getattr(ocfg.preset, "value", ocfg.preset)
        if preset == "trl" and ob.scale_rewards_choice(ocfg.scale_rewards) == "batch":
            sigma = float(q @ self.R ** 2 - (q @ self.R) ** 2) ** 0.5
            adv = lambda R: ob.trl_advantages(R, "none") / (sigma + ob.TRL_STD_EPS)  # noqa: E731
        kap = torch.cat([expected_weight(self.S[self.rows(p)], self.L[self.rows(p)], self.R[self.rows(p)], self.G,
                                         lambda S, L, R: obj.unit_weights(adv(R), L, L.amax(-1)))
                         for p in range(N_PROMPTS)])
        return (kap @ self.J) / N_PROMPTS

    def preconditioner(self) -> torch.Tensor:
        """Adam's ``P = 1 / (sqrt(v_hat) + eps)`` of the optimizer state, flat [D] (deltaH1's)."""
        st = [self.opt.state[p] for p in self.setup.params]
        P = pv.adam_preconditioner([s["exp_avg_sq"] for s in st], int(st[0]["step"]), self.hyper.beta2,
                                   self.hyper.eps, dtype=torch.float64)
        return torch.cat([x.reshape(-1) for x in P])

    # ---------------------------------------------------------------- the update and the simulator
    def update(self, Ybar: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's Delta theta(Ybar) by part ([..., D])."""
        return adamw_update(Ybar, self.m, self.v, self.theta, self.hyper)

    def jacobian(self, Ybar: torch.Tensor) -> torch.Tensor:
        j = adamw_jacobian(Ybar, self.m, self.v, self.hyper)
        return j["gradient"] + j["momentum"]

    def draw(self, N: int, B: int, gen: torch.Generator) -> torch.Tensor:
        """N batches of B units (prompts uniform, G responses from pi): flat indices [N, B, G]."""
        pi = torch.randint(N_PROMPTS, (N, B), generator=gen)
        p = self.S.exp().view(N_PROMPTS, self.K)
        ri = torch.multinomial(p[pi.reshape(-1)], self.G, replacement=True, generator=gen).view(N, B, self.G)
        return pi[..., None] * self.K + ri

    def weights(self, f: torch.Tensor, side: str) -> torch.Tensor:
        """Production per-response weights of X_u or Y_u for draws f [N, B, G]."""
        shp = f.shape
        w = self.coeff(side)(self.S[f].reshape(-1, self.G), self.L[f].reshape(-1, self.G),
                             self.R[f].reshape(-1, self.G))
        return w.view(shp)

    def means(self, f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(1/B) sum_u sum_g w J_f per draw [N, D]."""
        W = torch.zeros(f.shape[0], self.J.shape[0], dtype=torch.float64)
        return W.scatter_add_(1, f.flatten(1), w.flatten(1) / f.shape[1]) @ self.J

    def project(self, f: torch.Tensor, w: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """Per unit sum_g w (J_f . direction_n) [N, B] (direction [N, D])."""
        q = direction @ self.J.T  # [N, 3K]
        return (w * torch.gather(q, 1, f.flatten(1)).view(f.shape)).sum(-1)


@functools.lru_cache(maxsize=2)
def _base(seed: int):
    setup = make_setup(seed=seed)
    opt = adamw_with_state(setup)
    return setup, opt, enumerate_responses(setup)


def make_oracle(mode: str, G: int, seed: int = 1) -> Oracle:
    """The exact model at AdamW step 20 (lr 1e-2, weight decay 0.1) of real DR-GRPO training
    (seed 1: success rates 0.64 / 0.46 / 0.85, rewards neither rare nor sure). The model and its
    enumeration are shared by every oracle of the same seed (callers restore what they change)."""
    setup, opt, en = _base(seed)
    return Oracle(setup, opt, mode, G, en.J, en.S, en.R, en.L, en.K)


def batch_of(o, f: torch.Tensor) -> RolloutBatch:
    """The RolloutBatch of flat response indices f [B, G] (anything with ``setup``, ``K``, ``R``:
    an Oracle, or test_variance's Exact); sampler log-probs 0 (unused by the probe's passes)."""
    setup, resp = o.setup, o.setup.all_responses()
    G = f.shape[-1]
    prompts = [encode_prompts(setup.tokenizer, [setup.task.prompts[int(i) // o.K].text], "never")[0]
               for i in f.reshape(-1)]
    responses = [resp[int(i) % o.K] for i in f.reshape(-1)]
    ids, att, rm, lp = assemble(prompts, responses, [[0.0] * len(r) for r in responses], G,
                                setup.tokenizer.pad_token_id)
    rewards = o.R[f].float()
    return RolloutBatch(ids, att, rm, lp, rewards, group_advantages(rewards, "dr_grpo"), f[:, 0] // o.K)


def light_batch(o: Oracle, f: torch.Tensor) -> RolloutBatch:
    """A RolloutBatch of flat response indices f [B, G] with what an objective reads (rewards,
    generated lengths, prompt index; fp64), no tokens: ``objectives.prepare`` takes it."""
    L = o.L[f].long()
    rm = (torch.arange(MAX_NEW) < L.unsqueeze(-1)).long()
    z = torch.zeros(rm.shape, dtype=torch.float64)
    R = o.R[f]
    return RolloutBatch(rm, rm, rm, z, R, group_advantages(R, "dr_grpo"), f[:, 0] // o.K)


def preset_weights(o: Oracle, ocfg, f: torch.Tensor) -> tuple[torch.Tensor, list]:
    """A trainer preset's Y weights of draws f [N, B, G] and each draw's objective: per draw,
    ``objectives.prepare`` (the preset's advantages, the objective bound to the draw) and
    ``Objective.unit_weights``, as the pipeline computes them: ``Y_n = sum_g w[n,g] grad S``."""
    ws, objs = [], []
    for fn in f:
        U, obj = ob.prepare(ocfg, light_batch(o, fn), MAX_NEW)
        ws.append(obj.unit_weights(U.advantages, U.gen_lengths, U.Lmax).double())
        objs.append(obj)
    return torch.stack(ws), objs


@dataclass
class Simulated:
    """The two-batch probe on N (E, U) draws, the pipeline's formulas on enumerated gradients:
    Xbar, Ybar [N, D], the step Delta theta(Ybar) [N, D], deltaH_pred [N], its per-unit
    contributions e [N, B_E] (E side) and u [N, B_U] (U side, delta method, linearised by each
    draw's objective as ``two_batch.compute_stage12`` does)."""
    o: Oracle
    fE: torch.Tensor
    fU: torch.Tensor
    wX: torch.Tensor
    wY: torch.Tensor
    objs: list | None  # each draw's Objective (None: entprobe's weights)
    Xb: torch.Tensor
    Yb: torch.Tensor
    delta: torch.Tensor
    pred: torch.Tensor
    e: torch.Tensor
    u: torch.Tensor

    def u_side(self, direction: torch.Tensor) -> torch.Tensor:
        """U's per-unit projections ``Y_v . direction`` [N, B_U] (direction [N, D]), linearised."""
        return self.linearize(self.o.project(self.fU, self.wY, direction))

    def linearize(self, b: torch.Tensor) -> torch.Tensor:
        if self.objs is None:
            return b
        return torch.stack([obj.linearize(x) for obj, x in zip(self.objs, b)])


def simulate(o: Oracle, fE: torch.Tensor, fU: torch.Tensor, ocfg=None) -> Simulated:
    """The probe on draws fE, fU [N, B, G]; ``ocfg``: the objective (None: entprobe's, ``o.weights``)."""
    wX = o.weights(fE, "X")
    wY, objs = (o.weights(fU, "Y"), None) if ocfg is None else preset_weights(o, ocfg, fU)
    Xb, Yb = o.means(fE, wX), o.means(fU, wY)
    delta = sum(o.update(Yb).values())
    sim = Simulated(o, fE, fU, wX, wY, objs, Xb, Yb, delta, -(Xb * delta).sum(-1), -o.project(fE, wX, delta), None)
    sim.u = -sim.u_side(o.jacobian(Yb) * Xb)
    return sim


def log_probs_at(o: Oracle, theta: torch.Tensor) -> torch.Tensor:
    """Every response's log-prob [3K] with the parameters set to the flat ``theta`` (then restored)."""
    with params_set_to(o.setup, theta):
        return enumerate_responses(o.setup, with_grad=False).S


def functional_values(o: Oracle, S: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``-S_w`` of the drawn responses f [..., G] at log-probs S [3K] (the mode's functional)."""
    L = o.L[f].reshape(-1, o.G)
    return -est.weighted_S(S[f].reshape(-1, o.G), L, L.amax(-1), o.mode).view(f.shape)
