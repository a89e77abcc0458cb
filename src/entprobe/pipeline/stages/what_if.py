"""What-if predictions (``probe.what_if``, docs/what_if.md): the predicted entropy change of the next
step under other settings of the knobs users turn, each optionally measured by its own real step.

From the probe's passes plus the least extra work:
- ``lr_factors``: no pass (the update is linear in lr for the closed-form step models: the
  prediction and its SE scale by f, ``math/what_if.py``); other optimizers: their own step at lr x f.
- ``target_deltaH``: no pass (``lr* = lr target / deltaH_pred`` with its interval).
- ``entropy_coef`` beta: one backward over U for ``grad H_bonus(U)`` (the objective's aggregation of
  the per-position full-vocabulary entropy, through the logits, as verl's ``entropy_coeff``); the
  loss ``L - beta H_bonus`` has gradient ``-(Ybar + beta grad H_bonus)``, and that gradient goes
  through the optimizer's update (not linearised in beta).
- ``clip_cov``: the U gradient without the selected tokens' terms: one backward over the prompts
  holding a selected token only, through the update.
- ``top_entropy_quantile`` (TRL): one no-graph pass over U for the token entropies and one backward
  over U for the gradient of the tokens it drops, through the update.
- ``kl_cov``: no pass: at the first step from on-policy samples its penalty has zero gradient,
  so its step is the plain one (reported as such, with a note).
The E side of each setting's SE: one per-prompt pass over E projecting X onto every new update at
once (``probe.variance_enabled``; without it the settings have no SE). ``measure``: each setting's
real step through Stage 3 (snapshot, step, re-weighted E, bit-exact restore), paired with its
prediction on the same E responses.
"""
from __future__ import annotations

import contextlib
import math

import torch

from entprobe.config import ConfigError
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.math import what_if as wi
from entprobe.rollouts.logprobs import autocast_ctx, position_ids_from_mask
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.runtime import distributed as D
from entprobe.runtime.distributed import no_sync
from entprobe.pipeline.stages.accumulate import global_mean
from entprobe.pipeline.stages.context import ProbeContext, is_filler
from entprobe.pipeline.stages.ground_truth import StepInputs, run_ground_truth
from entprobe.pipeline.stages.prediction import LINEAR_IN_LR, build_step_model, step_model_kind
from entprobe.pipeline.stages.paired import compare_with_prediction
from entprobe.pipeline.stages.variance import project_backward

KL_COV_NOTE = ("equal to the plain step: at the first step from on-policy samples logp == old_logp, where "
               "KL-Cov's penalty |logp - old_logp| has zero (sub)gradient")


@contextlib.contextmanager
def scaled_lrs(optimizer: torch.optim.Optimizer, f: float):
    """Inside the block every param group's lr is multiplied by f; put back after (exactly: the
    saved values are restored, not divided)."""
    saved = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * f
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr


def token_entropy_with_grad(ctx: ProbeContext, mb: RolloutBatch) -> torch.Tensor:
    """Per-position entropy ``-sum_v p log p`` of ``softmax(logits / temperature)`` at each
    generated position of ``mb`` [b, G, T] (0 elsewhere), differentiable through the logits (the
    probe's log-probs keep no graph for it: rollouts/logprobs.py)."""
    ids, att, resp = mb.flat(ctx.device)
    first = int(resp.bool().any(0).nonzero()[0])
    with autocast_ctx(ids.device, ctx.autocast_dtype):
        out = ctx.model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att),
                        use_cache=False, logits_to_keep=ids.shape[-1] - first + 1)
    logits = out.logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / ctx.temperature
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    ent = torch.where(resp[:, first:].bool(), ent, 0.0)
    full = torch.cat([ent.new_zeros((ids.shape[0], first)), ent], 1)
    return full.view(mb.B, mb.G, -1)


def _grad_sum(ctx: ProbeContext, batch: RolloutBatch, loss_of, label: str, keep=lambda mb: True) -> pv.Buffer:
    """``sum`` over ``batch``'s microbatches (those ``keep`` accepts) of the gradient of
    ``loss_of(mb)``, in the probe's buffers; the global mean over units is the caller's. Under
    FSDP2 a filler microbatch (runtime/sharding.py) runs its collective pass with its loss times 0."""
    ctx.zero_grad()
    for _, mb in ctx.iterate(batch, ctx.mb_size, label):
        filler = is_filler(mb)
        if not filler and not keep(mb):
            continue
        with torch.enable_grad(), no_sync(ctx.model):
            loss = loss_of(mb)
            (loss * 0.0 if filler else loss).backward()
        ctx.stats.count("backward", 0 if filler else mb.B * mb.G)
    buf = pv.zeros(ctx.params, ctx.buffers_device, ctx.buffers_dtype)
    pv.add_grads_(buf, ctx.params)
    ctx.zero_grad()
    return buf


def token_entropies(ctx: ProbeContext, U: RolloutBatch) -> torch.Tensor:
    """U's per-position entropies [B_U, G, T] at theta (CPU, no graph), this rank's prompts."""
    with torch.no_grad():
        return torch.cat([token_entropy_with_grad(ctx, mb).cpu() for _, mb in ctx.iterate(U, ctx.mb_size, "U entropy")
                          if not is_filler(mb)])


def entropy_bonus_gradient(ctx: ProbeContext, U: RolloutBatch) -> tuple[pv.Buffer, float]:
    """``grad H_bonus(U)`` and ``H_bonus``: the objective's aggregation of U's per-position entropy
    (``Objective.token_weights``: token-mean for verl's default), one backward over U."""
    vals = []

    def loss_of(mb):
        u = ctx.objective.token_weights(mb.gen_lengths, mb.Lmax).to(ctx.device)
        ent = token_entropy_with_grad(ctx, mb)
        h = (u.to(ent.dtype) * ent.sum(-1)).sum()
        if not is_filler(mb):
            vals.append(float(h.detach()))
        return h

    buf = _grad_sum(ctx, U, loss_of, "what-if entropy bonus over U")
    grad, B = global_mean(buf, U.B)
    return grad, D.reduce_scalars(sum(vals))[0] / B


def masked_tokens_gradient(ctx: ProbeContext, U: RolloutBatch, selected: torch.Tensor) -> pv.Buffer:
    """``mean_n sum_{g,t selected} w[n,g] grad log pi(t)``: the part of Ybar carried by the
    ``selected`` [B_U, G, T] tokens (w the objective's per-unit weights), from one backward over
    the prompts that hold a selected token."""
    sel = selected.bool()
    rows: dict[int, torch.Tensor] = {}
    pos = [0]

    def loss_of(mb):
        s = rows[id(mb)]
        S, lp, _ = ctx.forward_S(mb, "what-if Clip-Cov tokens")
        w = ctx.y_weights(mb, lp.device).to(lp.dtype)
        return (w * (lp * s.to(lp.device, lp.dtype)).sum(-1)).sum()

    def keep_sel(mb):
        s = sel[pos[0]:pos[0] + mb.B]
        pos[0] += mb.B
        rows[id(mb)] = s
        return bool(s.any())

    buf = _grad_sum(ctx, U, loss_of, "what-if Clip-Cov over U", keep=keep_sel)
    return global_mean(buf, U.B)[0]


def _whole_update(ctx: ProbeContext, optimizer, lr: float, Ybar: pv.Buffer, P, icfg, f: float = 1.0):
    """A filler ``out = Delta theta`` (all parts summed) of the optimizer's update of gradient
    ``-Ybar`` at lr x f, for ``prediction.directions``-style direction sets."""
    def fill(out: pv.Buffer) -> None:
        with scaled_lrs(optimizer, f):
            step = build_step_model(ctx, optimizer, lr * f, Ybar, P, icfg.step_mode.value, icfg.max_grad_norm)
            parts = {k: [torch.zeros_like(o) for o in out] for k in step.names}
            step.write(parts)
        for i, o in enumerate(out):
            o.copy_(sum(parts[k][i] for k in step.names))
    return fill


def _without(ctx: ProbeContext, U: RolloutBatch, Ybar: pv.Buffer, drop: torch.Tensor) -> pv.Buffer:
    """Ybar without the policy-gradient terms of the ``drop`` [B_U, G, T] tokens (Ybar itself when
    none is dropped)."""
    if not drop.any():
        return Ybar
    part = masked_tokens_gradient(ctx, U, drop)
    return [y - p.to(y.device, y.dtype) for y, p in zip(Ybar, part)]


def _settings(ctx: ProbeContext, U: RolloutBatch, U_token_logp: torch.Tensor, Ybar: pv.Buffer, wcfg,
              linear: bool) -> tuple[list, dict]:
    """The settings that need a new update: ``[(key, Ybar_s, lr factor, facts)]``, and the facts
    of the KL-Cov selections (no new update)."""
    new, kl = [], {}
    if not linear:
        new += [(wi.setting_key("lr", f), Ybar, f, {"setting": "lr", "lr_factor": f}) for f in wcfg.lr_factors]
    if wcfg.entropy_coef:
        with ctx.phase("what_if_entropy_bonus"):
            gH, H_bonus = entropy_bonus_gradient(ctx, U)
        for beta in wcfg.entropy_coef:
            Y = [y + beta * g.to(y.device, y.dtype) for y, g in zip(Ybar, gH)]
            new.append((wi.setting_key("entropy_coef", beta), Y, 1.0,
                        {"setting": "entropy_coef", "entropy_coef": beta, "H_bonus": H_bonus}))
    if (wcfg.clip_cov or wcfg.kl_cov or wcfg.top_entropy_quantile) and D.world() > 1:
        raise ConfigError("probe.what_if.clip_cov/kl_cov/top_entropy_quantile: the token selection runs on one "
                          "process; run the what-if without torchrun (or drop those settings)")
    mask = U.response_mask.bool()
    if wcfg.top_entropy_quantile:
        with ctx.phase("what_if_top_entropy"):
            ent = token_entropies(ctx, U)
    for q in wcfg.top_entropy_quantile:
        drop = mask & ~wi.high_entropy_mask(ent, mask, q)
        with ctx.phase("what_if_top_entropy"):
            Y = _without(ctx, U, Ybar, drop)
        new.append((wi.setting_key("top_entropy_quantile", q), Y, 1.0,
                    {"setting": "top_entropy_quantile", "top_entropy_quantile": q,
                     "masked_tokens": int(drop.sum()), "tokens": int(mask.sum())}))
    if wcfg.clip_cov or wcfg.kl_cov:
        A = U.advantages.double().unsqueeze(-1).expand_as(U_token_logp)
        for r in wcfg.clip_cov:
            gen = torch.Generator().manual_seed(int(wcfg.seed))
            sel = wi.clip_cov_selection(U_token_logp, A, mask, r, wcfg.clip_cov_lb, wcfg.clip_cov_ub, gen)
            with ctx.phase("what_if_clip_cov"):
                Y = _without(ctx, U, Ybar, sel)
            new.append((wi.setting_key("clip_cov", r), Y, 1.0,
                        {"setting": "clip_cov", "clip_cov": r, "masked_tokens": int(sel.sum()),
                         "tokens": int(mask.sum()), "seed": int(wcfg.seed)}))
        for r in wcfg.kl_cov:
            sel = wi.kl_cov_selection(U_token_logp, A, mask, r)
            kl[wi.setting_key("kl_cov", r)] = {"setting": "kl_cov", "kl_cov": r, "ppo_kl_coef": wcfg.ppo_kl_coef,
                                               "penalised_tokens": int(sel.sum()), "tokens": int(mask.sum()),
                                               "note": KL_COV_NOTE}
    return new, kl


def run_what_if(ctx: ProbeContext, E: RolloutBatch, U: RolloutBatch, st, geo, pcfg, icfg, base: dict,
                ) -> dict:
    """``{"what_if": {key: {...}}}``: every ``probe.what_if`` setting's ``deltaH_pred``, ``SE``,
    ``ci95_low/high`` and what it is (and, with ``measure``, the measured change and its paired
    difference with the prediction). ``st``: Stages 1-2 (Xbar, Ybar, U's token log-probs, E's
    log-probs and entropies); ``base``: the plain prediction's results."""
    wcfg = pcfg.what_if
    kind = step_model_kind(geo.optimizer, icfg.step_mode.value)
    linear = kind in LINEAR_IN_LR
    nan = math.nan
    plain = {"deltaH_pred": base["deltaH_pred"], "SE": base.get("SE_deltaH_pred", nan),
             "ci95_low": base.get("ci95_pred_low", nan), "ci95_high": base.get("ci95_pred_high", nan),
             "df": base.get("gt/B_E", st.B_E) - 1}
    out: dict = {}
    if linear:
        for f in wcfg.lr_factors:
            out[wi.setting_key("lr", f)] = {"setting": "lr", "lr_factor": f, "lr": st.lr * f,
                                            **wi.lr_scaled(plain, f), "how": "scaled (linear in lr)"}
            if "SE_deltaH_pred_expected" in base:  # the expected step's SE (U side too) scales by f as well
                out[wi.setting_key("lr", f)]["SE_expected"] = base["SE_deltaH_pred_expected"] * f
    new, kl = _settings(ctx, U, st.U_token_logp, st.Ybar, wcfg, linear)
    e_new = None
    if new:
        fills = [_whole_update(ctx, geo.optimizer, st.lr, Y, geo.P, icfg, f) for _, Y, f, _ in new]
        dt = torch.promote_types(ctx.buffers_dtype, torch.float32)
        dset = pv.empty_directions(len(fills), ctx.params, ctx.buffers_device, dt)
        for j, fill in enumerate(fills):
            fill(dset.column(j))
        dots = pv.dot_set(st.Xbar, dset).tolist()
        if pcfg.variance_enabled:
            with ctx.phase("what_if_project_E"):
                e_new = -D.gather_units(project_backward(ctx, E, dset, "X", "what-if a_u over E")).double()
        del dset
        for j, (key, _, f, facts) in enumerate(new):
            pred = -dots[j]
            res = wi.summary(e_new[:, j]) if e_new is not None else {"SE": nan, "ci95_low": nan, "ci95_high": nan}
            if e_new is not None:  # the value is the dot (as the headline's); the interval around it
                res["ci95_low"], res["ci95_high"] = est.interval(pred, res["SE"], res["df"])
            out[key] = {**facts, "lr": st.lr * f, **res, "deltaH_pred": pred, "how": "recomputed update"}
    for key, facts in kl.items():
        out[key] = {**facts, "lr": st.lr, **plain, "how": "the plain step"}
    if wcfg.target_deltaH is not None:
        out["lr_for_target"] = {"setting": "lr_for_target", **wi.lr_for_target(
            st.lr, plain["deltaH_pred"], plain["SE"], plain["ci95_low"], plain["ci95_high"], wcfg.target_deltaH)}
    if wcfg.measure:
        e_of = {key: e_new[:, j] for j, (key, *_) in enumerate(new)} if e_new is not None else {}
        for key, Y, f, _ in new:
            out[key].update(_measure(ctx, E, U, st, geo, icfg, Y, f, e_of.get(key), out[key]["deltaH_pred"]))
        for key, r in out.items():
            if r.get("setting") == "lr" and r.get("how", "").startswith("scaled"):
                e_f = base_e_scaled(st, r["lr_factor"])
                r.update(_measure(ctx, E, U, st, geo, icfg, st.Ybar, r["lr_factor"], e_f, r["deltaH_pred"]))
    return {"what_if": out}


def base_e_scaled(st, f: float) -> torch.Tensor | None:
    """The plain prediction's per-prompt contributions ``e_n = -X_n . Delta theta`` (all parts)
    times f: those of the step at lr x f (None without the variance pass)."""
    if st.a is None:
        return None
    return -st.a[:, 1:].double().sum(1) * f


def _measure(ctx, E, U, st, geo, icfg, Y: pv.Buffer, f: float, e: torch.Tensor | None, pred: float) -> dict:
    """The real step with gradient ``-Y`` at lr x f, measured on E (Stage 3, everything restored
    bit-exactly), and its paired difference with the prediction ``pred`` (per-prompt ``e``)."""
    inp = StepInputs(geo.optimizer, st.lr * f, st.Xbar, Y, geo.P, st.B_U, st.S_E, st.U_token_logp, st.E_entropy,
                     st.E_token_logp)
    with scaled_lrs(geo.optimizer, f), ctx.phase("what_if_measure"):
        gt = run_ground_truth(ctx, E, U, inp, icfg)
    psi = gt.pop("gt/psi")
    gt.pop("gt/log_weights")
    keep = {k: gt[k] for k in ("deltaH_true", "SE_deltaH_true", "ci95_true_low", "ci95_true_high", "measurable",
                               "unmeasurable_reason", "ESS_frac") if k in gt}
    cmp = compare_with_prediction({**gt, "deltaH_pred": pred}, psi, None if e is None else e.unsqueeze(1))
    return {**keep, **cmp}
