"""Single-batch U-statistic (seed 001; DESIGN.md §3, §6): algebra against brute force, the stage
against an enumeration reference (the Monte Carlo over the exact distribution, DDP and the job end to
end: test_ustat_mc.py; the enumerated world: ustat_world.py).

The Monte Carlo does not call the model per draw: every response's gradient is tabulated once
(3 prompts x 156 responses), so a draw is a few index operations and X_u . P Y_v comes from the
Gram matrix J P J^T. The stage tests pin the stage to the same table on real sampled batches, so
the Monte Carlo is about the estimator the stage computes.
"""
from __future__ import annotations

import math

import pytest
import torch

from entprobe.math import estimators as est
from entprobe.math import ustat as um
from entprobe.pipeline.stages.snapshot import state_fingerprint
from entprobe.pipeline.modes.single_batch import plan_units
from ustat_world import LR, REL_STAGE, World, close, stage
from ustat_world import world  # noqa: F401  (the enumerated world, a module-scoped fixture)


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
