"""Stage 3: the entropy change on E after one real optimizer step on U (docs/math.md).

snapshot -> grads on U (reused ``-Ybar_raw`` or the recomputed objective's / NLL loss) -> one step ->
S_upd on E -> importance-sampling estimates of H(theta_plus) -> restore bit-exactly (also on error).
With torch's Adam, AdamW or SGD the snapshot holds the weights only (stages/chunked_step.py).

Distributed: the reused gradient is already the global mean; the recomputed one is all-reduced
once per rank (DDP sync on the last microbatch only, so ranks with different microbatch counts
do not deadlock). IS sums use gathered per-response scalars, token diagnostics global sums.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from entprobe.runtime import distributed as D
from entprobe.math import estimators as est
from entprobe.math import importance as im
from entprobe.math import paramvec as pv
from entprobe.runtime import sharding
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.runtime.sharding import like_param, local
from entprobe.pipeline.stages.chunked_step import chunked_step, chunked_step_applies, weights_only_snapshot
from entprobe.pipeline.stages.context import ProbeContext, is_filler
from entprobe.pipeline.stages.forward_precision import forward_dtype, forward_eps  # noqa: F401
from entprobe.pipeline.stages.snapshot import resolve_snapshot_device, restore, take
from entprobe.pipeline.stages.step_split import split_step, step_rounding_bound, xbar_dot_step  # noqa: F401
from entprobe.pipeline.stages.token_measure import TokenSide, resampled_token_change, token_importance_estimates
from entprobe.pipeline.stages.x_spec import XSpec


@dataclass
class StepInputs:
    optimizer: torch.optim.Optimizer  # AdamW with the checkpoint state (or SGD for identity)
    lr: float
    Xbar: pv.Buffer  # global mean of X over E (buffers device)
    Ybar_raw: pv.Buffer  # global mean of raw Y over U: minus the objective's loss gradient
    P: pv.Buffer | None  # preconditioner (None = identity)
    B_U_global: int
    S_orig: torch.Tensor  # [B_E, G] local E log-probs at theta (from the X pass)
    U_token_logp: torch.Tensor  # [B_U, G, T] local U token log-probs at theta (from the Y pass)
    token_entropy_orig: torch.Tensor | None  # [B_E, G, T]
    E_token_logp: torch.Tensor | None = None  # [B_E, G, T] local E token log-probs at theta (X pass)


def _set_grads(ctx: ProbeContext, buf: pv.Buffer, scale: float) -> None:
    for p, b in zip(ctx.params, buf):
        p.grad = like_param(p, (b.to(p.device, p.dtype) * scale).contiguous())


def _negated_as_grads(ctx: ProbeContext, buf: pv.Buffer) -> bool:
    """``p.grad = -buf`` without a parameter-sized allocation when buf has the parameters' device,
    dtype and layout: buf is negated in place (exact: a sign flip) and the gradients are views of
    it; ``_unnegate`` flips it back. False (nothing done) when it cannot alias."""
    if not all(b.device == p.device and b.dtype == p.dtype and b.shape == local(p).shape and b.is_contiguous()
               for p, b in zip(ctx.params, buf)):
        return False
    for p, b in zip(ctx.params, buf):
        p.grad = like_param(p, b.neg_())
    return True


def _unnegate(ctx: ProbeContext, buf: pv.Buffer) -> None:
    ctx.zero_grad()
    for b in buf:
        b.neg_()


def _is_ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _recompute_grads(ctx: ProbeContext, U: RolloutBatch, icfg, B_U_global: int) -> torch.Tensor:
    """Gradient of the training loss on U by microbatched backward, DDP sync on.

    rl: the objective's loss, ``-mean_n Y_n``'s potential (entprobe: mean over prompts of
    ``-(sum A * mask * logp) / (G * Lmax)``; rollouts/objectives.py); nll: ``-sum logp / #tokens``
    (both global: B_U_global prompts, all ranks' tokens). A forward covers
    ``importance_microbatch_size * rl_grad_accum`` prompts (``mb_size_prompts`` when null). DDP averages gradients over ranks, so
    the local loss carries a factor world size; DDP decides at forward time whether to reduce, so
    forward and backward of every microbatch but the last run under ``no_sync``. FSDP2 sums the
    ranks' gradients in every backward (runtime/sharding.py).
    Returns the token log-probs of U under theta [B, G, T] for the ratio diagnostics."""
    ctx.zero_grad()
    size = (icfg.importance_microbatch_size or ctx.mb_size) * icfg.rl_grad_accum
    ddp = _is_ddp(ctx.model)
    world = D.world() if ddp else 1
    n_tok = D.reduce_scalars(float(U.response_mask.sum()))[0]
    n_mb = (U.B + size - 1) // size
    token_lp = []
    for i, (start, mb) in enumerate(ctx.iterate(U, size, "update U")):
        sync = contextlib.nullcontext() if i == n_mb - 1 else D.no_sync(ctx.model)
        with sync, torch.enable_grad():
            S, lp, _ = ctx.forward_S(mb, f"update microbatch [{start}, {start + mb.B})")
            if icfg.training_loss.value == "rl":
                loss = -ctx.y_loss(S, mb) * (world / B_U_global)
            else:
                loss = -S.sum() * (world / n_tok)
            loss.backward()
        if is_filler(mb):
            continue
        ctx.stats.count("backward", mb.B * mb.G)
        token_lp.append(lp.detach().cpu())
    if D.is_dist() and not ddp and not sharding.sharded():  # a bare module under torch.distributed: sum the local shares
        D.reduce_sum_(pv.grads(ctx.params))
    return torch.cat(token_lp)


def _check_grads_finite(ctx: ProbeContext) -> None:
    gs = [p.grad for p in ctx.params if p.grad is not None]
    if gs and not torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(gs)])).all():
        raise FloatingPointError("ground-truth step: NaN/Inf in the update gradient on U; nothing was "
                                 "stepped (weights and optimizer state are restored)")


def _step(ctx: ProbeContext, inp: StepInputs, icfg, grads_from: Callable[[], None], chunked: bool) -> None:
    """Exactly one parameter update: ``optimizer.step()`` on the U gradient (clipped once over all
    of it; ``chunked``: ``chunked_step``, which leaves the optimizer state as it was), or in
    ``preconditioned_sgd`` mode exactly ``theta += lr * P * Ybar_raw`` (no gradient pass needed)."""
    if icfg.step_mode.value == "preconditioned_sgd":
        with torch.no_grad():
            for i, (p, y) in enumerate(zip(ctx.params, inp.Ybar_raw)):
                d = y if inp.P is None else y * inp.P[i].to(y.device)
                local(p).add_(d.to(p.device, p.dtype), alpha=inp.lr)
        return
    grads_from()
    _check_grads_finite(ctx)
    if icfg.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(ctx.params, icfg.max_grad_norm)
    if chunked:
        chunked_step(inp.optimizer)
    else:
        inp.optimizer.step()
    ctx.zero_grad()


IS_MODES = im.IS_ESTIMATORS
EPS32 = torch.finfo(torch.float32).eps


def token_side_needed(x: XSpec) -> bool:
    """Whether X's measured side reads E's token log-probs and entropies (stages/token_measure.py)."""
    return x.measures_tokens


def token_side(x: XSpec, E: RolloutBatch, lp0, lp1, H0, H1) -> TokenSide | None:
    """E's token-level values gathered over ranks, when X's measured side needs them (None otherwise)."""
    if not token_side_needed(x):
        return None
    if lp0 is None or H0 is None or H1 is None:
        raise RuntimeError(f"the {x.mode} / {x.estimator} measured change needs E's token log-probs and "
                           "entropies at theta and theta_plus")
    return TokenSide(*(D.gather_units(t) for t in (lp0, lp1, H0, H1, E.response_mask.double())))


def importance_estimates(S_orig: torch.Tensor, S_upd: torch.Tensor, L: torch.Tensor,
                         Lmax: torch.Tensor, mode: str, clip_c: float,
                         warn_psis: bool = True, x: XSpec | None = None,
                         tokens: TokenSide | None = None, eps_forward: float = EPS32) -> tuple[dict[str, float], dict]:
    """H(theta) and stratified IS estimates of the change on the same samples, [B, G] inputs.

    H = -E[S_w] in the weighting mode's functional; each estimator is paired with the prediction by
    construction (math/importance.py: ``paired_changes``). Returns flat results (``deltaH_<est>``,
    ``SE_deltaH_<est>`` for ``IS_MODES``, per-token SNIS, weight diagnostics, k-hat or why it is
    undefined) and the per-prompt contributions ``{est: psi [B]}`` for paired comparisons.
    ``warn_psis``: warn when PSIS is undefined (it is then NaN, never another estimate).
    ``tokens`` (with ``x``): the token-level values of E, for X's per-token form and the token
    functionals (stages/token_measure.py). ``rounding_deltaH_<est>``: a bound on what the forward
    passes' rounding (working precision ``eps_forward``) moves each estimate
    (``im.sequence_rounding`` propagated to first order: ``est.propagated_bound``).
    """
    if tokens is not None:
        return token_importance_estimates(tokens, x, clip_c, warn_psis, eps_forward)
    mode = getattr(mode, "value", mode)
    f_orig = -est.weighted_S(S_orig, L, Lmax, mode).double()  # [B, G]
    logw = (S_upd - S_orig).double()
    group = mode == "dr_grpo"
    smoothed = im.psis_smooth(logw)  # over all responses' log-weights: k-hat and the psis estimate
    if smoothed.note and warn_psis:
        warnings.warn(f"importance.is_mode=psis: PSIS is undefined here ({smoothed.note}); deltaH_psis is NaN "
                      "and the measurement unmeasurable: use importance.is_mode=cv", stacklevel=2)
    changes = im.paired_changes(S_orig, S_upd, L, Lmax, mode, clip_c, smoothed)
    if group:  # one item per prompt: the group's weight
        ess_frac = float(im.stratified_ess(logw.sum(-1))) / logw.shape[0]  # over prompts' groups
    else:
        ess_frac = float(im.stratified_ess(logw).mean()) / logw.shape[1]  # [B] per prompt
    Lf = L.double()
    N = logw.numel()
    out = {"H_orig": float(f_orig.mean()), "H_orig_per_token": float(-S_orig.double().sum() / Lf.sum()),
           "SE_H_orig": math.sqrt(est.mean_variance(f_orig.mean(-1))) if f_orig.shape[0] > 1 else math.nan}
    bounds = [im.sequence_rounding(S_orig, L, eps_forward), im.sequence_rounding(S_upd, L, eps_forward)]
    for name, ch in changes.items():
        out[f"deltaH_{name}"] = ch.estimate
        out[f"SE_deltaH_{name}"] = ch.SE
        out[f"H_upd_{name}"] = out["H_orig"] + ch.estimate
        fn = lambda s0, s1, name=name: im.paired_psi(s0, s1, L, Lmax, mode, clip_c,  # noqa: E731
                                                     smoothed.log_weights)[name].mean()
        out[f"rounding_deltaH_{name}"] = est.propagated_bound(fn, [S_orig, S_upd], bounds)
    # per-token entropy (a ratio over all tokens): SNIS weights normalised within each prompt
    wn = torch.softmax(logw, -1)
    out["H_upd_per_token"] = float((wn * -S_upd.double()).sum() / (wn * Lf).sum())
    out["deltaH_per_token"] = out["H_upd_per_token"] - out["H_orig_per_token"]
    w = logw.exp()
    out.update({"ESS_frac": ess_frac, "ESS": ess_frac * (logw.shape[0] if group else N),
                "psis_khat": smoothed.khat, "is/N": N, "is/stratified_by": "group" if group else "prompt",
                "is/w_min": float(w.min()), "is/w_max": float(w.max()),
                "is/logw_std": float(logw.std()) if N > 1 else 0.0,
                "is/mean_importance_ratio": float(w.mean()),
                "is/frac_old_logprobs_valid": float(torch.isfinite(S_orig).double().mean()),
                "is/clip_fraction": float((w > clip_c).double().mean())})
    if smoothed.note:
        out["psis_khat_note"] = smoothed.note
    return out, {k: v.psi for k, v in changes.items()}


def eval_at_current(ctx: ProbeContext, E: RolloutBatch, icfg, with_entropy: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """E's sequence log-probs [B_E, G], token entropies [B_E, G, T] (CPU; None without
    ``with_entropy``) and token log-probs [B_E, G, T] at the parameters as they are now
    (theta_plus after a step), without a graph, in eval mode (the mode is put back). With X in
    per-token form they come from the same formulas as the X pass's (``with_entropy="grad"`` runs
    its function forward only): ``l+ - l`` and ``H+ - H`` then hold the step's change, not the
    last-bit difference between two ways of computing a log-softmax (summed over a response's
    tokens it would be a first-order-sized bias at small lr)."""
    if with_entropy and ctx.x.tokens:
        with_entropy = "grad"
    was_training = ctx.model.training
    with ctx.phase("gt_eval_E"), torch.no_grad():
        ctx.model.eval()
        # The bare module: no DDP buffer broadcast per forward (ranks may hold different
        # numbers of E microbatches).
        bare = getattr(ctx.model, "module", ctx.model)
        outs = []
        try:
            for s, mb in ctx.iterate(E, ctx.nograd_mb(E, False, icfg.importance_microbatch_size), "E at theta+"):
                o = ctx.forward_S(mb, f"E at theta_plus [{s}, {s + mb.B})", with_entropy=with_entropy, model=bare)
                if not is_filler(mb):  # FSDP2: a collective pass only
                    outs.append(o)
        finally:
            ctx.model.train(was_training)
    return (torch.cat([o[0].cpu() for o in outs]), torch.cat([o[2].cpu() for o in outs]) if with_entropy else None,
            torch.cat([o[1].cpu() for o in outs]))


KHAT_MAX = 0.7  # above it the importance weights' mean is unreliable (PSIS's rule of thumb)


def measurability(est_res: dict, ess_threshold: float, khat_max: float = KHAT_MAX) -> str:
    """Why the importance-sampled measurement cannot be trusted ("" when it can): ESS/N below
    ``ess_threshold`` (the weights are degenerate: a few responses carry the estimate) or PSIS's
    k-hat above ``khat_max`` (the weights' tail is too heavy for their mean to converge) where the
    largest weight is more than twice the mean. k-hat is the shape of the tail, blind to its size:
    on a small step every weight is within ~1e-4 of 1 and no tail can carry the estimate, whatever
    shape a fit to 5-20 of them finds (measured: k-hat > 0.7 in 4 of 40 draws of the built-in
    model at lr 1e-5 with ESS/N 0.9999)."""
    ess, khat = est_res.get("ESS_frac", math.nan), est_res.get("psis_khat", math.nan)
    w_max, w_mean = est_res.get("is/w_max", math.nan), est_res.get("is/mean_importance_ratio", math.nan)
    spread = w_max / w_mean if w_mean > 0 else math.inf  # every weight underflowed to 0: degenerate
    why = []
    if not (ess >= ess_threshold):  # NaN counts as degenerate
        why.append(f"ESS/N {ess:.2f} < {ess_threshold:g}")
    if math.isfinite(khat) and khat > khat_max and not spread <= 2.0 and est_res.get("is/weights") != "per_decision":
        why.append(f"k-hat {khat:.2f} > {khat_max:g}")
    return "; ".join(why)


def true_change(est_res: dict, psi: dict, mode: str, ess_threshold: float = 0.0) -> dict:
    """The measured change ``deltaH_true`` (``importance.is_mode``'s estimate of ``importance_estimates``)
    with its SE, Student-t 95% interval (B_E - 1 degrees of freedom), ``H_upd`` and the per-token change.
    Unmeasurable (``measurability``): ``deltaH_true`` and its interval are NaN, ``measurable`` False
    and ``unmeasurable_reason`` says why (each estimator's number stays under ``deltaH_<est>``)."""
    d, se = est_res[f"deltaH_{mode}"], est_res[f"SE_deltaH_{mode}"]
    why = measurability(est_res, ess_threshold)
    if mode == "psis" and est_res.get("psis_khat_note"):
        why = "; ".join(filter(None, [why, est_res["psis_khat_note"]]))
    if why:
        nan = math.nan
        return {"deltaH_true": nan, "SE_deltaH_true": nan, "ci95_true_low": nan, "ci95_true_high": nan,
                "H_upd": nan, "deltaH_true_per_token": est_res["deltaH_per_token"], "measurable": False,
                "unmeasurable_reason": why, "rounding_deltaH_true": nan}
    lo, hi = est.interval(d, se, psi[mode].numel() - 1)
    return {"deltaH_true": d, "SE_deltaH_true": se, "ci95_true_low": lo, "ci95_true_high": hi,
            "H_upd": est_res[f"H_upd_{mode}"], "deltaH_true_per_token": est_res["deltaH_per_token"],
            "measurable": True, "rounding_deltaH_true": est_res.get(f"rounding_deltaH_{mode}", 0.0)}


def resampled_change(f_fresh: torch.Tensor, f_orig: torch.Tensor) -> dict:
    """``deltaH_resample``: the change measured on fresh responses drawn at theta_plus for the same
    prompts, ``mean_n (mean_g f_fresh - mean_g f_orig)`` [B, G] inputs (f = -S_w; a prompt's two
    groups are independent draws, so prompts are the units), with its SE and t interval."""
    d = f_fresh.double().mean(-1) - f_orig.double().mean(-1)
    ch = im.summarize_change(d)
    lo, hi = est.interval(ch.estimate, ch.SE, d.numel() - 1)
    return {"deltaH_resample": ch.estimate, "SE_deltaH_resample": ch.SE, "ci95_resample_low": lo,
            "ci95_resample_high": hi}


def run_ground_truth(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, inp: StepInputs, icfg,
                     resample: Callable[[], RolloutBatch] | None = None,
                     fail_after_step: Callable[[], None] | None = None) -> dict[str, float]:
    """One real step on U, entropy on E re-estimated, everything restored. Returns flat results.

    ``resample`` draws fresh E responses at theta_plus (used when ESS/N < ess_threshold);
    ``fail_after_step`` is called with the model at theta_plus before E is re-evaluated (tests
    inject an exception there, or read theta_plus). The weights, the optimizer state and the
    model's train/eval mode are restored bit-exactly in every case."""
    res: dict[str, float] = {}
    mode = icfg.step_mode.value
    alone = weights_only_snapshot(mode, chunked_step_applies(inp.optimizer, ctx.params, ctx.device, mode))  # on the model's device
    snap_dev = resolve_snapshot_device(icfg.snapshot_device, ctx.device, ctx.params, inp.optimizer, weights_only=alone)
    res["snapshot_device"] = str(snap_dev)
    chunked = chunked_step_applies(inp.optimizer, ctx.params, snap_dev, mode)
    res["gt/chunked_step"] = float(chunked)  # 1: the snapshot holds the weights only
    reuse = icfg.reuse_probe_gradient and icfg.training_loss.value == "rl"
    U_lp = inp.U_token_logp
    was_training = ctx.model.training

    aliased = False

    def grads_from():
        nonlocal U_lp, aliased
        if reuse:  # grad of the objective's loss = -Ybar_raw; aliased unless clipping rescales it in place
            aliased = not icfg.max_grad_norm and _negated_as_grads(ctx, inp.Ybar_raw)
            if not aliased:
                _set_grads(ctx, inp.Ybar_raw, -1.0)
        else:
            U_lp = _recompute_grads(ctx, U, icfg, inp.B_U_global)

    with ctx.phase("gt_snapshot"):
        snap = take(ctx.params, inp.optimizer, snap_dev, live_state=weights_only_snapshot(mode, chunked))
    try:
        with ctx.phase("gt_step"):  # peak memory around the update is recorded for this phase
            try:
                _step(ctx, inp, icfg, grads_from, chunked)
            finally:
                if aliased:  # Ybar_raw back to its sign, whatever happened in the step
                    _unnegate(ctx, inp.Ybar_raw)
            res["deltaH1_step"] = -xbar_dot_step(inp.Xbar, ctx.params, snap.params)
            res["rounding_step"] = step_rounding_bound(inp.Xbar, ctx.params, snap.params)
        res["gt/reused_probe_gradient"] = float(reuse and icfg.step_mode.value == "optimizer")
        if fail_after_step is not None:
            fail_after_step()
        S_upd, ent_upd, lp_upd = eval_at_current(ctx, E, icfg)
        S_orig_g, S_upd_g = D.gather_units(inp.S_orig), D.gather_units(S_upd)
        L_g, Lmax_g = D.gather_units(E.gen_lengths), D.gather_units(E.Lmax)
        tokens = token_side(ctx.x, E, inp.E_token_logp, lp_upd, inp.token_entropy_orig, ent_upd)
        est_res, psi = importance_estimates(S_orig_g, S_upd_g, L_g, Lmax_g, ctx.weighting_mode, icfg.clip_c,
                                            warn_psis=icfg.is_mode.value == "psis", x=ctx.x, tokens=tokens,
                                            eps_forward=forward_eps(ctx))
        res.update(est_res)
        res["forward_dtype"] = str(forward_dtype(ctx)).removeprefix("torch.")
        if resample is not None and icfg.resample_on_low_ess and est_res["ESS_frac"] < icfg.ess_threshold:
            with ctx.phase("gt_resample"):
                fresh = resample()  # at theta_plus: the restore has not happened yet
            if ctx.x.measures_tokens:  # the functional from the token entropies (the sampler's, for the fresh ones)
                rs = resampled_token_change(ctx.x.mode, D.gather_units(fresh.sampler_entropy),
                                            D.gather_units(fresh.response_mask), D.gather_units(inp.token_entropy_orig),
                                            D.gather_units(E.response_mask))
            else:
                f_of = lambda b, S: -est.weighted_S(D.gather_units(S), D.gather_units(b.gen_lengths),  # noqa: E731
                                                    D.gather_units(b.Lmax), ctx.weighting_mode)
                rs = resampled_change(f_of(fresh, fresh.S_sampler), f_of(E, inp.S_orig))
            res.update(rs)
            res["H_upd_resample"] = est_res["H_orig"] + rs["deltaH_resample"]
        res.update(true_change(est_res, psi, icfg.is_mode.value, icfg.ess_threshold))
        res["gt/psi"] = psi[icfg.is_mode.value]  # [B_E] per-prompt contributions (popped by the caller)
        res["gt/log_weights"] = (S_upd_g - S_orig_g).double()  # [B_E, G] log w (popped by the caller)
        # Token-level entropy over the vocabulary on E's generated positions (as verl / TRL log it).
        m = E.response_mask.bool()
        if inp.token_entropy_orig is not None:
            t0, t1, n = D.reduce_scalars(float(inp.token_entropy_orig[m].sum()), float(ent_upd[m].sum()),
                                         float(m.sum()))
            res.update({"token_entropy_orig": t0 / n, "token_entropy_upd": t1 / n,
                        "deltaH_token_entropy": (t1 - t0) / n})
        # Observability of the update step: teacher-forced token log-probs at theta vs the
        # sampler's, summed over ranks.
        T = U.sampler_logprobs.shape[-1]
        new_lp = U_lp.reshape(-1, T) if U_lp is not None else U.sampler_logprobs.reshape(-1, T)
        sums = im.token_ratio_sums(new_lp, U.sampler_logprobs.reshape(-1, T), U.response_mask.reshape(-1, T),
                                    icfg.update_clip_eps, icfg.update_clip_eps_high)
        sums = im.TokenRatioSums(*D.reduce_scalars(*sums))
        res.update({f"update/{k}": v for k, v in im.token_ratio_stats_from_sums(sums).items()})
        if icfg.split_step and icfg.step_mode.value == "optimizer":
            with ctx.phase("gt_split"):
                res.update(split_step(ctx, inp.optimizer, inp.Xbar, snap, res["deltaH1_step"]))
    finally:
        with ctx.phase("gt_restore"):
            restore(ctx.params, inp.optimizer, snap)
            ctx.model.train(was_training)
    return res
