"""Stage 3 (ground truth) on the exactly enumerable policy: the bit-exact restore after every way a
step can fail, the phases and update diagnostics it reports, and two gloo ranks against one process
(the unbiasedness and first-order checks: test_ground_truth.py; the world: ground_truth_world.py).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from entprobe.config import StepMode, TrainingLoss
from entprobe.pipeline.stages.accumulate import accumulate, y_loss_of
from entprobe.pipeline.stages.ground_truth import run_ground_truth
from entprobe.pipeline.stages.snapshot import state_fingerprint
from conftest import fp_tol
from ddp_launch import launch
from ground_truth_world import G, ICFG, VARIANTS, AtThetaPlus, bitwise_equal, flat, inputs, set_lr
from ground_truth_world import world  # noqa: F401  (the policy at AdamW step 20, a module-scoped fixture)


# ---------------------------------------------------------------- bit-exact restore
class Boom(RuntimeError):
    pass


def _raise():
    raise Boom("injected after the step")


SCENARIOS = {
    "reuse+split": dict(icfg=dict(split_step=True)),
    "recompute+clip+accum": dict(icfg=dict(reuse_probe_gradient=False, importance_microbatch_size=1,
                                           rl_grad_accum=2, max_grad_norm=0.01, split_step=True)),
    "nll": dict(icfg=dict(training_loss=TrainingLoss.nll, split_step=True)),
    "preconditioned_sgd": dict(icfg=dict(step_mode=StepMode.preconditioned_sgd)),
    "snapshot_on_device+eval_mode": dict(icfg=dict(snapshot_device="gpu", split_step=True), eval_mode=True),
    "fail_after_step": dict(icfg=dict(split_step=True), fail=_raise),
    "fail_after_step+recompute": dict(icfg=dict(reuse_probe_gradient=False), fail=_raise),
    "fail_inside_recompute": dict(icfg=dict(reuse_probe_gradient=False, importance_microbatch_size=1),
                                  fail_forward=3),
    "fail_inside_optimizer_step": dict(icfg=dict(), fail_opt_step=True),  # gradients are views of -Ybar
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("world", VARIANTS, indirect=True)
def test_restore_is_bit_exact(world, name):
    sc = SCENARIOS[name]
    w, lr = world, 1e-2
    set_lr(w.opt, lr)
    E = w.setup.sample(4, G, seed=12)
    inp = inputs(w, E, lr)
    icfg = dataclasses.replace(ICFG, **sc["icfg"])
    w.setup.model.train(not sc.get("eval_mode", False))
    before = state_fingerprint(w.setup.params, w.opt)
    ybar = [y.clone() for y in inp.Ybar_raw]  # the step reads -Ybar_raw as its gradient, in place
    frozen = [p for p in w.setup.model.parameters() if not p.requires_grad]  # LoRA: the base model
    assert bool(frozen) == (w.variant == "lora")
    frozen_before = [p.detach().clone() for p in frozen]
    objs = [id(v) for p in w.setup.params for v in w.opt.state[p].values()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in w.opt.param_groups]
    ctx = dataclasses.replace(w.ctx)
    if "fail_forward" in sc:  # raise in the n-th forward of the update pass (grads half accumulated)
        calls, real = [0], ctx.forward_S

        def forward_S(mb, what, **kw):
            calls[0] += 1
            if calls[0] == sc["fail_forward"]:
                raise Boom("injected inside the update pass")
            return real(mb, what, **kw)
        ctx.forward_S = forward_S
    if sc.get("fail_opt_step"):
        real_step = w.opt.step

        def step(*a, **k):
            assert all(torch.equal(p.grad, -y) for p, y in zip(w.setup.params, ybar))
            real_step(*a, **k)  # half-done from the caller's view: theta and the state moved
            raise Boom("injected inside optimizer.step")
        w.opt.step = step
    moved = AtThetaPlus(w.setup)

    def after_step():
        moved()
        (sc.get("fail") or (lambda: None))()
    try:
        if "fail" in sc or "fail_forward" in sc or "fail_opt_step" in sc:
            with pytest.raises(Boom):
                run_ground_truth(ctx, E, w.U, inp, icfg, fail_after_step=after_step)
        else:
            run_ground_truth(ctx, E, w.U, inp, icfg, fail_after_step=after_step)
        if "fail_forward" not in sc and "fail_opt_step" not in sc:
            assert not torch.equal(moved.theta, flat(w.setup.params))  # a step was really taken
        assert bitwise_equal(before, state_fingerprint(w.setup.params, w.opt))
        assert bitwise_equal(ybar, inp.Ybar_raw)
        assert objs == [id(v) for p in w.setup.params for v in w.opt.state[p].values()]  # in place
        assert groups == [{k: v for k, v in g.items() if k != "params"} for g in w.opt.param_groups]
        assert all(p.grad is None for p in w.setup.params)
        assert bitwise_equal(frozen_before, [p.detach() for p in frozen]) and all(p.grad is None for p in frozen)
        assert w.setup.model.training == (not sc.get("eval_mode", False))
    finally:
        w.setup.model.train()
        w.opt.__dict__.pop("step", None)


def test_phases_and_update_diagnostics_are_reported(world):
    w, lr = world, 1e-3
    set_lr(w.opt, lr)
    E = w.setup.sample(4, G, seed=13)
    U = dataclasses.replace(w.U, sampler_logprobs=w.U.sampler_logprobs.clone())
    U.sampler_logprobs[0, 0][U.response_mask[0, 0].bool()] = float("nan")  # seed 003: missing old log-probs
    n_nan, n_tok = int(U.response_mask[0, 0].sum()), int(U.response_mask.sum())
    w.ctx.stats.seconds.clear()
    icfg = dataclasses.replace(ICFG, split_step=True, resample_on_low_ess=True)  # threshold 0.3

    def never():
        raise AssertionError("resampled although ESS/N >= ess_threshold")
    r = run_ground_truth(w.ctx, E, U, inputs(w, E, lr), icfg, resample=never)
    assert r["ESS_frac"] > icfg.ess_threshold and "deltaH_resample" not in r
    assert r["update/frac_old_logprobs_valid"] == pytest.approx(1 - n_nan / n_tok)
    # sampler log-probs are fp32 copies of the same fp64 numbers: each token's log-ratio is one fp32
    # rounding of its log-prob (u |logp|), the ratio exp of it; nothing clipped
    lp = U.sampler_logprobs[U.response_mask.bool()]
    assert abs(r["update/mean_importance_ratio"] - 1.0) <= fp_tol(torch.float32, float(lp[lp.isfinite()].abs().max()), 1, k=2)
    assert r["update/clip_fraction"] == 0.0
    assert r["token_entropy_upd"] - r["token_entropy_orig"] == pytest.approx(r["deltaH_token_entropy"])
    assert r["ESS"] == pytest.approx(r["ESS_frac"] * 4 * G)
    flat_stats = w.ctx.stats.flat()
    for phase in ("gt_snapshot", "gt_step", "gt_eval_E", "gt_split", "gt_restore"):
        assert flat_stats[f"time/{phase}_s"] >= 0 and f"mem/{phase}_peak_mb" in flat_stats


# ---------------------------------------------------------------- distributed (gloo, 2 ranks)
def _ddp_rank(rank, world_size, port, w, E, U, inp, runs, out_dir):
    try:
        torch.set_num_threads(1)
        # Tensors reach the ranks in shared memory: private copies, or both ranks step one model.
        w, E, U, inp = copy.deepcopy((w, E, U, inp))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        ddp = torch.nn.parallel.DistributedDataParallel(w.setup.model, find_unused_parameters=True)
        ctx = dataclasses.replace(w.ctx, model=ddp)
        e_idx, u_idx = (torch.arange(b.B).tensor_split(world_size)[rank] for b in (E, U))
        local = dataclasses.replace(inp, S_orig=inp.S_orig[e_idx], U_token_logp=inp.U_token_logp[u_idx],
                                    token_entropy_orig=inp.token_entropy_orig[e_idx])
        results = []
        for icfg, sgd in runs:
            hook = AtThetaPlus(w.setup)
            loc = dataclasses.replace(local, optimizer=torch.optim.SGD(w.setup.params, lr=inp.lr) if sgd else w.opt)
            r = run_ground_truth(ctx, E.select(e_idx), U.select(u_idx), loc, icfg, fail_after_step=hook)
            results.append((r, hook.theta))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        # Leave without teardown: freeing the DDP reducer after destroy_process_group would drop the
        # gloo group's last reference inside a GIL-holding destructor (a deadlock seen in torch 2.13).
        os._exit(0)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_distributed_step_equals_one_process(world, tmp_path):
    """2 gloo ranks own 3 + 2 prompts of U (uneven microbatch counts) and of E: the recomputed
    update (DDP averages: the loss carries a factor world), the IS estimates from gathered S, the
    global token sums all equal the one-process run on the same prompts."""
    w, lr = world, 1e-3
    set_lr(w.opt, lr)
    E, U = w.setup.sample(5, G, seed=14), w.setup.sample(5, G, seed=15)
    accY = accumulate(w.ctx, U, y_loss_of(w.ctx), "Y over U")
    inp = inputs(w, E, lr, U=U, accY=accY)
    rl = dataclasses.replace(ICFG, reuse_probe_gradient=False, importance_microbatch_size=1)
    runs = [(rl, True),  # SGD: the step is -lr * grad, so a gradient off by the world size shows
            (dataclasses.replace(rl, max_grad_norm=0.05), False),  # AdamW, clipped by the global norm
            (dataclasses.replace(ICFG, training_loss=TrainingLoss.nll, importance_microbatch_size=2), False)]
    ref = []
    for icfg, sgd in runs:
        hook = AtThetaPlus(w.setup)
        loc = dataclasses.replace(inp, optimizer=torch.optim.SGD(w.setup.params, lr=lr) if sgd else w.opt)
        ref.append((run_ground_truth(w.ctx, E, U, loc, icfg, fail_after_step=hook), hook.theta))
    try:
        launch(_ddp_rank, 2, w, E, U, inp, runs, str(tmp_path))
    finally:
        errs = [f.read_text() for f in tmp_path.glob("rank*.err")]
    assert not errs, "\n".join(errs)
    theta0 = flat(w.setup.params)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for (r, th), (r_ref, th_ref) in zip(got, ref):
            d, d_ref = th - theta0, th_ref - theta0
            assert float((d - d_ref).norm() / d_ref.norm()) < 1e-10
            for k in ("H_orig", "deltaH_snis", "deltaH_clip", "ESS", "deltaH1_step", "token_entropy_orig",
                      "deltaH_token_entropy", "update/mean_importance_ratio", "update/frac_old_logprobs_valid"):
                assert r[k] == pytest.approx(r_ref[k], rel=1e-9, abs=1e-12), k
