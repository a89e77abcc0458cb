"""The two-batch probe, top to bottom: Y over U -> the update the optimizer will take -> X over E
-> per-unit projections -> predictions with SEs -> ground truth -> measured minus predicted.

Order matters for cost: U is accumulated first so that ``P Ybar`` and ``Delta theta(Ybar)`` are
known during the E pass, which then projects each unit onto them as it accumulates (the E side of
every SE for free; the U side from kept per-unit gradients or forward-mode passes,
stages/variance.py); ``S_orig`` for the ground truth comes out of the same E pass, and the update
step reuses ``-Ybar_raw``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from entprobe import distributed as D
from entprobe import estimators as est
from entprobe import paramvec as pv
from entprobe.atomic_io import write_bytes_atomic
from entprobe.attribution import summarize, write_csv
from entprobe.geometry import Geometry
from entprobe.plan import projections_record
from entprobe.report import write_per_unit
from entprobe.rollout import RolloutBatch
from entprobe.stages.accumulate import accumulate, global_mean, x_loss_of, y_loss_of
from entprobe.stages.context import ProbeContext
from entprobe.stages.ground_truth import StepInputs, run_ground_truth
from entprobe.stages.prediction import (build_step_model, compare_with_prediction, directions, mul_into,
                                        prediction_results)
from entprobe.stages.variance import (project_backward, project_jvp, project_stored, resolve_projection,
                                      resolve_unit_backward)


def run_two_batch(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry, pcfg, icfg,
                  run_dir: Path, resample: Callable[[], RolloutBatch] | None = None) -> dict:
    res: dict = {}
    mode = resolve_projection(pcfg, ctx, U.B) if pcfg.variance_enabled else None
    unit_bwd = resolve_unit_backward(pcfg, ctx, (U, E))
    with ctx.phase("accumulate_Y_U"):
        accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U", keep_unit_grads=mode == "stored",
                          unit_backward=unit_bwd)
        Ybar, B_U = global_mean(accY.sum_buf, accY.B)
    # The update the optimizer will apply to this gradient (known before the step is taken)
    step = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, icfg.step_mode.value, icfg.max_grad_norm)
    fused = mode in ("stored", "fused")  # a_u taken during the X pass
    dir_dev = ctx.device if mode in ("stored", "fused", "jvp") else ctx.buffers_device
    # E-side directions, one [k, N] matrix: P Ybar (deltaH1), then each part of the update (the
    # prediction), each written in place into its row
    dirE = directions(ctx, [mul_into(Ybar, geo.P)], step, dir_dev)
    PY = dirE.column(0)  # P Ybar: deltaH1 and the attribution table
    with ctx.phase("accumulate_X_E"):
        accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", directions=dirE if fused else None,
                          with_entropy=True, unit_backward=unit_bwd)
        Xbar, B_E = global_mean(accX.sum_buf, accX.B)
    terms = pv.dot_terms(Xbar, PY)  # Xbar . P Ybar per parameter: bars_dot and the attribution table
    bars_dot = float(terms.sum())
    step_dots = pv.dot_set(Xbar, dirE)[1:].tolist()  # Xbar . Delta theta_part
    nX, nPY = pv.norm(Xbar), pv.norm(PY)
    if geo.no_history is not None:
        # coordinates Adam never updated (v = 0: P = 1/eps there) inflate the seeds' deltaH1, not
        # the real step, which moves them by about lr
        res["deltaH1_no_history"] = est.delta_h1(geo.lr, pv.dot_at(Xbar, PY, geo.no_history))
    del PY
    res.update({"B_E": B_E, "B_U": B_U, "G": E.G, "lr": geo.lr, "bars_dot": bars_dot,
                "deltaH1": est.delta_h1(geo.lr, bars_dot), "norm_Xbar": nX, "norm_PYbar": nPY,
                "cos_Xbar_PYbar": bars_dot / (nX * nPY) if nX * nPY > 0 else float("nan")})
    S_U = D.gather_units(accY.S)
    L_U, Lmax_U = D.gather_units(U.gen_lengths), D.gather_units(U.Lmax)
    Sw_U = est.weighted_S(S_U, L_U, Lmax_U, ctx.weighting_mode)
    res["deltaH_cov"] = est.delta_h_cov(geo.lr, Sw_U, ctx.objective.effective_advantages(
        D.gather_units(U.advantages), L_U, Lmax_U))
    S_E = D.gather_units(accX.S)
    res["H_orig"] = float(-est.weighted_S(S_E, D.gather_units(E.gen_lengths), D.gather_units(E.Lmax),
                                          ctx.weighting_mode).double().mean())

    e = u = None
    if pcfg.variance_enabled:
        with ctx.phase("variance"):
            # U-side directions: P Xbar (deltaH1), then J * Xbar (the prediction's delta method)
            fill_JX = [lambda out: step.jacobian_times_into(Xbar, out)] if step.jacobian_times_into else []
            # with a_u taken in the X pass, the E directions are spent: U's are written over them
            reuse = dirE.mat if fused else None
            dirU = directions(ctx, [mul_into(Xbar, geo.P)] + fill_JX, None, dir_dev, storage=reuse)
            del reuse
            if mode == "stored":
                a, b = accX.proj, project_stored(accY.unit_grads, dirU)
                accY.unit_grads = None
            elif mode in ("fused", "jvp"):  # forward mode over U (and over E for jvp)
                jvp_mb = pcfg.jvp_mb_size_prompts
                if mode == "fused":
                    a = accX.proj
                else:
                    a = project_jvp(ctx, E, dirE, "X", "a_u over E", mb_size=ctx.nograd_mb(E, True, jvp_mb))
                b = project_jvp(ctx, U, dirU, "Y", "b_u over U", mb_size=ctx.nograd_mb(U, True, jvp_mb))
            else:
                a = project_backward(ctx, E, dirE, "X", "a_u over E")
                b = project_backward(ctx, U, dirU, "Y", "b_u over U")
            del dirU
            # b: the units' first-order influences when the objective couples them (objectives.py)
            a, b = D.gather_units(a), ctx.objective.linearize(D.gather_units(b))
            v = est.two_batch_variance(a[:, 0], b[:, 0], geo.lr, bars_dot)
            e = -a[:, 1:]  # per-unit contributions to deltaH_pred: -X_u . Delta theta_part
            u = -b[:, 1] if b.shape[1] > 1 else None  # -Y_v . (J * Xbar)
        res.update({"V_X": v.V_X, "V_Y": v.V_Y, "SE_deltaH1": v.SE, "frac_var": v.frac_var,
                    "ci95_low": v.ci95_low, "ci95_high": v.ci95_high, "deltaH1_df": v.df,
                    "projection": mode})
        if fused:  # per-unit gradients were taken (a backward per unit, or batched)
            res["unit_backward"] = unit_bwd
    del dirE
    res.update(prediction_results(step, step_dots, e, u))

    names = ctx.names
    flat, rows = summarize(names, terms.tolist(), pcfg.top_k_params)
    res.update(flat)
    if D.is_main():
        write_csv(rows, run_dir / "attribution.csv")
        if pcfg.save_buffers:
            save_buffers(run_dir / "buffers.safetensors", names, Xbar, Ybar, geo.P)

    psi = log_w = None
    if icfg.enabled:
        inp = StepInputs(geo.optimizer, geo.lr, Xbar, Ybar, geo.P, B_U, accX.S, accY.token_logp,
                         accX.entropy)
        gt = run_ground_truth(ctx, E, U, inp, icfg, resample=resample)
        psi, log_w = gt.pop("gt/psi"), gt.pop("gt/log_weights")
        res.update(gt)
        res.update(compare_with_prediction(res, psi, e))
    if D.is_main():
        # per-prompt values: the report's plots, and the projections the batch-size planner reads
        rec = projections_record(B_E, B_U, E.G, geo.lr, a, b, step.names) if e is not None else None
        write_per_unit(run_dir, psi, e, log_w, *((a[:, 0], b[:, 0]) if e is not None else ()), lr=geo.lr,
                       record=rec)
    return res


def save_buffers(path: Path, names: list[str], Xbar, Ybar, P) -> None:
    """Xbar, raw Ybar and P as safetensors keyed ``Xbar/<param>``, ``Ybar_raw/<param>``, ``P/<param>``."""
    from safetensors.torch import save

    tensors = {}
    for n, x, y, *p in zip(names, Xbar, Ybar, *([P] if P is not None else [])):
        tensors[f"Xbar/{n}"] = x.detach().float().cpu().contiguous()
        tensors[f"Ybar_raw/{n}"] = y.detach().float().cpu().contiguous()
        if p:
            tensors[f"P/{n}"] = p[0].detach().float().cpu().contiguous()
    write_bytes_atomic(path, save(tensors))
