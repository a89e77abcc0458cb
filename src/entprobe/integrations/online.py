"""The online probe in a plain PyTorch loop: every N optimizer steps, predict the coming step's
entropy change before ``optimizer.step()`` and measure it after.

    probe = OnlineProbe(model, optimizer, tokenizer, task, every=10, batch={"B_E": 8})
    for step in range(num_steps):
        loss = ...; loss.backward()                    # (and clipping: the step is what .grad holds)
        probe.before_step(step)                        # predict: deltaH_pred +- SE
        optimizer.step()
        metrics = probe.after_step()                   # measure: {"entprobe/deltaH_true": ..., ...} or None
        optimizer.zero_grad()

``before_step`` (on steps that are multiples of ``every``, from the optimizer's first step):
samples a held-out batch E at theta (B_E prompts, G responses: responses the step is not fit to),
builds the update AdamW will apply to the gradient now in ``.grad`` (closed form: the optimizer's
own lr, betas, eps, decay and state; ``stages.prediction.build_step_model``) and predicts
``deltaH_pred = -Xbar_E . Delta theta`` with its SE over E's prompts (``predict_on_held_out``:
each prompt projected onto the whole update, one direction; the parts ``deltaH_pred_<part>`` are
point values; ``probe.projection=ghost`` takes the projections from layer hooks in one backward).
``after_step``: E's log-probs at the parameters the real step produced, the importance-sampling
estimate of the change (``deltaH_true`` +- SE) and the paired difference with the prediction
(``deltaH_true_minus_pred`` +- SE, ``pred_consistent``: its 95% interval holds 0).

Nothing the loop uses changes: the probe restores ``.grad``, torch's RNG (CPU and the model's CUDA
device) and the modules' modes (``api.left_as_it_was``), and never steps or writes the parameters
or the optimizer state (the update is computed in closed form; for optimizers without one, on a
snapshot restored bit-exactly: an optimizer whose ``step`` is not torch's own AdamW/Adam/SGD step, a
subclass overriding it included, and SGD with momentum). After the step, the step taken is checked
against the one predicted on the prediction's Xbar (``_check_step``): another step (parameters or
``.grad`` changed between the calls) is flagged ``step_mismatch``, ``pred_consistent`` None, warned
once. AdamW's first step is probed like any other: without state its moments are zeros at step 0,
so the closed form is ``-lr g / (|g| + eps) - lr wd theta`` (math/adamw.py). ``held_out`` may also be
a callable ``step -> RolloutBatch`` that
samples at the current parameters (the TRL callback passes the trainer's own generation).

``source="rollouts"`` (``before_step(step, rollouts=batch)``, ``batch`` the RolloutBatch the gradient in
``.grad`` was computed on, with the advantages the loss used): the prediction comes from that batch
itself, no generation: the cross-prompt U-statistic of stages/rollout_prediction.py (each prompt's X
against the update without that prompt's own part, to first order through the update's Jacobian;
the objective ``objective.*`` must be the loss's, ``max_grad_norm`` the loop's clipping: checked
against ``.grad``), estimating the change of the population's entropy, not of the batch's. Then
``held_out`` (a Task, a callable, or None) only serves the measurement: a fresh E of ``batch.B_E``
prompts, predicted on and measured after the step as above (``deltaH_pred_E``, ``deltaH_true``
and their paired difference); None measures nothing (``deltaH1_step`` is still reported).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from entprobe.math import paramvec as pv
from entprobe.pipeline.api import left_as_it_was
from entprobe.config import ConfigError, EntprobeConfig, Preconditioner
from entprobe.pipeline.in_memory import probe_context
from entprobe.pipeline.geometry import check_trains, live_geometry, live_lr, unwrap_optimizer
from entprobe.math.importance import psis_backend
from entprobe.checkpoints.optim_state import OptimizerStateError
from entprobe.tasks.prompt_ids import prompt_kwargs
from entprobe.rollouts.sampling import RolloutBatch, draw_prompt_indices, sample_batch
from entprobe.rollouts.logprobs import autocast_dtype
from entprobe.integrations.online_config import SOURCES, one_lr as _one_lr, online_config
from entprobe.integrations.online_checks import (check_bonus_args, check_every, check_rollouts, step_check,
                                                 still_check, theta_sum)
from entprobe.pipeline.stages.forward_precision import forward_dtype, forward_eps
from entprobe.pipeline.stages.ground_truth import (eval_at_current, importance_estimates,
                                                   token_side, token_side_needed, true_change)
from entprobe.pipeline.stages.x_spec import functional_value
from entprobe.pipeline.stages.prediction import (HeldOutPrediction, build_step_model, predict_on_held_out,
                                                 step_model_kind, update_dots)
from entprobe.pipeline.stages.paired import compare_with_prediction
from entprobe.math.forecast import HORIZONS
from entprobe.integrations.online_filter import RunFilter
from entprobe.pipeline.stages.rollout_prediction import forecast_inputs, probe_subset, rollouts_prediction
from entprobe.tasks import Task

# logged every probe (as ``entprobe/<key>``)
LOGGED = ("deltaH_pred", "SE_deltaH_pred", "ci95_pred_low", "ci95_pred_high", "deltaH_true", "SE_deltaH_true",
          "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred", "z_true_minus_pred", "pred_consistent",
          "rounding_true_minus_pred", "lr_floor_true_minus_pred",
          "deltaH_pred_gradient", "deltaH_pred_momentum", "deltaH_pred_weight_decay", "deltaH1_step",
          "H_orig", "H_rollouts", "ESS_frac", "lr", "time_s", "step", "step_mismatch",
          "SE_deltaH_pred_expected", "deltaH_pred_E", "gradient_zero", "update_zero",
          "entropy_coef", "bonus_effect", "SE_bonus_effect",
          *(f"forecast_H_k{k}{s}" for k in HORIZONS for s in ("", "_low", "_high")))


@dataclass
class _Pending:
    """A prediction waiting for the step it predicts."""
    step: int
    E: RolloutBatch
    pred: HeldOutPrediction | None  # on E (None: nothing to measure)
    x_dot_theta: float  # Xbar . theta before the step, products and sums in fp64 (deltaH1_step after it)
    res: dict = field(default_factory=dict)
    H: float = float("nan")  # the entropy at theta in the probe's units (H_orig)
    Xbar: object = None  # the Xbar of x_dot_theta (E's, or the rollouts')
    rollouts: object = None  # the rollouts' RolloutPrediction (source="rollouts")
    # the check of the step taken: Xbar . Delta theta of the step predicted (fp64), sum |Xbar| sum_part
    # |Delta theta_part|, sum |Xbar| |theta| and the unit roundoff (math/adamw.step_check_tolerance)
    step_dot: float = 0.0
    step_mag: float = 0.0
    x_theta_abs: float = 0.0
    u: float = 0.0


@dataclass(frozen=True)
class PendingPrediction:
    """A read-only view of the prediction waiting for its step (``OnlineProbe.pending``): the step,
    its predicted entropy change ``deltaH_pred`` and ``SE`` (at ``lr``, the lr the prediction is
    for), and ``H``, E's entropy at theta in the probe's units (as ``H_orig`` is logged); ``forecast``
    (source="rollouts") the entropy k steps ahead at factor x lr."""
    step: int
    deltaH_pred: float
    SE: float
    H: float
    lr: float
    # source="rollouts": ``forecast(k, factor)``, math/forecast.py's forecast k steps ahead at factor x lr
    forecast: Callable[[int, float], dict] | None = None
    # before_step(..., bonus_effect=True): the entropy change per unit of entropy-bonus coefficient, at ``lr``
    bonus_effect: float = float("nan")
    SE_bonus_effect: float = float("nan")


class OnlineProbe:
    """Predict before, measure after, every ``every`` optimizer steps (module docstring).

    ``held_out``: a ``Task`` (E sampled with entprobe's sampler: ``batch.B_E`` prompts, ``batch.G``
    responses, seed ``batch.seed_E + step``) or a callable ``step -> RolloutBatch`` sampling at the
    current parameters. ``overrides``: config keys (``online_config``); or ``config``, one
    ``online_config`` made already (composing one takes ~0.3 s: the TRL callback makes it when it
    is constructed, before training). ``history`` keeps every probe's full results (the logged
    ones, per-phase wall and CPU times ``time/<phase>_s`` / ``cpu_time/<phase>_s``, and the rest);
    ``skipped`` the ``(step, reason)`` of each due step not probed (a step at lr 0, where a schedule
    ends: warned, and training goes on)."""

    def __init__(self, model: torch.nn.Module, optimizer, tokenizer,
                 held_out: Task | Callable[[int], RolloutBatch] | None, every: int = 10,
                 fixed: Mapping[str, Any] | None = None, config: EntprobeConfig | None = None,
                 source: str = "held_out", max_grad_norm: float | None = None, **overrides):
        check_every(every, "every")
        if source not in SOURCES:
            raise ConfigError(f"source={source!r}: one of {', '.join(SOURCES)}")
        if held_out is None and source != "rollouts":
            raise TypeError("held_out: a Task, or a callable step -> RolloutBatch (None only with source='rollouts': "
                            "then nothing is measured)")
        if not (held_out is None or isinstance(held_out, Task) or callable(held_out)):
            raise TypeError("held_out: a Task, or a callable step -> RolloutBatch sampled at the current parameters")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm={max_grad_norm!r}: the clipping norm your loop uses (> 0), or None")
        self.source, self.max_grad_norm = source, max_grad_norm
        if config is not None and (overrides or fixed):
            raise TypeError("OnlineProbe: pass config (an online_config) or overrides and fixed, not both")
        self.model, self.optimizer, self.tokenizer = model, unwrap_optimizer(optimizer), tokenizer
        _one_lr(self.optimizer, "OnlineProbe")  # refused now, not at the first probe inside training
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_trains(self.optimizer, [n for n, _ in trainable], [p for _, p in trainable], model)
        kind = step_model_kind(self.optimizer, "optimizer")
        if source == "rollouts" and kind == "optimizer_step":
            raise ConfigError(f"source='rollouts': the optimizer ({type(self.optimizer).__name__}) has no closed form "
                              "here (torch's AdamW/Adam with its own step, or SGD without momentum), and the "
                              "prediction needs its Jacobian: use one of those, or source='held_out' (which steps "
                              "any optimizer on a snapshot)")
        self.held_out, self.every = held_out, every
        self.cfg = config if config is not None else online_config(overrides, fixed, source)
        self._geo_cfg = dataclasses.replace(self.cfg, optimizer=dataclasses.replace(
            self.cfg.optimizer, preconditioner=Preconditioner.identity))
        self.history: list[dict] = []
        self.skipped: list[tuple[int, str]] = []
        self._pending: _Pending | None = None
        self._warned_mismatch = False
        self._checked = False  # the objective checked against .grad on a whole batch (probe.rollouts_prompts)
        self.filter = RunFilter()  # source="rollouts": the forecast over the run (integrations/online_filter.py)
        psis_backend()  # its one-time import (~1 s) here, not inside the training loop's first probe

    def due(self, step: int) -> bool:
        """Whether ``before_step(step)`` probes: every ``every`` steps, from the optimizer's first
        (AdamW without state yet steps from zero moments, in closed form like any other step)."""
        return step % self.every == 0

    def _sample(self, step: int) -> RolloutBatch:
        if callable(self.held_out) and not isinstance(self.held_out, Task):
            return self.held_out(step)
        b, s = self.cfg.batch, self.cfg.sampling
        idx = draw_prompt_indices(len(self.held_out.prompts), b.B_E, b.seed_E + 7_000_003 * step)
        return sample_batch(self.model, self.tokenizer, self.held_out, idx, b.G, s, b.seed_E + step,
                            "dr_grpo", b.adv_eps, **prompt_kwargs(self.cfg, "memory"))

    def before_step(self, step: int, rollouts: RolloutBatch | None = None, grad_norm: float | None = None,
                    entropy_coef: float = 0.0, bonus_effect: bool = False, given=None) -> bool:
        """Call with the step's gradient in ``.grad``, before ``optimizer.step()``; with
        ``source="rollouts"``, ``rollouts`` is the batch that gradient was computed on (its
        advantages as the loss used them) and ``grad_norm`` the gradient's norm before clipping (what
        ``clip_grad_norm_`` returned; needed when ``max_grad_norm`` clipped it). ``entropy_coef``: the
        coefficient c of TRL's entropy bonus in the loss that gradient came from (``L_policy - c H``; 0:
        none); ``bonus_effect``: also predict the change per unit of c (source="rollouts";
        stages/rollout_bonus.py); ``given``: the batch's per-prompt passes made already (a
        ``trl_fused.FusedPasses``: the gradient in ``.grad`` is their Y sum). Returns whether it predicted (``due``)."""
        check_bonus_args(entropy_coef, bonus_effect, self.source)
        self._pending = None
        if not self.due(step):
            return False
        if self.source == "rollouts" and not isinstance(rollouts, RolloutBatch):
            raise TypeError(f"before_step({step}): source='rollouts' predicts from the step's own batch: pass "
                            "rollouts=<the RolloutBatch the gradient in .grad was computed on>")
        if self.source == "rollouts":
            check_rollouts(rollouts, f"before_step({step})")
        cfg, model = self.cfg, self.model
        _one_lr(self.optimizer, f"before_step({step})")  # a schedule may have set the groups apart
        try:  # the command line's check (geometry.live_lr), before E is sampled
            live_lr(cfg, self.optimizer, fix=f"step {step} is not probed")
        except OptimizerStateError as exc:
            self.skipped.append((step, str(exc)))
            warnings.warn(f"entprobe: {exc}", stacklevel=2)
            return False
        t0, c0 = _now(), time.process_time()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        no_grad = [n for n, p in trainable if p.grad is None]
        if no_grad:
            raise RuntimeError(f"before_step: {no_grad[0]!r} has no .grad ({len(no_grad)} parameter(s)); call it "
                               "after backward, with the gradient optimizer.step() will use")
        Ybar = [-p.grad.detach().float() for _, p in trainable]  # the step's gradient, before it is set aside
        with left_as_it_was(model, self.optimizer, None) as callers_modes:
            ctx = probe_context(cfg, model, Ybar[0].device, autocast_dtype(cfg.model, Ybar[0].device))
            with ctx.phase("geometry"):
                # the update comes from the optimizer itself (closed form, or its step on a snapshot):
                # no preconditioner P, and none of the parameter-sized passes that build its
                # diagnostics (1.2 s a probe on SmolLM2-135M)
                geo, _ = live_geometry(self._geo_cfg, self.optimizer, ctx.names, ctx.params, ctx.buffers_device)
                update = build_step_model(ctx, geo.optimizer, geo.lr, Ybar, geo.P, "optimizer", None)
            if self.source == "rollouts":
                ro = rollouts_prediction(ctx, cfg, rollouts, update, lambda y: build_step_model(
                    ctx, geo.optimizer, geo.lr, y, geo.P, "optimizer", None), Ybar, self.max_grad_norm, grad_norm,
                    float(entropy_coef), bonus_effect, probe_subset(cfg.probe.rollouts_prompts, rollouts.B,
                                                                    cfg.batch.seed_E, step, self._checked),
                    given.units if given is not None else None)
                self._checked = self._checked or (ro.res.get("rollouts/grad_residual") is not None
                                                  and not ro.res.get("gradient_zero"))
                res, Xbar, H = dict(ro.res), ro.Xbar, ro.res["H_orig"]
                # the step's batch's entropy, where the forecasts start: kept under its own name, since a
                # measurement on a held-out E logs E's entropy as H_orig after the step
                res["H_rollouts"] = H
                ro.forecast = forecast_inputs(ro, geo.optimizer, ctx.params, Ybar)
                res.update(self.filter.on_probe(step, ro.forecast, geo.lr))
            still = self.source == "rollouts" and Xbar is None  # an update exactly 0: nothing to measure
            callers_modes()  # sampled as the loop samples (a trainer's generation reads model.training)
            with ctx.phase("sample_E"):
                E = self._sample(step) if self.held_out is not None and not still else None
            model.eval()
            if E is not None and E.temperature != cfg.sampling.temperature:
                raise ConfigError(f"held-out E was sampled at temperature {E.temperature}, the probe's log-probs "
                                  f"use sampling.temperature={cfg.sampling.temperature}: make them agree")
            pred = predict_on_held_out(ctx, E, update, cfg.probe, with_entropy=False, total_only=True) \
                if E is not None else None
            del Ybar
            if self.source != "rollouts":
                res, Xbar, ro = dict(pred.res), pred.Xbar, None
                H = functional_value(ctx.x, pred.S, pred.entropy, E.response_mask)
                res["B_E"], res["G"] = E.B, E.G
            elif pred is not None:  # the measured side's own prediction on E, paired with it
                res.update({"deltaH_pred_E": pred.res["deltaH_pred"], "SE_deltaH_pred_E": pred.res["SE_deltaH_pred"],
                            "measure/B_E": E.B})
            if still:  # theta_plus must be theta: the parameters' own sum is checked (online_checks.still_check)
                x_theta, step_dot, step_mag, x_theta_abs = theta_sum(ctx.params), 0.0, 0.0, 0.0
            else:
                with ctx.phase("step_check"):  # the predicted step's Xbar . Delta theta and Xbar . theta, in fp64
                    step_dot, step_mag, x_theta, x_theta_abs = update_dots(ctx, update, Xbar)
            del update
        res.update({"lr": geo.lr, "step": step})
        u = max(torch.finfo(t).eps / 2 for t in {p.dtype for p in ctx.params} | {
            torch.promote_types(ctx.buffers_dtype, torch.float32)})
        self._pending = _Pending(step, E, pred, x_theta, res, H, Xbar, ro, step_dot, step_mag, x_theta_abs, u)
        self._ctx, self._t, self._cpu = ctx, _now() - t0, time.process_time() - c0
        if given is not None:  # the passes made in the trainer's compute_loss are the probe's too
            self._t, self._cpu = self._t + given.wall_s, self._cpu + given.cpu_s
            ctx.stats.seconds["rollouts_fused"], ctx.stats.cpu_seconds["rollouts_fused"] = given.wall_s, given.cpu_s
        return True

    def after_step(self) -> dict | None:
        """Call after ``optimizer.step()``: the measured change of the step ``before_step`` predicted,
        as ``{"entprobe/<key>": value}`` for ``LOGGED`` (None when nothing was predicted)."""
        pend, self._pending = self._pending, None
        if pend is None:
            return None
        t0, c0 = _now(), time.process_time()
        ctx, E, res = self._ctx, pend.E, pend.res
        with left_as_it_was(self.model, self.optimizer, None):
            if E is not None:
                res.update(self._measure(ctx, pend))
            if pend.Xbar is None:  # an update exactly 0 (source="rollouts"): was theta left as it was?
                res.update(still_check(pend.x_dot_theta, theta_sum(ctx.params)))
                self._warn_mismatch(pend, res, 3)
            else:  # -Xbar . (theta_plus - theta): the real step. Both dots in fp64 (exact products of fp32
                # or bf16 numbers): their difference is the step's dot to ~1e-16 of |Xbar| |theta|, where fp32
                # dots lost up to 3e-4 (their rounding, ~6e-8 of them, is not small next to the step's dot)
                x_after = pv.dot(pend.Xbar, [p.detach() for p in ctx.params], dtype=torch.float64)
                res["deltaH1_step"] = -(x_after - pend.x_dot_theta)
                res.update(self._check_step(pend, res["deltaH1_step"]))
        res["time_s"] = self._t + _now() - t0
        res["cpu_time_s"] = self._cpu + time.process_time() - c0
        res.update({f"time/{k}_s": v for k, v in ctx.stats.seconds.items()})
        res.update({f"cpu_time/{k}_s": v for k, v in ctx.stats.cpu_seconds.items()})
        self.history.append(res)
        # pred_consistent None (the measurement is unmeasurable: no test was made) is logged as NaN
        return {f"entprobe/{k}": float("nan") if res[k] is None else float(res[k]) for k in LOGGED if k in res}

    def _check_step(self, pend: _Pending, taken: float) -> dict:
        """``online_checks.step_check`` of the step taken against the one predicted (on the
        prediction's Xbar); a mismatch is warned once."""
        out = step_check(-pend.step_dot, taken, pend.u, pend.x_theta_abs, pend.step_mag,
                         sum(p.numel() for p in self._ctx.params))
        self._warn_mismatch(pend, out, 4)
        return out

    def _warn_mismatch(self, pend: _Pending, out: dict, stacklevel: int) -> None:
        if out["step_mismatch"] and not self._warned_mismatch:
            self._warned_mismatch = True
            warnings.warn(f"entprobe: step {pend.step}: {out['pred_consistent_reason']}; the prediction was of "
                          "another step, so pred_consistent is None. Does the optimizer's step differ from torch's "
                          "AdamW/SGD, or did the parameters or .grad change between before_step and "
                          "optimizer.step()?", stacklevel=stacklevel)

    def _measure(self, ctx, pend: _Pending) -> dict:
        """The importance-sampling estimate of the step's change on E and its paired difference with
        E's own prediction (for ``source="rollouts"``, ``deltaH_pred_E``, not the headline)."""
        icfg, E = self.cfg.importance, pend.E
        tokens_needed = token_side_needed(ctx.x)
        S_upd, ent_upd, lp_upd = eval_at_current(ctx, E, icfg, with_entropy=tokens_needed)
        with ctx.phase("importance"):
            tokens = token_side(ctx.x, E, pend.pred.token_logp, lp_upd, pend.pred.entropy, ent_upd) \
                if tokens_needed else None
            est_res, psi = importance_estimates(pend.pred.S, S_upd, E.gen_lengths, E.Lmax, ctx.weighting_mode,
                                                icfg.clip_c, warn_psis=False, x=ctx.x, tokens=tokens,
                                                eps_forward=forward_eps(ctx))
        out = dict(est_res, forward_dtype=str(forward_dtype(ctx)).removeprefix("torch."))
        out.update(true_change(est_res, psi, icfg.is_mode.value, icfg.ess_threshold))
        out.update(compare_with_prediction({**out, "deltaH_pred": pend.pred.res["deltaH_pred"]},
                                           psi[icfg.is_mode.value], pend.pred.e))
        return out

    @property
    def pending(self) -> PendingPrediction | None:
        """The prediction ``before_step`` made and ``after_step`` has not measured yet (None when
        there is none)."""
        pend = self._pending
        if pend is None:
            return None
        res = pend.res
        fi = pend.rollouts.forecast if pend.rollouts is not None else None
        at = self.filter.forecast_at if fi is not None else None
        nan = float("nan")
        return PendingPrediction(pend.step, res["deltaH_pred"], res["SE_deltaH_pred"], pend.H, res["lr"], at,
                                 res.get("bonus_effect", nan), res.get("SE_bonus_effect", nan))

    def observe_entropy(self, step: int, H: float) -> None:
        """The entropy your trainer logged at ``step`` (its batch's, in the probe's units: token_mean is
        TRL's ``entropy``), for the forecast over the run (docs/forecast.md); each step, after ``after_step``."""
        self.filter.observe(step, float(H))

    def state_dict(self) -> dict:
        """What a resumed run needs for its forecasts to go on: the filter's state (plain numbers)."""
        return {"filter": self.filter.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("filter"), dict):
            raise ConfigError(f"OnlineProbe state: needs a 'filter' dict (a state saved by OnlineProbe.state_dict()), "
                              f"got {type(state).__name__}")
        self.filter.load_state_dict(state["filter"])

    def rescale_pending(self, factor: float) -> None:
        """Make the waiting prediction that of the step at ``factor`` x its lr (for a caller that
        scales the lr after ``before_step``): every value linear in the step (``deltaH_pred`` and its
        parts, SEs, interval, attributions, per-prompt contributions) and ``lr`` are multiplied by
        ``factor``. Exact for AdamW's closed-form update, ``-lr (m_hat / (sqrt(v_hat) + eps) + wd theta)``."""
        pend = self._pending
        if pend is None:
            raise RuntimeError("rescale_pending: no prediction is waiting (call it after a before_step that returned True)")
        for res in (pend.res, pend.pred.res) if pend.pred is not None else (pend.res,):
            for k, v in res.items():
                if isinstance(v, float) and k.startswith(("deltaH_pred", "SE_deltaH_pred", "ci95_pred", "attr_pred/")):
                    res[k] = v * factor
        pend.res["lr"] *= factor
        pend.step_dot *= factor  # the step checked is the one at factor x lr
        pend.step_mag *= abs(factor)
        if pend.rollouts is not None:  # the forecast at factor x lr over its horizon (not linear in it: H is not)
            pend.res.update(self.filter.rescale(factor))
        if pend.pred is not None:
            pend.pred.e = pend.pred.e * factor


def _now() -> float:
    return time.perf_counter()
