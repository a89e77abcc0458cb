"""Single-batch U-statistic (seed 001; DESIGN.md §3, §6): algebra against brute force, the stage
against an enumeration reference, and unbiasedness / SE calibration by Monte Carlo over the exact
distribution of the tiny policy of ``exact_model.py``.

The Monte Carlo does not call the model per draw: every response's gradient is tabulated once
(3 prompts x 156 responses), so a draw is a few index operations and X_u . P Y_v comes from the
Gram matrix J P J^T. The stage tests pin the stage to the same table on real sampled batches, so
the Monte Carlo is about the estimator the stage computes.
"""
from __future__ import annotations

import itertools
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.math import ustat as um
from entprobe.config import ImportanceConfig, ProbeConfig
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.stages.snapshot import state_fingerprint
from entprobe.pipeline.modes.single_batch import plan_units, run_single_batch
from exact_model import adamw_with_state, fixed_batch, make_setup

LR = 1e-3
N_PROMPTS, N_RESP = 3, 156


# ---------------------------------------------------------------- references (slow, by definition)
def brute_force(H: torch.Tensor, pairs: torch.Tensor | None = None) -> dict[str, float | torch.Tensor]:
    """U-statistic of the kernel H[u, v] = X_u.P.Y_v by definition: mean over the design's ordered
    pairs (all u != v, or u -> pairs[u, j]); row mean r_u = mean of the pairs involving u; zeta1 =
    sample variance of r; jackknife by actually deleting each unit's pairs and recomputing."""
    M = H.shape[0]
    mask = ~torch.eye(M, dtype=torch.bool)
    if pairs is not None:
        mask = torch.zeros(M, M, dtype=torch.bool)
        mask[torch.arange(M).unsqueeze(1), pairs] = True
    U = float(H[mask].mean())
    r = torch.stack([torch.cat([H[u][mask[u]], H[:, u][mask[:, u]]]).mean() for u in range(M)])
    zeta1 = float(r.var())
    ar = torch.arange(M)
    loo = torch.stack([H[mask & (ar != u).unsqueeze(0) & (ar != u).unsqueeze(1)].mean() for u in range(M)])
    var_jack = float((M - 1) / M * ((loo - loo.mean()) ** 2).sum())
    return {"U": U, "zeta1": zeta1, "SE_plugin": math.sqrt(4 * zeta1 / M), "SE_jack": math.sqrt(var_jack),
            "phi": r - U, "bars": float(H.mean()), "diag": float(H.diagonal().sum())}


def hand_coeffs(S, A, Lmax, cross_fit: bool):
    """X_n, Y_n weights written out: c_g = S_g - mean of the other S in X's half, over |half|;
    A_g / Lmax over |Y's half| (halves: first ceil(G/2) for X, the rest for Y; no split: all G)."""
    B, G = S.shape
    xs = list(range((G + 1) // 2)) if cross_fit else list(range(G))
    ys = list(range((G + 1) // 2, G)) if cross_fit else list(range(G))
    cx, cy = torch.zeros(B, G, dtype=torch.float64), torch.zeros(B, G, dtype=torch.float64)
    for n in range(B):
        for g in xs:
            others = [float(S[n, h]) for h in xs if h != g]
            cx[n, g] = (float(S[n, g]) - sum(others) / len(others)) / len(xs)
        for g in ys:
            cy[n, g] = float(A[n, g]) / float(Lmax[n]) / len(ys)
    return cx, cy


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


# ---------------------------------------------------------------- pure algebra
def test_u_statistic_matches_brute_force_on_random_vectors():
    gen = torch.Generator().manual_seed(0)
    B, D = 9, 40
    X = torch.randn(B, D, generator=gen, dtype=torch.float64) + 0.5
    Y = torch.randn(B, D, generator=gen, dtype=torch.float64) * 2 + 0.3 * X  # correlated within a unit
    P = torch.rand(D, generator=gen, dtype=torch.float64) + 0.1
    H = (X * P) @ Y.T
    Xbar, Ybar = X.mean(0), Y.mean(0)
    a, b, d = (X * P) @ Ybar, (Y * P) @ Xbar, ((X * P) * Y).sum(1)
    u, ref = est.u_statistic(a, b, d), brute_force(H)
    for key, val in (("U", u.U_cross), ("zeta1", u.zeta1_plugin), ("SE_plugin", u.SE_plugin),
                     ("SE_jack", u.SE_jack)):
        assert close(val, ref[key]), (key, val, ref[key])
    assert close(u.bars_term, B / (B - 1) * ref["bars"]) and close(u.diag_sum, ref["diag"])
    assert close(u.zeta1_jack, B * u.SE_jack ** 2 / 4)
    assert torch.allclose(u.phi / 2, ref["phi"], rtol=1e-10, atol=1e-12)
    # the incomplete design: all pairs is the complete statistic; K < M-1 matches deletion by brute force
    full = um.incomplete_u_statistic(H[torch.arange(B).unsqueeze(1), um.cyclic_partners(B, B - 1)],
                                     um.cyclic_partners(B, B - 1))
    assert all(close(getattr(full, k), getattr(u, k)) for k in ("U_cross", "SE_jack", "SE_plugin", "zeta1_plugin"))
    for K in (1, 3):
        pairs = um.cyclic_partners(B, K)
        inc, ref = um.incomplete_u_statistic(H[torch.arange(B).unsqueeze(1), pairs], pairs), brute_force(H, pairs)
        for key, val in (("U", inc.U_cross), ("zeta1", inc.zeta1_plugin), ("SE_jack", inc.SE_jack)):
            assert close(val, ref[key]), (K, key, val, ref[key])


def test_unit_coefficients_hand_case():
    S = torch.tensor([[-1.0, -2.0, -4.0, -5.0]], dtype=torch.float64)
    A = torch.tensor([[0.5, -0.5, 0.5, -0.5]], dtype=torch.float64)
    L, Lmax = torch.tensor([[1, 2, 2, 1]]), torch.tensor([2])
    c = um.unit_coefficients(S, L, Lmax, A, "sequence", cross_fit=False)
    # LOO means (-11/3, -10/3, -8/3, -7/3) -> c = (8/3, 4/3, -4/3, -8/3), over G = 4
    assert torch.allclose(c.cx, torch.tensor([[2 / 3, 1 / 3, -1 / 3, -2 / 3]], dtype=torch.float64))
    assert torch.allclose(c.cy, torch.tensor([[1, -1, 1, -1]], dtype=torch.float64) / 16)  # A / (G Lmax)
    f = um.unit_coefficients(S, L, Lmax, A, "sequence", cross_fit=True)
    # X half {0, 1}: c = (-1 - -2, -2 - -1) / 2 = (0.5, -0.5); Y half {2, 3}: A / (2 * 2) = (0.125, -0.125)
    assert torch.allclose(f.cx, torch.tensor([[0.5, -0.5, 0, 0]], dtype=torch.float64))
    assert torch.allclose(f.cy, torch.tensor([[0, 0, 0.125, -0.125]], dtype=torch.float64))
    assert torch.equal(f.cy_full, c.cy)
    with pytest.raises(ValueError, match="G >= 3"):
        um.unit_coefficients(S[:, :2], L[:, :2], Lmax, A[:, :2], "sequence", cross_fit=True)
    with pytest.raises(ValueError, match="dr_grpo"):
        um.unit_coefficients(S, L, Lmax, A, "dr_grpo", cross_fit=True)


def test_unit_plan_errors():
    assert plan_units(8, 2, 0).M == 4 and plan_units(8, 0, 4).k == 2 and plan_units(8, 0, 0).k == 1
    with pytest.raises(ValueError, match="not a multiple"):
        plan_units(7, 2, 0)
    with pytest.raises(ValueError, match="does not divide"):
        plan_units(8, 0, 3)
    with pytest.raises(ValueError, match=">= 3 units"):
        plan_units(4, 2, 0)


# ---------------------------------------------------------------- the stage against the enumeration
def reference(world: World, batch, k: int = 1, cross_fit: bool = False, pairs=None, mode: str = "sequence") -> dict:
    gidx = world.gidx(batch)
    S_w = world.S[gidx] / (batch.Lmax.unsqueeze(1) if mode == "dr_grpo" else 1)  # dr_grpo: S / Lmax
    cx, cy = hand_coeffs(S_w, batch.advantages.double(), batch.Lmax, cross_fit)
    return brute_force(world.kernel(gidx, cx, cy, k), pairs)


@pytest.mark.parametrize("case", [dict(), dict(block_size=2, mb_size=1), dict(cross_fit=True), dict(mode="dr_grpo")],
                         ids=["per_prompt", "blocks_of_2_over_2_microbatches", "cross_fit", "dr_grpo_weighting"])
def test_stage_matches_enumeration_reference(world, case):
    batch = world.setup.sample(8, 4, seed=7)
    case = dict(case)
    res = stage(world, batch, mb_size=case.pop("mb_size", 2), **case)
    ref = reference(world, batch, case.get("block_size", 1), case.get("cross_fit", False),
                    mode=case.get("mode", "sequence"))
    M = 8 // case.get("block_size", 1)
    assert res["M"] == M and res["B"] == 8 and res["G"] == 4
    for key, rkey in (("U_cross", "U"), ("zeta1_plugin", "zeta1"), ("SE_plugin", "SE_plugin"),
                      ("SE_jack", "SE_jack"), ("bars_dot", "bars"), ("diag_sum", "diag")):
        assert close(res[key], ref[rkey], REL_STAGE), (key, res[key], ref[rkey])
    assert close(res["bars_term"], M / (M - 1) * ref["bars"], REL_STAGE)
    assert close(res["deltaH1"], -LR * ref["U"], REL_STAGE)
    assert close(res["SE_deltaH1"], LR * ref["SE_jack"], REL_STAGE)  # SE_deltaH1 is the jackknife's
    top = int(ref["phi"].abs().argmax())
    assert res["top_units/01/unit"] == top and close(res["top_units/01/phi"], float(ref["phi"][top]), REL_STAGE)
    # cost: pass 1 = 1 forward + 2 backward, pass 2 = 1 forward + 2 backward, per sequence
    assert (res["ustat/forward_per_seq"], res["ustat/backward_per_seq"]) == (2.0, 4.0)


def test_blocks_of_one_prompt_equal_per_prompt_units(world):
    batch = world.setup.sample(6, 3, seed=11)
    a, b = stage(world, batch), stage(world, batch, num_blocks=6, mb_size=3)
    for key in ("U_cross", "deltaH1", "SE_plugin", "SE_jack", "zeta1_plugin", "zeta1_jack", "diag_sum",
                "top_units/01/phi", "top_units/03/phi"):
        assert close(a[key], b[key], 1e-6), key
    assert a["M"] == b["M"] == 6 and a["top_units/02/unit"] == b["top_units/02/unit"]


def test_incomplete_design(world):
    batch = world.setup.sample(6, 4, seed=13)
    complete = stage(world, batch)
    every = stage(world, batch, pairs_per_block=5, mb_size=1)
    for key in ("U_cross", "SE_plugin", "SE_jack", "zeta1_plugin"):
        assert close(every[key], complete[key], 1e-9), key
    two = stage(world, batch, pairs_per_block=2)
    ref = reference(world, batch, pairs=um.cyclic_partners(6, 2))
    for key, rkey in (("U_cross", "U"), ("SE_jack", "SE_jack"), ("zeta1_plugin", "zeta1")):
        assert close(two[key], ref[rkey], REL_STAGE), (key, two[key], ref[rkey])
    assert not close(two["U_cross"], complete["U_cross"], 1e-3)  # a different estimator on the same batch
    # cost: bars (1 fwd + 2 bwd) + per unit X (1 + 1) + K partners' Y (K + K)
    assert (two["ustat/forward_per_seq"], two["ustat/backward_per_seq"]) == (4.0, 5.0)
    with pytest.raises(ValueError, match="pairs_per_block=6"):
        stage(world, batch, pairs_per_block=6)


def test_ground_truth_on_a_held_out_batch(world):
    """The real step is this batch's; it is measured on a fresh E sampled at theta (responses the
    step was not fit to): the prediction -Xbar_E . Delta theta with its E-side SE, the measured
    change with its SE, and their paired difference."""
    batch, E = world.setup.sample(8, 4, seed=17), world.setup.sample(6, 4, seed=18)
    before = state_fingerprint(world.setup.params, world.opt)
    res = stage(world, batch, gt=True, E=E)
    after = state_fingerprint(world.setup.params, world.opt)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # restored bit for bit
    assert close(res["gt/B_E"], 6) and res["is/N"] == 24  # measured on E, not on the batch
    S_E = world.S[world.gidx(E)]
    assert close(res["H_orig"], float(-S_E.mean()), 1e-10)  # the change is measured from E's entropy
    for key in ("deltaH_true", "SE_deltaH_true", "deltaH1_step", "ESS", "deltaH_pred", "SE_deltaH_pred",
                "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred"):
        assert math.isfinite(res[key]) and (not key.startswith("SE") or res[key] > 0), key
    assert math.isnan(res["SE_deltaH_pred_U"])  # U is the step's own batch: the E side only
    assert close(res["SE_deltaH_pred"], res["SE_deltaH_pred_E"], 1e-12)
    # the prediction is the first-order change of the step taken (the same Xbar_E, the same update)
    assert close(res["deltaH_pred"], res["deltaH1_step"], 1e-6)
    # cross-fitting changes X and Y of the U-statistic but the real step still uses the full-group
    # gradient: the same theta_plus, so the same measured entropy change
    xf = stage(world, batch, gt=True, cross_fit=True, E=E)
    assert close(xf["deltaH_true"], res["deltaH_true"], 1e-9) and close(xf["H_upd"], res["H_upd"], 1e-12)
    assert not close(xf["U_cross"], res["U_cross"], 1e-3)
    assert xf["ustat/backward_per_seq"] == 5.0  # the full-group Y costs one more backward in pass 1
    with pytest.raises(ValueError, match="fresh evaluation batch"):
        stage(world, batch, gt=True)


# ---------------------------------------------------------------- Monte Carlo over the exact distribution
def mc(world: World, B: int, G: int, n: int, seed: int, cross_fit: bool = False, chunk: int = 250):
    """Per draw: the UStat, Xbar.P.Ybar (the uncorrected single-batch product), the mean d_u, and
    the table coefficients of Xbar and Ybar (for two-batch products across independent draws)."""
    us, plug, dmean, xb, yb = [], [], [], [], []
    for c in range(0, n, chunk):
        Cx, Cy = world.draws(B, G, min(chunk, n - c), seed * 100_003 + c, cross_fit)
        H = (Cx @ world.K) @ Cy.transpose(1, 2)  # [n, B, B] X_u.P.Y_v
        a, b, d = H.mean(2), H.mean(1), H.diagonal(dim1=1, dim2=2)
        us += [est.u_statistic(a[i], b[i], d[i]) for i in range(H.shape[0])]
        plug.append(H.mean((1, 2)))
        dmean.append(d.mean(1))
        xb.append(Cx.mean(1))
        yb.append(Cy.mean(1))
    return us, torch.cat(plug), torch.cat(dmean), torch.cat(xb), torch.cat(yb)


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std() / math.sqrt(x.numel()))


def test_u_cross_is_unbiased_where_the_plain_product_is_not(world):
    """B = 8 prompts, G = 2, Adam P at step 20, 3000 draws per estimator: few prompts and few
    responses make E[d_u] = E[X_u.P.Y_u] large next to the target, so the uncorrected product's
    bias (E[d_u] - target) / B is visible. Measured: exact target -538.7; U_cross -549.9 +- 23,
    two-batch Xbar_E.P.Ybar_U -541.8 +- 20 (independent E and U draws); uncorrected -920 +- 32,
    predicted -538.7 + (E[d_u] + 538.7) / 8 = -910.5 (11.9 SE from the target)."""
    B, G, n = 8, 2, 3000
    target = world.exact_target(G)
    us, plug, dmean, _, _ = mc(world, B, G, n, seed=1)
    _, _, _, xb_E, _ = mc(world, B, G, n, seed=11)  # independent E batches (X side)
    _, _, _, _, yb_U = mc(world, B, G, n, seed=21)  # independent U batches (Y side)
    U = torch.tensor([u.U_cross for u in us])
    two_batch = ((xb_E @ world.K) * yb_U).sum(1)
    mU, sU = mean_se(U)
    m2, s2 = mean_se(two_batch)
    mp, sp = mean_se(plug)
    assert abs(mU - target) < 4 * sU, (mU, target, sU)
    assert abs(m2 - target) < 4 * s2, (m2, target, s2)
    assert abs(mU - m2) < 4 * math.hypot(sU, s2), (mU, m2)
    bias = (float(dmean.mean()) - target) / B
    assert abs(mp - target) > 8 * sp, (mp, target, sp)  # the bias is visible...
    assert abs(mp - (target + bias)) < 4 * sp, (mp, target, bias)  # ...and it is (E[d_u] - target) / B
    assert abs(target) > 10 * sU  # power: a zero or sign-flipped estimator fails


def test_standard_errors_match_the_spread_of_u_cross(world):
    """B = 32, G = 8, 1000 draws. Measured: RMS SE_plugin / sd(U) = 0.98, RMS SE_jack / sd(U) =
    1.01 (other seeds: 0.94 / 0.97, 0.97 / 1.00). With few units both overstate the spread (their
    squares carry the second-order term 2 zeta2 / (B(B-1)) of Var(U) about twice; the jackknife's
    is the Efron-Stein excess): at B = 8, G = 2 the ratios are 1.09 and 1.27."""
    us, _, _, _, _ = mc(world, 32, 8, 1000, seed=31)
    U = torch.tensor([u.U_cross for u in us])
    sd = float(U.std())
    for name in ("SE_plugin", "SE_jack"):
        rms = float(torch.tensor([getattr(u, name) for u in us]).pow(2).mean().sqrt())
        assert abs(rms / sd - 1) < 0.25, (name, rms, sd)
    mU, sU = mean_se(U)
    assert abs(mU - world.exact_target(8)) < 4 * sU


def test_cross_fit_is_unbiased(world):
    """Cross-fitting keeps E[X] and E[Y] (exchangeable responses), hence the target. Measured at
    B = 32, G = 8: -936 +- 18 vs -941.6; its spread is 1.04-1.18x the plain U's (each side uses
    half the responses, and U_cross already drops the diagonal that cross-fitting decorrelates)."""
    us, _, _, _, _ = mc(world, 32, 8, 1000, seed=41, cross_fit=True)
    m, s = mean_se(torch.tensor([u.U_cross for u in us]))
    assert abs(m - world.exact_target(8)) < 4 * s, (m, s)


# ---------------------------------------------------------------- distributed (gloo, 2 processes)
def _ddp_worker(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from entprobe.pipeline.stages.context import ProbeContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        w = build_world(table=False)
        batch = w.setup.sample(8, 4, seed=23)
        mine = batch.select(slice(rank * 4, rank * 4 + 4))  # contiguous shares, as main.shard does
        E = w.setup.sample(6, 4, seed=24).select(slice(rank * 3, rank * 3 + 3))
        model = torch.nn.parallel.DistributedDataParallel(w.setup.model, find_unused_parameters=True,
                                                          broadcast_buffers=False)
        ctx = ProbeContext(model, w.setup.names, w.setup.params, torch.device("cpu"), None, 1.0, "sequence", 2,
                           torch.device("cpu"), torch.float64)
        geo = Geometry(w.opt, LR, w.P)
        res = {label: run_single_batch(ctx, mine, geo, ProbeConfig(mode="single_batch", **kw),
                                       ImportanceConfig(enabled=gt), Path(tempfile.mkdtemp()), E=E if gt else None)
               for label, kw, gt in (("units", {}, True), ("blocks", {"block_size": 2}, False))}
        if rank == 0:
            torch.save(res, out)
        dist.barrier()
    finally:
        # Leave without tearing down: freeing the DDP reducer after destroy_process_group drops the
        # last reference to the gloo group, whose destructor joins a worker thread that waits for the
        # GIL the destructor holds (a deadlock seen in torch 2.13).
        import os
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if sys.exc_info()[0] is None else 1)


def test_ddp_two_ranks_equal_one_process(world, tmp_path):
    from ddp_launch import launch_fresh

    out = tmp_path / "rank0.pt"
    launch_fresh("test_ustat", "_ddp_worker", 2, str(out))
    ddp = torch.load(out, weights_only=False)
    batch = world.setup.sample(8, 4, seed=23)
    single = {"units": stage(world, batch, gt=True, E=world.setup.sample(6, 4, seed=24)),
              "blocks": stage(world, batch, block_size=2)}
    for label in ("units", "blocks"):
        for key in ("U_cross", "SE_plugin", "SE_jack", "diag_sum", "bars_dot", "top_units/01/phi"):
            assert close(ddp[label][key], single[label][key], REL_STAGE), (label, key)
        assert all(ddp[label][k] == single[label][k] for k in ("M", "top_units/01/unit", "top_units/02/unit"))
    for key in ("deltaH_true", "SE_deltaH_true", "deltaH1_step", "H_orig", "ESS", "deltaH_pred", "SE_deltaH_pred",
                "SE_deltaH_true_minus_pred"):
        assert close(ddp["units"][key], single["units"][key], REL_STAGE), key
    # per rank 1 + 1 forward, 2 + 2 backward per sequence, summed over ranks
    assert (ddp["units"]["ustat/forward_per_seq"], ddp["units"]["ustat/backward_per_seq"]) == (2.0, 4.0)


# ---------------------------------------------------------------- end to end
def test_run_single_batch_end_to_end(tmp_path):
    from conftest import compose_cfg
    from entprobe.cli.probe_job import run

    res = run(compose_cfg(tmp_path, "probe.mode=single_batch", "batch.B_U=7", "probe.top_units=3"))
    for key in ("deltaH1", "U_cross", "SE_plugin", "SE_jack", "SE_deltaH1", "deltaH_true", "deltaH1_step"):
        assert math.isfinite(res[key]), key
    assert res["mode"] == "single_batch" and res["M"] == res["B"] == 7 and res["G"] == 4
    assert close(res["deltaH1"], -res["lr"] * res["U_cross"], 1e-12)
    assert close(res["U_cross"], 7 / 6 * res["bars_dot"] - res["diag_sum"] / 42, 1e-5)  # fp32 buffers
    assert res["passes/backward"] >= 4 * 7 * 4 and "top_units/03/phi" in res and "top_units/04/phi" not in res
    rows = (tmp_path / "ustat_units.csv").read_text().splitlines()
    assert len(rows) == 8 and rows[0] == "unit,prompt_index,phi,a,b,d"
    # the headline split by module kind and by layer (the attribution plot), summing to deltaH_pred
    for split in ("attr_pred/kind/", "attr_pred/layer/"):
        parts = [v for k, v in res.items() if k.startswith(split)]
        assert len(parts) >= 2 and math.isclose(sum(parts), res["deltaH_pred"], rel_tol=1e-5), split
    assert (tmp_path / "results.json").is_file()


def test_held_out_ground_truth_is_unbiased_for_the_exact_change(world):
    """The step this batch takes (AdamW from its full-group gradient), measured on fresh E draws:
    the mean of deltaH_true over 40 draws is within 3 SE of the exact H(theta_plus) - H(theta)
    (sequence mode), and the reported SE matches the spread. (Measured on the batch itself, the
    estimate was biased by -78%: the step was fit to those responses.)"""
    from entprobe.pipeline.stages.accumulate import accumulate, y_loss_of
    from entprobe.math.adamw import AdamWHyper, adamw_update
    from exact_model import params_set_to

    batch = fixed_batch(world.setup, 8, 4, seed=17)  # committed: the same on every machine
    ps = world.setup.params
    ctx = world.setup.ctx("sequence", mb_size=8)
    Y = torch.cat([b.reshape(-1) for b in accumulate(ctx, batch, y_loss_of(ctx), "Y").sum_buf]) / batch.B
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    g = world.opt.param_groups[0]
    h = AdamWHyper(g["lr"], g["weight_decay"], *g["betas"], g["eps"], float(world.opt.state[ps[0]]["step"]))
    delta = sum(adamw_update(Y, flat(world.opt.state[p]["exp_avg"] for p in ps),
                             flat(world.opt.state[p]["exp_avg_sq"] for p in ps), flat(ps), h).values())
    H0 = float(world.setup.exact_entropy().detach())
    with params_set_to(world.setup, flat(ps) + delta), torch.no_grad():
        exact = float(world.setup.exact_entropy()) - H0
    # the estimator itself (cv, deltaH_true's default): a draw whose weights are degenerate is
    # reported unmeasurable (deltaH_true NaN), but unbiasedness is over every draw
    rows = torch.tensor([[r["deltaH_cv"], r["SE_deltaH_cv"]] for r in
                         (stage(world, batch, gt=True, E=world.setup.sample(8, 4, seed=3000 + i)) for i in range(40))],
                        dtype=torch.float64)
    m, se = float(rows[:, 0].mean()), float(rows[:, 0].std()) / math.sqrt(len(rows))
    assert abs(m - exact) < 3 * se, (m, exact, se)
    assert abs(exact) > 3 * se  # power: a zero estimate would fail
    assert 0.6 < float((rows[:, 1] ** 2).mean() / rows[:, 0].var()) < 1.6
