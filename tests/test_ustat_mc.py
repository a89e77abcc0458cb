"""Single-batch U-statistic (seed 001; DESIGN.md §3, §6), over the exact distribution: unbiasedness
and SE calibration by Monte Carlo on the enumerated world (ustat_world.py), two DDP ranks against one
process, and the job end to end (the algebra and the stage against the enumeration: test_ustat.py).
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from entprobe.math import estimators as est
from entprobe.config import ImportanceConfig, ProbeConfig
from entprobe.pipeline.geometry import Geometry
from entprobe.pipeline.modes.single_batch import run_single_batch
from exact_model import fixed_batch
from ustat_world import LR, REL_STAGE, World, build_world, close, stage
from ustat_world import world  # noqa: F401  (the enumerated world, a module-scoped fixture)


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
    launch_fresh("test_ustat_mc", "_ddp_worker", 2, str(out))
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
