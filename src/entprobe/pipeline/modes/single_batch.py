"""Single-batch probe: the cross-unit U-statistic of X and Y on one batch, its plug-in
and jackknife standard errors, and the Stage 3 ground truth of the batch's step measured on a fresh E.

Units are prompts, or blocks of ``k`` consecutive prompts (``block_size``, or ``num_blocks`` M
with k = B / M); a block's vectors are the means of its prompts' X_n and Y_n, so every formula
below holds with blocks as units. For units u = 1..M:

    a_u = X_u . P Ybar,  b_u = Y_u . P Xbar,  d_u = X_u . P Y_u
    U_cross = M/(M-1) Xbar.P.Ybar - sum_u d_u / (M(M-1)),   deltaH1 = -lr * U_cross
    SE_deltaH1 = lr * SE_jack  (the delete-1 jackknife; SE_plugin = sqrt(4 zeta1_hat / M) is reported too)

U_cross averages X_u . P Y_v over ordered pairs u != v of independent units, so it is unbiased for
E[X].P.E[Y]; the uncorrected Xbar.P.Ybar is biased by (E[X_u.P.Y_u] - E[X].P.E[Y]) / M.

Passes (each counted in ``ctx.stats``; ``ustat/*_per_seq`` in the results, in sequence passes):
1. bars: per microbatch one forward and a backward of the X loss and of the Y loss (a third, of
   the full-group Y loss, under cross-fitting with the ground truth on) -> sums of X and Y in
   parameter-sized buffers (buffers device), all-reduced once each; S, token log-probs and token
   entropies for the ground truth come out of this forward.
2. units: per unit one forward, the X backward (retain_graph) copied into a device buffer, the Y
   backward left in ``.grad``, then a_u, b_u, d_u as dots on the device against P Ybar, P Xbar
   and P kept there: no parameter-sized host transfer per unit. 1 forward + 2 backward per sequence;
   device memory: the gradients plus four parameter-sized fp32 buffers (P, P Xbar, P Ybar, X_u).
   Incomplete design (``pairs_per_block`` K > 0) instead: per unit the X backward, then for each
   of its K cyclic partners c (``ustat_math.cyclic_partners``) a forward and Y backward of c and
   the kernel h(u, c) = X_u . P Y_c 1 + K forwards and backwards per sequence.
An update that is exactly zero (pipeline/stages/zero_update.py) is noticed after pass 1: the
held-out E pass and the real step are skipped and the changes reported as 0 exactly; pass 2 too
when every unit's Y weight is 0 (every advantage zero: each Y_u is 0, and so are U_cross and its SEs).
Under DDP units never straddle ranks (each rank's prompts must split into whole blocks; the
incomplete design pairs units within a rank). Collectives: one gather of the per-rank prompt
counts, one all-reduce per bar buffer, one gather of the per-unit scalars (O(M) numbers), and the
scalar sums of the pass counts; results are the global ones on every rank.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from entprobe.runtime import distributed as D
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.runtime.atomic_io import atomic_open
from entprobe.pipeline.geometry import Geometry
from entprobe.reporting.tables import write_per_unit
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.stages.accumulate import check_grads, prepare_x, require_grad_path
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.x_spec import functional_value
from entprobe.pipeline.stages.ground_truth import StepInputs, run_ground_truth
from entprobe.pipeline.stages.prediction import build_step_model, predict_on_held_out
from entprobe.pipeline.stages.paired import compare_with_prediction
from entprobe.pipeline.stages.zero_update import update_is_zero, zero_update_results
from entprobe.math.ustat import UnitCoeffs, cyclic_partners, incomplete_u_statistic, top_units, unit_coefficients


@dataclass
class UnitPlan:
    k: int  # prompts per unit (1: per-prompt units)
    M_local: int  # units on this rank
    M: int  # units over all ranks
    offset: int  # global index of this rank's first unit
    M_min: int  # the fewest units on any rank
    B: int  # prompts over all ranks


def plan_units(B_local: int, block_size: int, num_blocks: int) -> UnitPlan:
    """Consecutive blocks of k prompts inside each rank; errors are raised on every rank alike."""
    counts = [int(c) for c in D.gather_units(torch.tensor([B_local])).tolist()]
    B = sum(counts)
    k = block_size or (B // num_blocks if num_blocks else 1)
    if num_blocks and B % num_blocks:
        raise ValueError(f"probe.num_blocks={num_blocks} does not divide the batch's {B} prompts")
    bad = [r for r, c in enumerate(counts) if c % k]
    if bad:
        raise ValueError(f"units of {k} consecutive prompts: rank(s) {bad} hold {[counts[r] for r in bad]} "
                         "prompts, not a multiple (blocks cannot straddle ranks); change block_size/num_blocks or B")
    M_ranks = [c // k for c in counts]
    if sum(M_ranks) < 3:
        raise ValueError(f"{sum(M_ranks)} units of {k} prompts: the U-statistic jackknife needs >= 3 units")
    r = D.rank()
    return UnitPlan(k, M_ranks[r], sum(M_ranks), sum(M_ranks[:r]), min(M_ranks), B)


def _coeffs(ctx: ProbeContext, S: torch.Tensor, mb: RolloutBatch, cross_fit: bool) -> UnitCoeffs:
    """X's and Y's response weights; X's from ``ctx.x`` for the functionals the seed's weights do not
    cover (zero when X is in per-token form: ``_x_loss`` builds it)."""
    if ctx.x.tokens or ctx.x.mode in ("token_mean", "seq_mean_token_mean"):
        cy = ctx.y_weights(mb, S.device).to(S.dtype)
        cx = torch.zeros_like(S) if ctx.x.tokens else ctx.x.weights(S.detach(), mb)
        return UnitCoeffs(cx, cy, cy)
    return unit_coefficients(S, mb.gen_lengths.to(S.device), mb.Lmax.to(S.device), mb.advantages.to(S.device),
                             ctx.weighting_mode, cross_fit, cy_full=ctx.y_weights(mb, S.device))


def _x_loss(ctx: ProbeContext, fwd, mb: RolloutBatch, c: UnitCoeffs) -> torch.Tensor:
    """The X loss of a microbatch: the (possibly cross-fitted) response weights ``c.cx``, or X's
    per-token form (``ctx.x``: Rao-Blackwellised, or ``seq_mean_token_mean``; not cross-fitted)."""
    if ctx.x.tokens:
        return ctx.x.loss(fwd, mb)
    return (c.cx * fwd.S).sum()


def _backward(ctx: ProbeContext, loss: torch.Tensor, mb: RolloutBatch, retain: bool = False) -> None:
    require_grad_path(loss, "single_batch")
    loss.backward(retain_graph=retain)
    ctx.stats.count("backward", mb.B * mb.G)


def _device_buffer(ctx: ProbeContext) -> pv.Buffer:
    """A zeroed parameter-sized buffer on the model's device, at least fp32 (X_u of bf16 models)."""
    return [torch.zeros(p.shape, device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
            for p in ctx.params]


def _dot_dev(a: pv.Buffer, b: pv.Buffer, P: pv.Buffer | None = None) -> torch.Tensor:
    """``sum_i a_i P_i b_i`` as a 0-dim fp64 tensor on a's device (no host sync)."""
    total = torch.zeros((), dtype=torch.float64, device=a[0].device)
    for i, (x, y) in enumerate(zip(a, b)):
        if P is not None:
            y = y * P[i]
        dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        total += torch.dot(x.reshape(-1).to(dt), y.reshape(-1).to(dt)).double()
    return total


@dataclass
class Bars:
    Xbar: pv.Buffer  # global mean of the units' X (buffers device)
    Ybar: pv.Buffer  # global mean of the units' Y
    Ybar_full: pv.Buffer  # global mean of the full-group Y: minus the DR-GRPO loss gradient
    S: torch.Tensor  # [B, G] local sequence log-probs at theta
    token_logp: torch.Tensor  # [B, G, T]
    entropy: torch.Tensor  # [B, G, T]


def bars_pass(ctx: ProbeContext, batch: RolloutBatch, cross_fit: bool, full_y: bool) -> Bars:
    """Pass 1: microbatched sums of X_n and Y_n (and of the full-group Y_n when ``full_y``)."""
    sums = [pv.zeros(ctx.params, ctx.buffers_device, ctx.buffers_dtype) for _ in range(2 + full_y)]
    S_all, lp_all, ent_all = [], [], []
    ctx.zero_grad()
    for start, mb in ctx.iterate(batch, ctx.mb_size, "U-stat bars"):
        what = f"U-stat bars, prompts [{start}, {start + mb.B})"
        with torch.enable_grad(), D.no_sync(ctx.model):
            fwd = ctx.forward_S(mb, what, with_entropy=ctx.x.entropy)
            S, lp, ent = fwd
            c = _coeffs(ctx, S, mb, cross_fit)
            losses = [_x_loss(ctx, fwd, mb, c), (c.cy * S).sum()] + ([(c.cy_full * S).sum()] if full_y else [])
            for i, (loss, buf) in enumerate(zip(losses, sums)):
                _backward(ctx, loss, mb, retain=i < len(losses) - 1)
                check_grads(ctx, what)
                pv.add_grads_(buf, ctx.params)
                ctx.zero_grad()
        S_all.append(S.detach().cpu())
        lp_all.append(lp.detach().cpu())
        ent_all.append(ent.detach().cpu())
    B = int(D.reduce_scalars(batch.B)[0])
    for buf in sums:
        pv.scale_(D.reduce_sum_(buf), 1.0 / B)
    Ybar_full = sums[2] if full_y else sums[1]
    return Bars(sums[0], sums[1], Ybar_full, torch.cat(S_all), torch.cat(lp_all), torch.cat(ent_all))


def _unit_grads(ctx: ProbeContext, unit: RolloutBatch, k: int, cross_fit: bool, label: str,
                X_dev: pv.Buffer | None, want_y: bool) -> None:
    """X_u into ``X_dev`` (when given) and Y_u into ``.grad`` (when ``want_y``), microbatch by
    microbatch: the Y accumulated so far is set aside while the X backward runs, then put back."""
    for s, mb in unit.microbatches(ctx.mb_size):
        with torch.enable_grad(), D.no_sync(ctx.model):
            fwd = ctx.forward_S(mb, f"{label}, prompts +[{s}, {s + mb.B})", with_entropy=ctx.x.entropy)
            S = fwd.S
            c = _coeffs(ctx, S, mb, cross_fit)
            if X_dev is not None:
                y_so_far = [p.grad for p in ctx.params]
                ctx.zero_grad()
                _backward(ctx, _x_loss(ctx, fwd, mb, c) / k, mb, retain=want_y)
                for x, p in zip(X_dev, ctx.params):
                    if p.grad is not None:
                        x.add_(p.grad)
                for p, g in zip(ctx.params, y_so_far):
                    p.grad = g
            if want_y:
                _backward(ctx, (c.cy * S).sum() / k, mb)


def units_pass(ctx: ProbeContext, batch: RolloutBatch, plan: UnitPlan, cross_fit: bool, bars: Bars,
               P: pv.Buffer | None) -> torch.Tensor:
    """Pass 2 (complete design): [M_local, 3] local (a_u, b_u, d_u), fp64."""
    dev = ctx.device
    PY = pv.mul(bars.Ybar, P, device=dev)
    PX = pv.mul(bars.Xbar, P, device=dev)
    P_dev = [p.to(dev) for p in P] if P is not None else None
    X_dev = _device_buffer(ctx)
    out = []
    for u, (start, unit) in enumerate(ctx.iterate(batch, plan.k, "U-stat units")):
        for x in X_dev:
            x.zero_()
        ctx.zero_grad()
        _unit_grads(ctx, unit, plan.k, cross_fit, f"U-stat unit {plan.offset + u}", X_dev, True)
        check_grads(ctx, f"U-stat unit {plan.offset + u}")
        Y = pv.grads(ctx.params)
        out.append(torch.stack([_dot_dev(X_dev, PY), _dot_dev(Y, PX), _dot_dev(X_dev, Y, P_dev)]))
        ctx.zero_grad()
    return torch.stack(out).cpu()


def pairs_pass(ctx: ProbeContext, batch: RolloutBatch, plan: UnitPlan, cross_fit: bool, K: int,
               P: pv.Buffer | None) -> torch.Tensor:
    """Pass 2 (incomplete design): kernel values h[u, j] = X_u . P Y_{partner j of u}, [M_local, K].

    Partners are cyclic among this rank's units; returned partner indices are global."""
    units = [unit for _, unit in batch.microbatches(plan.k)]
    partners = cyclic_partners(plan.M_local, K)
    P_dev = [p.to(ctx.device) for p in P] if P is not None else None
    X_dev = _device_buffer(ctx)
    h = torch.zeros(plan.M_local, K, dtype=torch.float64)
    for u in range(plan.M_local):
        for x in X_dev:
            x.zero_()
        ctx.zero_grad()
        _unit_grads(ctx, units[u], plan.k, cross_fit, f"U-stat pair unit {plan.offset + u} (X)", X_dev, False)
        for j, c in enumerate(partners[u].tolist()):
            ctx.zero_grad()
            _unit_grads(ctx, units[c], plan.k, cross_fit, f"U-stat pair unit {plan.offset + c} (Y)", None, True)
            h[u, j] = _dot_dev(X_dev, pv.grads(ctx.params), P_dev).cpu()
        ctx.zero_grad()
    return h


def _probe_passes(ctx: ProbeContext) -> tuple[float, float]:
    return ctx.stats.passes.get("forward", 0), ctx.stats.passes.get("backward", 0)


def run_single_batch(ctx: ProbeContext, batch: RolloutBatch, geo: Geometry, pcfg, icfg, run_dir: Path,
                     resample: Callable[[], RolloutBatch] | None = None, E: RolloutBatch | None = None) -> dict:
    """The single-batch probe on ``batch`` (this rank's prompts). Returns flat global results. With
    the ground truth on, ``E`` is a fresh batch sampled at theta on which the step is measured."""
    if batch.G < 2:
        raise ValueError(f"single_batch: G={batch.G}; need >= 2 responses per prompt")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("single_batch: probe passes cannot run under torch.inference_mode()")
    plan = plan_units(batch.B, pcfg.block_size, pcfg.num_blocks)
    K = pcfg.pairs_per_block
    if K > plan.M_min - 1:
        raise ValueError(f"probe.pairs_per_block={K}: partners are chosen among a rank's own units, "
                         f"so it must be <= {plan.M_min - 1} (the fewest units on a rank, minus 1)")
    full_y = pcfg.cross_fit and icfg.enabled
    f0, b0 = _probe_passes(ctx)
    with ctx.phase("ustat_bars"):
        prepare_x(ctx, batch)  # token_mean's constants from this batch
        bars = bars_pass(ctx, batch, pcfg.cross_fit, full_y)
    bars_dot = pv.dot(bars.Xbar, bars.Ybar, geo.P)
    step = build_step_model(ctx, geo.optimizer, geo.lr, bars.Ybar_full, geo.P, icfg.step_mode.value,
                            icfg.max_grad_norm)
    zero = update_is_zero(ctx, step, bars.Ybar_full)  # nothing moves: no held-out E pass, no real step
    # every Y weight 0 (every advantage): each unit's Y_u is 0, so are its kernel values and a, b, d
    no_y = zero and D.reduce_scalars(float(torch.count_nonzero(ctx.y_weights(batch, "cpu"))))[0] == 0
    if K:
        partners = cyclic_partners(plan.M_local, K) + plan.offset
        if no_y:
            h = torch.zeros(plan.M_local, K, dtype=torch.float64)
        else:
            with ctx.phase("ustat_pairs"):
                h = pairs_pass(ctx, batch, plan, pcfg.cross_fit, K, geo.P)
        u = incomplete_u_statistic(D.gather_units(h), D.gather_units(partners))
    else:
        if no_y:
            abd = torch.zeros(plan.M, 3, dtype=torch.float64)
        else:
            with ctx.phase("ustat_units"):
                abd = D.gather_units(units_pass(ctx, batch, plan, pcfg.cross_fit, bars, geo.P))
        u = est.u_statistic(abd[:, 0], abd[:, 1], abd[:, 2])
    f1, b1 = _probe_passes(ctx)
    n_fwd, n_bwd = D.reduce_scalars(f1 - f0, b1 - b0)
    n_seq = plan.B * batch.G

    lr = geo.lr
    d1 = est.delta_h1(lr, u.U_cross)
    se = lr * u.SE_jack
    res: dict = {
        "mode": "single_batch", "B": plan.B, "G": batch.G, "M": plan.M, "unit_size": plan.k,
        "cross_fit": bool(pcfg.cross_fit), "pairs_per_block": K,
        "u_design": f"incomplete_cyclic_{K}" if K else "complete", "lr": lr,
        "U_cross": u.U_cross, "deltaH1": d1, "bars_dot": bars_dot, "bars_term": u.bars_term,
        "diag_sum": u.diag_sum, "deltaH1_uncorrected": est.delta_h1(lr, bars_dot),
        "zeta1_plugin": u.zeta1_plugin, "SE_plugin": u.SE_plugin,
        "zeta1_jack": u.zeta1_jack, "SE_jack": u.SE_jack,
        "SE_deltaH1": se, "SE_deltaH1_source": "jackknife",
        "ci95_low": d1 - 1.959963984540054 * se, "ci95_high": d1 + 1.959963984540054 * se,
        "ustat/forward_per_seq": n_fwd / n_seq, "ustat/backward_per_seq": n_bwd / n_seq,
    }
    prompts = D.gather_units(batch.prompt_index)
    phi = u.phi / 2  # phi_u = r_u - U (the influence of unit u on U is 2 phi_u)
    res.update(top_unit_results(phi, prompts, plan.k, pcfg.top_units))
    if D.is_main():
        write_units_csv(run_dir / "ustat_units.csv", prompts, plan.k, phi, None if K else abd)

    S_g = D.gather_units(bars.S)
    L_g, Lmax_g, A_g = (D.gather_units(t) for t in (batch.gen_lengths, batch.Lmax, batch.advantages))
    Sw_g = est.weighted_S(S_g, L_g, Lmax_g, ctx.weighting_mode)
    res["H_orig"] = functional_value(ctx.x, S_g, D.gather_units(bars.entropy), D.gather_units(batch.response_mask))
    res["deltaH_cov"] = est.delta_h_cov(lr, Sw_g, ctx.objective.effective_advantages(A_g, L_g, Lmax_g))

    if icfg.enabled and E is None:
        raise ValueError("single_batch with importance.enabled needs a fresh evaluation batch E: the "
                         "step is fit to this batch, so its change is measured on responses it was not fit to")
    res["update_zero"] = zero
    if zero:
        res.update(zero_update_results(step.names, step.kind, icfg.enabled))
        if D.is_main():
            write_per_unit(run_dir)
    elif icfg.enabled:
        res.update(held_out_ground_truth(ctx, E, batch, step, bars, geo, pcfg, icfg, resample, run_dir))
    elif D.is_main():
        write_per_unit(run_dir)  # no step measured: no per-prompt values (and none left from an earlier run)
    return res


def held_out_ground_truth(ctx: ProbeContext, E: RolloutBatch, batch: RolloutBatch, step, bars: Bars, geo: Geometry,
                          pcfg, icfg, resample, run_dir: Path) -> dict:
    """The real step on ``batch`` (its full-group gradient), predicted and measured on a fresh E
    sampled at theta (``predict_on_held_out``: the prediction has its E-side SE, the step being
    this batch's: U is fixed, as in the comparison), and the ground truth re-weights E's responses.
    On the batch the step was fit to, the measured change is biased (-78% measured on the exact model).
    ``step``: the batch's update (``build_step_model`` on ``bars.Ybar_full``)."""
    pred = predict_on_held_out(ctx, E, step, pcfg)
    res = dict(pred.res)
    inp = StepInputs(geo.optimizer, geo.lr, pred.Xbar, bars.Ybar_full, geo.P, batch.B, pred.S, bars.token_logp,
                     pred.entropy, pred.token_logp)
    gt = run_ground_truth(ctx, E, batch, inp, icfg, resample=resample)
    psi, log_w = gt.pop("gt/psi"), gt.pop("gt/log_weights")
    res.update(gt)
    res.update(compare_with_prediction(res, psi, pred.e))
    if "SE_deltaH_true_minus_pred" in res:  # its t interval's degrees of freedom: B_E prompts - 1
        res["df_true_minus_pred"] = psi.numel() - 1
    if D.is_main():
        write_per_unit(run_dir, psi, pred.e, log_w)
    return res


def top_unit_results(phi: torch.Tensor, prompts: torch.Tensor, k: int, n: int) -> dict:
    """``top_units/NN/{unit, prompt_index, phi}`` for the n units with the largest |phi_u|;
    prompt_index is the task prompt (an int) for per-prompt units, "i,j,..." for blocks."""
    out = {}
    for rank_i, i in enumerate(top_units(phi, n)):
        key = f"top_units/{rank_i + 1:02d}"
        ids = prompts[i * k:(i + 1) * k].tolist()
        out.update({f"{key}/unit": i, f"{key}/prompt_index": ids[0] if k == 1 else ",".join(map(str, ids)),
                    f"{key}/phi": float(phi[i])})
    return out


def write_units_csv(path: Path, prompts: torch.Tensor, k: int, phi: torch.Tensor,
                    abd: torch.Tensor | None) -> None:
    """One row per unit: its task prompt indices, phi_u and (complete design) a_u, b_u, d_u."""
    with atomic_open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["unit", "prompt_index", "phi"] + (["a", "b", "d"] if abd is not None else []))
        for i in range(phi.numel()):
            ids = " ".join(str(int(x)) for x in prompts[i * k:(i + 1) * k])
            w.writerow([i, ids, float(phi[i])] + ([float(x) for x in abd[i]] if abd is not None else []))
