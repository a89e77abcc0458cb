"""The prediction of the step's entropy change from the step's own batch (``source="rollouts"``): the
passes (stages/rollout_passes.py), the check that the objective reproduces the trainer's gradient,
the cross-prompt U-statistic by part of the update (math/rollout_ustat.py), and H at theta with its
per-prompt influence.

What each number estimates (docs/rollouts.md):
- ``deltaH_pred`` (``-(1/B) sum_n X_n . Delta theta(y_{-n})``): the change of the population's entropy
  functional (over the task's prompts, not the batch's) by the step the optimizer takes, to first order;
- ``SE_deltaH_pred`` / ``ci95_pred_*``: of that change for the step taken (its gradient fixed: the X
  side), Student-t with B - 1 degrees of freedom;
- ``SE_deltaH_pred_expected`` / ``ci95_pred_expected_*``: of the expected step's change (a fresh batch's
  step: both sides, the U-statistic's jackknife);
- ``deltaH_pred_<part>``: gradient, momentum, weight decay (the cross-prompt correction is the
  gradient part's: the other parts do not depend on the batch's Y);
- ``deltaH_pred_plain``: ``-Xbar . Delta theta``, biased by each prompt's own X_n . Y_n;
- ``H_orig`` +- ``SE_H_orig``: the functional at theta on the batch (token_mean: TRL's ``entropy``).

A step whose gradient is exactly 0 (every group tied: all advantages 0) takes no Y backward
(rollout_passes.py); ``gradient_zero`` says so. When the update is exactly 0 as well (nothing carried:
AdamW's first step or SGD without momentum, and no weight decay), nothing moves: ``update_zero``,
every prediction 0 with SE 0, and no pass at all (``still_prediction``: H from the sampler's records).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from entprobe.config import ConfigError, EntprobeConfig
from entprobe.math import estimators as est
from entprobe.math import paramvec as pv
from entprobe.math import rollout_subset as rs
from entprobe.math import token_functionals as tf
from entprobe.math.adamw import StepModel
from entprobe.math.forecast import ForecastInputs
from entprobe.math.rollout_ustat import (CrossPrompt, KernelTerms, clip_coefficient, clip_projection, cross_prompt,
                                         kernel_terms, pair_variance, standard_errors, unit_mean_rows, zero_terms)
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.pipeline.stages import rollout_bonus as rb
from entprobe.pipeline.stages.rollout_passes import rollout_passes
from entprobe.pipeline.stages.zero_update import update_is_zero
from entprobe.pipeline.stages.x_spec import XSpec
from entprobe.rollouts import objectives as ob
from entprobe.rollouts.sampling import RolloutBatch

# |y - c Ybar| / |y| above this: the objective's gradient is not the one in .grad (another loss, or
# a different normalisation); rounding of a fp32 or bf16 backward is far below it
GRADIENT_MISMATCH = 0.05


@dataclass
class RolloutPrediction:
    res: dict
    parts: dict[str, CrossPrompt]  # the U-statistic by part of the update (sum: the whole)
    kt: KernelTerms  # the gradient part's kernel terms (b: the Y side of a fresh step)
    h_units: torch.Tensor  # [B] per-prompt linearised values of H (mean: H_orig)
    B: int
    Xbar: pv.Buffer | None  # the batch's mean X (model device); None: an update exactly 0 (still_prediction)
    forecast: ForecastInputs | None = None  # set by the caller (forecast_inputs)
    H_max: tuple[float, float] = (math.inf, math.inf)  # the population's and the logged H's largest value (entropy_range)


def functional_units(x: XSpec, S: torch.Tensor, ent: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    """Per prompt [B] values f_n whose mean is the functional's estimate at theta
    (``x_spec.functional_value``) and whose spread is its influence: ``token_mean`` (a ratio
    ``Nbar / Dbar`` of the per-prompt token-entropy sums and lengths): ``H + (N_n - H D_n) / Dbar``;
    the other token functionals: each prompt's mean of ``functional_values``; the score forms:
    ``-mean_g S_w``."""
    m = m.double()
    if x.mode in tf.TOKEN_MODES or (x.tokens and ent is not None):
        if x.mode == "token_mean":
            N = (ent.double() * m).sum(-1).mean(-1)
            Dn = m.sum(-1).mean(-1)
            H = N.mean() / Dn.mean()
            return H + (N - H * Dn) / Dn.mean()
        return tf.functional_values(ent, m, x.mode).mean(-1)
    L = m.sum(-1)
    return -est.weighted_S(S.double(), L, L.amax(-1), x.mode).mean(-1)


def clip_of(y_norm: float, max_grad_norm: float | None, grad_norm: float | None) -> float:
    """The clip coefficient ``c`` of the step (``y = c Ybar``): 1 without clipping; from the norm before
    clipping (``grad_norm``: what ``clip_grad_norm_`` returns) when given; 1 when ``|y|`` is clearly
    below ``max_grad_norm`` (a clipped gradient has that norm to 1e-6); else unknown: a ConfigError."""
    if not max_grad_norm:
        return 1.0
    if grad_norm is not None:
        if not (math.isfinite(grad_norm) and grad_norm >= 0):
            raise ConfigError(f"grad_norm={grad_norm!r}: the gradient's norm before clipping, a finite number >= 0")
        return clip_coefficient(float(grad_norm), max_grad_norm)
    if y_norm < max_grad_norm * (1 - 1e-4):
        return 1.0
    raise ConfigError(f"source=rollouts: the gradient's norm {y_norm:.6g} is at max_grad_norm={max_grad_norm:g}: it "
                      "was clipped, and the prediction needs the norm before clipping: pass grad_norm=<what "
                      "torch.nn.utils.clip_grad_norm_ returned> to before_step")


def predict_on_rollouts(ctx: ProbeContext, batch: RolloutBatch, step: StepModel, step_at, y: pv.Buffer,
                        max_grad_norm: float | None, grad_norm: float | None, budget_mb: float,
                        bonus: ob.EntropyBonus | None = None, bonus_effect: bool = False,
                        subset: list[int] | None = None, given: dict | None = None) -> RolloutPrediction:
    """The cross-prompt prediction of the step about to be taken on ``batch`` (module docstring):
    ``y`` is minus the gradient in ``.grad`` (after any clipping: ``max_grad_norm``, the trainer's,
    and ``grad_norm``, the norm before it), ``ctx.objective`` the trainer's loss bound to the batch
    (its Y_n), ``step_at(y')`` the update's model at another gradient input; ``bonus``: TRL's entropy
    bonus in that loss, ``bonus_effect``: also its effect per unit coefficient (``bonus_effect`` +-
    ``SE_bonus_effect``, stages/rollout_bonus.py); ``subset``: probe only these of the batch's prompts
    (math/rollout_subset.py; their X_n and Y_n, the update from all), the objective then not checked
    against ``.grad``; ``given``: the per-prompt passes made already (``rollout_passes``'s)."""
    y_norm = pv.norm(y)
    c = clip_of(y_norm, max_grad_norm, grad_norm)
    # every group tied (y exactly 0), nothing carried (momentum part 0) and no decay: nothing moves
    if y_norm == 0.0 and "weight_decay" not in step.names and (
            step.carries_nothing() if step.carries_nothing is not None else update_is_zero(ctx, step, y)):
        return still_prediction(ctx, batch, step)
    if subset is not None and len(subset) >= batch.B:
        subset = None
    rp = rollout_passes(ctx, batch, step, step_at, y, c, max_grad_norm, budget_mb, bonus, bonus_effect, subset, given)
    residual = rp.residual / rp.y_norm if rp.y_norm > 0 else (0.0 if rp.ybar_norm == 0 else math.inf)
    if subset is None and not residual <= GRADIENT_MISMATCH:
        scale = rp.ybar_dot_y / rp.ybar_norm ** 2 if rp.ybar_norm > 0 else math.nan
        hint = (f"; it is the objective's times {scale:.3g}: was it clipped (pass max_grad_norm and grad_norm) or "
                "scaled?" if math.isfinite(scale) and abs(scale * rp.ybar_norm - rp.y_norm) <= GRADIENT_MISMATCH * rp.y_norm
                else "")
        raise ConfigError(f"source=rollouts: the gradient in .grad is not the objective {ctx.objective.name}'s on the "
                          f"batch given (relative difference {residual:.3g}{hint}): the prediction needs each prompt's "
                          "part of the loss; set the objective to the trainer's loss (objective.preset / loss_type), "
                          "give the batch the step was computed on, with its advantages")
    d = rp.dots
    coupling = ctx.objective.coupling
    if subset is not None and coupling is not None:
        coupling = coupling[subset]
    rho = clip_projection(rp.ybar_norm, max_grad_norm)
    kt = kernel_terms(d, rp.y_norm, c, rho, coupling)
    names = step.names
    B = batch.B
    if subset is None:
        cp = cross_prompt
    else:
        cp = lambda e_loo, e, terms: rs.subset_cross_prompt(e_loo, terms, B)  # noqa: E731
    parts = {}
    for j, name in enumerate(names):  # the linearised Y-dependence is the gradient part's
        parts[name] = cp(d.e_loo[:, j], d.e[:, j], kt if name == "gradient" else zero_terms(d.e[:, j]))
    whole = cp(d.e_loo.sum(1), d.e.sum(1), kt)
    pv_ = pair_variance(d, rp.y_norm, c, rho, coupling)
    se = standard_errors(whole, pv_) if subset is None else rs.subset_errors(whole, kt, B, pv_)
    k = B if subset is None else len(subset)
    res = {"source": "rollouts", "deltaH_pred": whole.U, "pred/step_model": step.kind,
           "deltaH_pred_plain": -sum(rp.step_dots), "rollouts/B": B, "rollouts/G": batch.G,
           "rollouts/clip_coef": c, "rollouts/grad_residual": residual if subset is None else None,
           "rollouts/probed": k, "rollouts/kept_y": rp.kept_y,
           "rollouts/pair_term": d.pairs is not None,
           "SE_deltaH_pred": se["SE_step"], "SE_deltaH_pred_expected": se["SE_expected"],
           "SE_deltaH_pred_plugin": se["SE_plugin"], "B_E": k, "G": batch.G}
    res["ci95_pred_low"], res["ci95_pred_high"] = est.interval(whole.U, se["SE_step"], k - 1)
    res["ci95_pred_expected_low"], res["ci95_pred_expected_high"] = est.interval(whole.U, se["SE_expected"], k - 1)
    if len(names) > 1:
        res.update({f"deltaH_pred_{k}": p.U for k, p in parts.items()})
    if rp.bonus_units is not None:  # the bonus's effect per unit coefficient, at the scheduler's lr
        res["bonus_effect"], res["SE_bonus_effect"] = rb.bonus_effect(rp.bonus_units)
    if y_norm == 0.0:  # no Y backward was taken (rollout_passes): what moved is the momentum and the decay
        res.update({"gradient_zero": True, "update_zero": False})
    mask = batch.response_mask if subset is None else batch.response_mask[subset]
    h = functional_units(ctx.x, rp.S, rp.entropy, mask)
    res["H_orig"], res["SE_H_orig"] = float(h.mean()), math.sqrt(est.mean_variance(h))
    return RolloutPrediction(res, parts, kt, h, k, rp.Xbar)


def still_prediction(ctx: ProbeContext, batch: RolloutBatch, step: StepModel) -> RolloutPrediction:
    """The prediction of an update that is exactly 0 (gradient 0, nothing carried, no decay):
    ``theta_plus = theta``, so the change is 0 exactly for any X, with SE 0 (each part too), and no
    pass is needed. H at theta (``H_orig``, the forecast's start) from the sampler's records
    (``sampler_entropy`` and ``sampler_logprobs``, which entprobe's sampler keeps), else from one
    forward without a graph per prompt. ``Xbar`` is None: the check of the step taken compares the
    parameters themselves (integrations/online_checks.py)."""
    if batch.sampler_entropy is not None:
        S, ent = batch.S_sampler, batch.sampler_entropy
    else:
        with ctx.phase("rollouts_units"), torch.no_grad():
            fwd = [ctx.forward_S(batch.select(n), f"source=rollouts, prompt {n}", with_entropy=ctx.x.entropy)
                   for n in range(batch.B)]
        S = torch.cat([f.S.detach().cpu() for f in fwd])
        ent = torch.cat([f.ent.detach().cpu() for f in fwd]) if fwd[0].ent is not None else None
    zero = torch.zeros(batch.B, dtype=torch.float64)
    cp = CrossPrompt(0.0, zero, zero)
    parts = {name: cp for name in step.names}
    res = {"source": "rollouts", "deltaH_pred": 0.0, "pred/step_model": step.kind, "deltaH_pred_plain": 0.0,
           "rollouts/B": batch.B, "rollouts/G": batch.G, "rollouts/clip_coef": 1.0, "rollouts/grad_residual": 0.0,
           "SE_deltaH_pred": 0.0, "SE_deltaH_pred_expected": 0.0, "SE_deltaH_pred_plugin": 0.0, "B_E": batch.B,
           "G": batch.G, "ci95_pred_low": 0.0, "ci95_pred_high": 0.0, "ci95_pred_expected_low": 0.0,
           "ci95_pred_expected_high": 0.0, "gradient_zero": True, "update_zero": True}
    if len(step.names) > 1:
        res.update({f"deltaH_pred_{k}": 0.0 for k in step.names})
    h = functional_units(ctx.x, S, ent, batch.response_mask)
    res["H_orig"], res["SE_H_orig"] = float(h.mean()), math.sqrt(est.mean_variance(h))
    return RolloutPrediction(res, parts, zero_terms(zero), h, batch.B, None)


def rollouts_prediction(ctx: ProbeContext, cfg: EntprobeConfig, batch: RolloutBatch, step: StepModel, step_at,
                        y: pv.Buffer, max_grad_norm: float | None, grad_norm: float | None,
                        entropy_coef: float = 0.0, bonus_effect: bool = False,
                        subset: list[int] | None = None, given: dict | None = None) -> RolloutPrediction:
    """``predict_on_rollouts`` with the objective of ``cfg.objective`` bound to ``batch`` (its
    advantages as given: the trainer's), checked to be a batch the probe can read; ``entropy_coef``:
    the coefficient of TRL's entropy bonus in the loss the gradient came from (0: none); ``subset``: the
    prompts probed (``probe_subset``; None: all); ``given``: the per-prompt passes made already, by prompt
    (integrations/trl_fused.py: the trainer's gradient is their Y sum)."""
    if batch.temperature != cfg.sampling.temperature:
        raise ConfigError(f"source=rollouts: the batch was sampled at temperature {batch.temperature}, the probe's "
                          f"log-probs use sampling.temperature={cfg.sampling.temperature}: make them agree")
    if not bool(torch.isfinite(batch.advantages).all()):
        raise ValueError("source=rollouts: the batch's advantages hold NaN/Inf")
    ctx.objective = ob.bind(cfg.objective, batch.rewards, batch.gen_lengths, cfg.sampling.max_new_tokens)
    bonus = ob.entropy_bonus(entropy_coef, batch.response_mask)
    if bonus is not None:
        batch_std = getattr(cfg.objective.preset, "value", cfg.objective.preset) == "trl" and \
            ob.scale_rewards_choice(cfg.objective.scale_rewards) == "batch"
        rb.check_bonus(ctx.objective, batch_std)
    ro = predict_on_rollouts(ctx, batch, step, step_at, y, max_grad_norm, grad_norm, cfg.probe.unit_grads_budget_mb,
                             bonus, bonus_effect, subset, given)
    if given is not None:
        ro.res["rollouts/fused_backward"] = True
    if bonus is not None:
        ro.res["entropy_coef"] = bonus.coef
    if ctx.x.mode == "token_mean" and ctx.x.kappa is not None:
        ro.res["rollouts/kappa"] = float(ctx.x.kappa)  # token_mean's sum H / sum L over the batch
    ro.H_max = entropy_range(ctx.x, logit_count(ctx.model), cfg.sampling.max_new_tokens)
    return ro


def probe_subset(k: int | None, B: int, seed: int, step: int, checked: bool) -> list[int] | None:
    """The prompts of a B-prompt step that ``probe.rollouts_prompts = k`` probes: None (all) when k is
    None or >= B, or before the objective has been checked against the trainer's gradient on a whole
    batch (``checked``: the first probe takes all B); else k drawn at random, the draw seeded by
    ``seed`` and the step (``rollout_subset.draw_subset``), never by the batch."""
    if k is None or k >= B or not checked:
        return None
    return rs.draw_subset(B, k, seed * 1_000_003 + step)


def logit_count(model: torch.nn.Module) -> int | None:
    """V, the number of logits the model's softmax is over (its output embeddings' rows, else
    ``config.vocab_size``; None when unknown): every token entropy is at most ``ln V``."""
    model = getattr(model, "module", model)  # DDP
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(getattr(out, "out_features", None) or weight.shape[0])
    conf = getattr(model, "config", None)
    conf = getattr(conf, "get_text_config", lambda: conf)() if conf is not None else None
    V = getattr(conf, "vocab_size", None)  # (context.model_dims reads it too, but only beside hidden_size)
    return int(V) if V else None


def entropy_range(x: XSpec, V: int | None, max_new_tokens: int | None) -> tuple[float, float]:
    """``(H_max, H_logged_max)``: the largest value of the probe's entropy functional (``ln V`` per
    token for the per-token functionals; ``max_new_tokens ln V`` per response for ``sequence``) and
    of its logged batch value (the same when that is made of token entropies, as ``functional_units``
    makes it; else inf: the score form's sampled ``-S`` of a token of probability below ``1/V`` is
    above ``ln V``). inf where V (or, for ``sequence``, max_new_tokens) is unknown."""
    if not V or V < 1:
        return math.inf, math.inf
    per_token = math.log(V)
    if x.mode == "sequence":
        top = per_token * max_new_tokens if max_new_tokens else math.inf
    else:
        top = per_token
    tokens = x.mode in tf.TOKEN_MODES or x.tokens
    return top, top if tokens else math.inf


def group_betas(optimizer: torch.optim.Optimizer, params=None) -> list[tuple[int, float, float]]:
    """``(group index, beta1, beta2)`` of each param group that holds one of ``params`` (all groups when
    None): AdamW's betas; ``(0, 0)`` for an optimizer without them (plain SGD: no momentum carried,
    no denominator)."""
    ids = None if params is None else {id(p) for p in params}
    out = []
    for i, g in enumerate(optimizer.param_groups):
        if ids is not None and not any(id(p) in ids for p in g["params"]):
            continue
        if "betas" in g:
            out.append((i, float(g["betas"][0]), float(g["betas"][1])))
        else:
            out.append((i, 0.0, 0.0))
    return out


def betas_error(optimizer: torch.optim.Optimizer, params=None) -> str | None:
    """Why the k-step forecast cannot be made for this optimizer: its param groups' betas differ (the
    forecast's horizon coefficients are one momentum's and one second moment's; the step's parts
    are not split by group); None when they agree."""
    betas = group_betas(optimizer, params)
    if len({(b1, b2) for _, b1, b2 in betas}) <= 1:
        return None
    listed = ", ".join(f"group {i} ({b1:g}, {b2:g})" for i, b1, b2 in betas)
    return (f"the optimizer's param groups have different betas ({listed}): the entropy forecast k steps ahead "
            "is made for one (beta1, beta2); give every param group the same betas")


def forecast_inputs(ro: RolloutPrediction, optimizer: torch.optim.Optimizer, params, y: pv.Buffer
                    ) -> ForecastInputs | None:
    """math/forecast.py's inputs from the rollouts' prediction and the optimizer: the betas of the
    param groups that hold ``params`` (``group_betas``: AdamW's, plain SGD none; every group's the
    same, else no forecast: None, with a warning naming them, ``betas_error``), the step count, ``kappa_c = sum y^2 / sum v_hat_1`` with ``v_hat_1 = (beta2 v + (1 - beta2) y^2) /
    (1 - beta2^(t+1))`` (the second moment after this step), the fresh step's variance ``Var(b_n) / B``
    (the gradient part's Y side), H's, and the entropy's range (``ro.H_max``). Each group's own
    learning rate, eps and weight decay are in the parts already (the step model's, per group)."""
    error = betas_error(optimizer, params)
    if error is not None:
        warnings.warn(f"entprobe: no forecast_H_k*: {error}", stacklevel=2)
        return None
    _, beta1, beta2 = group_betas(optimizer, params)[0]
    adam = "betas" in optimizer.param_groups[0]
    t, kappa = 0.0, 1.0
    if adam:
        states = [optimizer.state.get(p) or {} for p in params]
        t = max((float(s["step"]) for s in states if "step" in s), default=0.0)
        v_sum = sum(float(s["exp_avg_sq"].sum(dtype=torch.float64)) for s in states if "exp_avg_sq" in s)
        y2 = pv.norm(y) ** 2
        v_hat = (beta2 * v_sum + (1 - beta2) * y2) / (1 - beta2 ** (t + 1))
        kappa = y2 / v_hat if v_hat > 0 else 1.0
    zero = torch.zeros(ro.B, dtype=torch.float64)
    part = lambda name: ro.parts[name] if name in ro.parts else None  # noqa: E731
    val = lambda name: (part(name).U, part(name).rows) if part(name) is not None else (0.0, zero)  # noqa: E731
    (gv, gr), (mv, mr), (wv, wr) = val("gradient"), val("momentum"), val("weight_decay")
    b = ro.kt.b  # over the probed prompts; a fresh step's batch has the step's B (rollout_subset.py)
    B_step = int(ro.res.get("rollouts/B", ro.B))
    return ForecastInputs(ro.res["H_orig"], unit_mean_rows(ro.h_units), gv, gr, mv, mr, wv, wr,
                          est.mean_variance(b) * ro.B / B_step, est.mean_variance(ro.h_units), t, beta1, beta2, kappa,
                          ro.B - 1,
                          *ro.H_max)
