"""The two-batch probe, top to bottom: Y over U -> the update the optimizer will take -> X over E
-> per-unit projections (Stages 1-2, ``compute_stage12``) -> predictions with SEs -> ground truth
-> measured minus predicted.

Order matters for cost: U is accumulated first so that ``P Ybar`` and ``Delta theta(Ybar)`` are
known during the E pass, which then projects each unit onto them as it accumulates (the E side of
every SE for free; the U side from kept per-unit gradients or forward-mode passes,
pipeline/stages/variance.py); ``S_orig`` for the ground truth comes out of the same E pass, and the update
step reuses ``-Ybar_raw``.

In a sweep, Stages 1-2 are computed by the first job of those that differ only in the lr and read
by the others, rescaled to their lr (``share``: pipeline/lr_share.py); the ground truth runs in every job.

An update that is exactly zero (with the gradient ``P Ybar``: pipeline/stages/zero_update.py) is
noticed right after the U pass: the E pass, the projections and the real step are skipped and the
changes reported as 0 exactly (not with ``probe.what_if``, whose other settings' steps may move).
"""
from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import Callable

import torch

from entprobe.runtime import distributed as D
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.runtime.atomic_io import write_bytes_atomic
from entprobe.reporting.attribution import summarize, write_csv
from entprobe.pipeline.geometry import Geometry
from entprobe.reporting.planning import projections_record
from entprobe.reporting.tables import write_per_unit
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.lr_share import Stage12, Stage12Share
from entprobe.pipeline.stages.accumulate import accumulate, global_mean, prepare_x, x_loss_of, y_loss_of
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages.x_spec import functional_value
from entprobe.pipeline.stages.ground_truth import StepInputs, run_ground_truth
from entprobe.pipeline.stages.prediction import (build_step_model, directions, factored_directions, mul_into,
                                                 prediction_results, update_terms)
from entprobe.pipeline.stages.paired import compare_with_prediction
from entprobe.pipeline.stages.what_if import run_what_if
from entprobe.pipeline.stages.zero_update import ZeroUpdate, zero_update_results
from entprobe.pipeline.stages.variance import (project_backward, project_jvp, project_stored, resolve_projection,
                                      resolve_unit_backward, unit_grads_fit)


def compute_stage12(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry, pcfg, icfg,
                    stop_if_zero: bool = False) -> Stage12 | ZeroUpdate:
    """Stages 1-2 at ``geo.lr``: Ybar over U, the step model, Xbar over E with the per-unit
    projections onto ``P Ybar`` and the update's parts, then (``probe.variance_enabled``) U's
    projections onto ``P Xbar`` and ``J Xbar``. ``stop_if_zero``: a ``ZeroUpdate`` right after the
    U pass when ``P Ybar`` and every part of the update are exactly 0 (nothing after it is run)."""
    mode = resolve_projection(pcfg, ctx, U.B) if pcfg.variance_enabled else None
    unit_bwd = resolve_unit_backward(pcfg, ctx, (U, E))
    # U's per-unit gradients kept for b_u (stored; ghost when they fit, else forward mode as fused)
    keep_u = mode == "stored" or (mode == "ghost" and unit_grads_fit(pcfg, ctx, U.B))
    with ctx.phase("accumulate_Y_U"):
        accY = accumulate(ctx, U, y_loss_of(ctx), "Y over U", keep_unit_grads=keep_u,
                          unit_backward=unit_bwd)
        Ybar, B_U = global_mean(accY.sum_buf, accY.B)
    # The update the optimizer will apply to this gradient (known before the step is taken)
    step = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, icfg.step_mode.value, icfg.max_grad_norm)
    fused = mode in ("stored", "fused", "ghost")  # a_u taken during the X pass
    dir_dev = ctx.device if mode in ("stored", "fused", "jvp", "ghost") else ctx.buffers_device
    # E-side directions: P Ybar (deltaH1), then each part of the update (the prediction). Projected
    # during the X pass on a large model with AdamW, the parts stay factors of Ybar, m and theta
    # (2 stored rows, not 4: math/factored_directions.py); else each is written into its row
    dirE = (factored_directions(ctx, [mul_into(Ybar, geo.P)], step, dir_dev)
            if fused and mode != "ghost" else None) or directions(ctx, [mul_into(Ybar, geo.P)], step, dir_dev)
    PY = dirE.column(0)  # P Ybar: deltaH1 and the attribution table
    nPY = pv.norm(PY)
    if stop_if_zero and nPY == 0 and pv.is_zero(dirE):  # nothing moves: no E pass (stages/zero_update.py)
        return ZeroUpdate(step.names, step.kind, B_U, accY.S)
    prepare_x(ctx, E)  # token_mean's constants from E (stages/accumulate.py)
    with ctx.phase("accumulate_X_E"):
        accX = accumulate(ctx, E, x_loss_of(ctx), "X over E", directions=dirE if fused else None,
                          with_entropy=ctx.x.entropy, unit_backward="ghost" if mode == "ghost" else unit_bwd)
        Xbar, B_E = global_mean(accX.sum_buf, accX.B)
    terms = pv.dot_terms(Xbar, PY)  # Xbar . P Ybar per parameter: bars_dot and the attribution table
    step_dots = pv.dot_set(Xbar, dirE)[1:].tolist()  # Xbar . Delta theta_part
    # Xbar_i . Delta theta_i per parameter tensor, all parts summed: the headline's attribution
    # (on the directions' device: Xbar's tensors move to it, the update's parts stay)
    step_terms = update_terms(dirE, Xbar).to(terms.device)
    nX = pv.norm(Xbar)
    # coordinates Adam never updated (v = 0: P = 1/eps there) inflate deltaH1, not
    # the real step, which moves them by about lr
    nh_dot = pv.dot_at(Xbar, PY, geo.no_history) if geo.no_history is not None else None
    del PY
    a = b = None
    if pcfg.variance_enabled:
        with ctx.phase("variance"):
            # U-side directions: P Xbar (deltaH1), then J^T Xbar (the prediction's delta method)
            fill_JX = [lambda out: step.jacobian_times_into(Xbar, out)] if step.jacobian_times_into else []
            # with a_u taken in the X pass, the E directions are spent: freed before U's two are
            # built (written over them, the four rows' storage would stay held through U's passes)
            if fused:
                dirE = None
            fills = [mul_into(Xbar, geo.P)] + fill_JX
            # forward mode over U reads one direction a pass: both are written, in turn, into one buffer
            dirU = pv.OneAtATime(fills, ctx.params, dir_dev, torch.promote_types(ctx.buffers_dtype, torch.float32)) \
                if not keep_u and mode in ("fused", "jvp", "ghost") else directions(ctx, fills, None, dir_dev)
            if keep_u:
                a, b = accX.proj, project_stored(accY.unit_grads, dirU)
                accY.unit_grads = None
            elif mode in ("fused", "jvp", "ghost"):  # forward mode over U (and over E for jvp)
                jvp_mb = pcfg.jvp_mb_size_prompts
                if mode != "jvp":
                    a = accX.proj
                else:
                    a = project_jvp(ctx, E, dirE, "X", "a_u over E", mb_size=ctx.nograd_mb(E, True, jvp_mb))
                b = project_jvp(ctx, U, dirU, "Y", "b_u over U", mb_size=ctx.nograd_mb(U, True, jvp_mb))
            else:
                a = project_backward(ctx, E, dirE, "X", "a_u over E")
                b = project_backward(ctx, U, dirU, "Y", "b_u over U")
            del dirU
            # b: the units' first-order influences when the objective couples them (rollouts/objectives.py)
            a, b = D.gather_units(a), ctx.objective.linearize(D.gather_units(b))
    del dirE
    return Stage12(geo.lr, list(ctx.names), Ybar, Xbar, B_E, B_U, accY.S, accY.token_logp, accX.S, accX.entropy,
                   terms, nX, nPY, nh_dot, step.names, step.kind, step_dots, a, b, mode,
                   unit_bwd if (mode in ("stored", "fused") or keep_u) and pcfg.variance_enabled else None,
                   step_terms, accX.token_logp, step.facts, (ctx.x.kappa, ctx.x.scale))


def stage12_of(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry, pcfg, icfg,
               share: Stage12Share | None, stop_if_zero: bool = False) -> tuple[Stage12 | ZeroUpdate, dict]:
    """Stages 1-2 at ``geo.lr``: read from ``share`` when another lr wrote them (rescaled), else
    computed (and written to ``share``; a ``ZeroUpdate`` is not). Also ``reused_stage12`` and, when
    shared, ``stage12_share``."""
    if share is None:
        return compute_stage12(ctx, E, U, geo, pcfg, icfg, stop_if_zero), {"reused_stage12": False}
    with share.claim():
        with ctx.phase("stage12_load"):
            stored = share.load(ctx)
        if stored is not None:
            ctx.x = dataclasses.replace(ctx.x, kappa=stored.x_constants[0], scale=stored.x_constants[1])
            return stored.at_lr(geo.lr), {"reused_stage12": True, "stage12_share": f"reused from lr={stored.lr:g}"}
        st = compute_stage12(ctx, E, U, geo, pcfg, icfg, stop_if_zero)
        if isinstance(st, ZeroUpdate):
            return st, {"reused_stage12": False, "stage12_share": "not stored: the update is exactly zero"}
        with ctx.phase("stage12_store"):
            share.store(st)
    return st, {"reused_stage12": False, "stage12_share": "computed here, stored for the other lrs"}


def cov_baseline(ctx: ProbeContext, U: RolloutBatch, S_U_local: torch.Tensor, lr: float) -> float:
    """Cui et al.'s ``deltaH_cov = -lr mean_n Cov_g(S_w, A)`` on U (the objective's effective
    advantages), from this rank's U log-probs."""
    S_U = D.gather_units(S_U_local)
    L_U, Lmax_U = D.gather_units(U.gen_lengths), D.gather_units(U.Lmax)
    Sw_U = est.weighted_S(S_U, L_U, Lmax_U, ctx.weighting_mode)
    return est.delta_h_cov(lr, Sw_U, ctx.objective.effective_advantages(D.gather_units(U.advantages), L_U, Lmax_U))


def stage12_results(st: Stage12, ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry
                    ) -> tuple[dict, torch.Tensor | None, torch.Tensor | None]:
    """The flat results of Stages 1-2 at ``st.lr`` and the per-unit contributions ``e`` [B_E, parts]
    (``-X_u . Delta theta_part``) and ``u`` [B_U] (``-Y_v . J Xbar``), None without the variance."""
    lr, bars_dot, nX, nPY = st.lr, float(st.terms.sum()), st.norm_Xbar, st.norm_PYbar
    res: dict = {}
    if st.no_history_dot is not None:
        res["deltaH1_no_history"] = est.delta_h1(lr, st.no_history_dot)
    res.update({"B_E": st.B_E, "B_U": st.B_U, "G": E.G, "lr": lr, "bars_dot": bars_dot,
                "deltaH1": est.delta_h1(lr, bars_dot), "norm_Xbar": nX, "norm_PYbar": nPY,
                "cos_Xbar_PYbar": bars_dot / (nX * nPY) if nX * nPY > 0 else float("nan")})
    res["deltaH_cov"] = cov_baseline(ctx, U, st.S_U, lr)
    ent_E = D.gather_units(st.E_entropy) if st.E_entropy is not None else None
    res["H_orig"] = functional_value(ctx.x, D.gather_units(st.S_E), ent_E, D.gather_units(E.response_mask))
    e = u = None
    if st.a is not None:
        v = est.two_batch_variance(st.a[:, 0], st.b[:, 0], lr, bars_dot)
        e = -st.a[:, 1:]  # per-unit contributions to deltaH_pred: -X_u . Delta theta_part
        u = -st.b[:, 1] if st.b.shape[1] > 1 else None  # -Y_v . (J * Xbar)
        res.update({"V_X": v.V_X, "V_Y": v.V_Y, "SE_deltaH1": v.SE, "frac_var": v.frac_var,
                    "ci95_low": v.ci95_low, "ci95_high": v.ci95_high, "deltaH1_df": v.df,
                    "projection": st.projection})
        if st.unit_backward is not None:  # per-unit gradients were taken (a backward per unit, or batched)
            res["unit_backward"] = st.unit_backward
    res.update(prediction_results(st.step_names, st.step_kind, st.step_dots, e, u, st.step_facts))
    return res, e, u


def run_two_batch(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry, pcfg, icfg,
                  run_dir: Path, resample: Callable[[], RolloutBatch] | None = None,
                  share: Stage12Share | None = None) -> dict:
    st, res = stage12_of(ctx, E, U, geo, pcfg, icfg, share, stop_if_zero=not pcfg.what_if.enabled)
    if isinstance(st, ZeroUpdate):
        res.update(zero_update_two_batch(st, ctx, E, U, geo, pcfg, icfg, run_dir))
        return res
    flat, e, u = stage12_results(st, ctx, E, U, geo)
    res.update(flat)
    res["update_zero"] = False
    names = ctx.names
    flat, rows = summarize(names, st.terms.tolist(), pcfg.top_k_params, st.step_terms.tolist(), st.lr)
    res.update(flat)
    if D.is_main():
        write_csv(rows, run_dir / "attribution.csv")
        if pcfg.save_buffers:
            save_buffers(run_dir / "buffers.safetensors", names, st.Xbar, st.Ybar, geo.P)

    psi = log_w = None
    if icfg.enabled:
        inp = StepInputs(geo.optimizer, geo.lr, st.Xbar, st.Ybar, geo.P, st.B_U, st.S_E, st.U_token_logp,
                         st.E_entropy, st.E_token_logp)
        gt = run_ground_truth(ctx, E, U, inp, icfg, resample=resample)
        psi, log_w = gt.pop("gt/psi"), gt.pop("gt/log_weights")
        res.update(gt)
        res.update(compare_with_prediction(res, psi, e))
        if "SE_deltaH_true_minus_pred" in res:  # its t interval's degrees of freedom: B_E prompts - 1
            res["df_true_minus_pred"] = psi.numel() - 1
    if pcfg.what_if.enabled:  # other settings' steps, after the user's own (pipeline/stages/what_if.py)
        res.update(run_what_if(ctx, E, U, st, geo, pcfg, icfg, res))
    if D.is_main():
        # per-prompt values: the report's plots, and the projections the batch-size planner reads
        a, b = st.a, st.b
        rec = projections_record(st.B_E, st.B_U, E.G, geo.lr, a, b, st.step_names) if e is not None else None
        write_per_unit(run_dir, psi, e, log_w, *((a[:, 0], b[:, 0]) if e is not None else ()), lr=geo.lr,
                       record=rec)
    return res


def zero_update_two_batch(st: ZeroUpdate, ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, geo: Geometry,
                          pcfg, icfg, run_dir: Path) -> dict:
    """The results of a probe stopped at a zero update (``ZeroUpdate``): every change 0 exactly
    (``zero_update_results``; deltaH1 too, ``P Ybar`` being 0), the attribution all zeros,
    ``deltaH_cov`` from U's log-probs; nothing from E, which was not passed through the model."""
    B_E = int(D.reduce_scalars(E.B)[0])
    res = {"B_E": B_E, "B_U": st.B_U, "G": E.G, "lr": geo.lr, "bars_dot": 0.0, "deltaH1": 0.0, "SE_deltaH1": 0.0,
           "ci95_low": 0.0, "ci95_high": 0.0, "deltaH_cov": cov_baseline(ctx, U, st.S_U, geo.lr)}
    res.update(zero_update_results(st.step_names, st.step_kind, icfg.enabled))
    zeros = [0.0] * len(ctx.names)
    flat, rows = summarize(ctx.names, zeros, pcfg.top_k_params, zeros, geo.lr)
    res.update(flat)
    if D.is_main():
        write_csv(rows, run_dir / "attribution.csv")
        write_per_unit(run_dir)  # no per-prompt values (and none left from an earlier run)
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
