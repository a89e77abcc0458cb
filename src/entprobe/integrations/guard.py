"""``EntropyGuard``: hold the policy's entropy on course by setting each step's lr from the online
probe's prediction of that step's entropy change (a plain loop; ``EntropyGuardCallback``,
guard_callback.py, is the same inside TRL's GRPOTrainer).

    probe = OnlineProbe(model, optimizer, tokenizer, task, every=1, batch={"B_E": 8})
    guard = EntropyGuard(probe, floor=0.5, max_decay=0.01)
    for step in range(1, num_steps + 1):
        loss = ...; loss.backward()
        guard.before_step(step)       # predict at the scheduler's lr, decide the factor, lr *= factor
        optimizer.step()
        metrics = guard.after_step()  # measure; the scheduler's lr put back; entprobe/guard_* metrics
        scheduler.step()

The rule (``decide``), at each step the probe predicts, from the prediction ``d`` +- ``se`` of the
step at the scheduler's lr (factor 1) and the entropy ``H`` at theta (E's, in the probe's units):

- the band's edge, the lowest change allowed: ``edge = max(-max_decay, floor - H)`` (either may be
  left out; below the floor the edge is positive: entropy must come back up);
- cut when the step at full lr is resolved to lower entropy past the edge,
  ``d + z se < min(edge, 0)`` (its upper z-bound below the edge, and below 0): the factor is
  ``edge / d`` (the first-order prediction is linear in the lr at a fixed gradient, so
  ``factor * d`` is the prediction of the step at ``factor * lr``: this puts it on the edge),
  clamped to ``[min_factor, max_factor]`` (``min_factor`` when ``edge >= 0``: no lr > 0 puts a
  decrease on a positive edge);
- with ``target_deltaH``, when not cut: steer when ``d`` is resolved away from the target
  (``|d - target| > z se``) and the lr can reach it (``target / d > 0``): factor ``target / d``
  clamped, no higher than the band's point-estimate limit ``edge / d`` when ``d < 0``;
- with ``ceiling``, the upper edge ``hi = ceiling - H``: cut when the step is resolved to raise
  entropy past it, ``d - z se > max(hi, 0)``: factor ``hi / d`` clamped (``min_factor`` above the
  ceiling, where no lr > 0 puts a rise on a negative edge); above the ceiling ``max_decay`` does not
  apply (a fall back toward the band is what is wanted), the factor is held while ``d`` is a rise of
  unresolved sign and recovers while it is a fall (``d < 0``) of unresolved sign (the bonus is 0 there,
  so nothing but the step's own gradient brings entropy down: a factor held at ``min_factor`` would
  freeze the run above the band), and a recovery never raises the factor past ``hi / d`` on a
  predicted rise;
- below the floor (``edge > 0``) with the sign of ``d`` unresolved (``d - z se < 0``): the factor
  is held (neither cut on noise nor raised);
- otherwise (the prediction inside the band; its interval holding the edge: no action on noise;
  below the floor with a resolved rise, which a smaller lr would only slow) the factor recovers
  toward 1 geometrically: ``min(1, f * recovery)`` from below, ``max(1, f / recovery)`` from above.

With ``horizon=K`` (the probe's ``source="rollouts"``, which forecasts the entropy k steps ahead)
the guard acts on the forecast first (guard_forecast.py): when the population's 95% interval of the
entropy k <= K steps ahead is below the floor and its change is resolved below 0 (a fall: below the
floor a rise is never cut, as above), the lr is cut to the factor that keeps every point forecast on
or above the floor; otherwise the rule above decides, and does not raise the factor into a forecast
crossing. ``horizon`` is an int from 1 to ``MAX_HORIZON``; it needs every param group's betas equal.
Each decision keeps the forecast it acted on (``Decision.forecast``; logged as
``entprobe/guard_forecast_k``, ``_H``, ``_high``).

The factor holds until the next probe (steps the probe does not predict keep it). It multiplies
the lr the scheduler wrote into each param group just before ``optimizer.step()`` and the
scheduler's lr is put back right after, so the scheduler never sees it. The probe's prediction
(its ``deltaH_pred``, SE, interval, parts, per-prompt contributions and ``lr``) is rescaled by the
factor: what it logs and compares with the measurement is the prediction of the step taken.

A resumed run continues with the factor in force when its checkpoint was written: ``state_dict()`` /
``load_state_dict()`` in a plain loop (save it beside the optimizer's); ``EntropyGuardCallback``
keeps it in the checkpoint's ``trainer_state.json`` (``stateful_callbacks[STATE_KEY]``) and reads it
back when TRL resumes.

With ``entropy_coef_max`` (needs ``source="rollouts"``) the guard also sets the coefficient of an entropy
bonus in the loss, ``L_policy - c H``, for the coming steps (guard_bonus.py): ``guard.entropy_coef`` is the
c your loss must use from the next step on (``EntropyGuardCallback`` writes TRL's ``trainer.entropy_coef``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass

from entprobe.config import ConfigError
from entprobe.integrations.guard_bonus import coef_call, coef_error, coef_text, loaded_coef
from entprobe.integrations.guard_params import INTEGER_PARAMS, MAX_HORIZON, PARAM_RANGES, param_error  # noqa: F401
from entprobe.integrations.guard_forecast import forecast_call
from entprobe.integrations.online import OnlineProbe
from entprobe.pipeline.stages.rollout_prediction import betas_error

STATE_KEY = "entprobe.EntropyGuard"  # the guard's entry in TrainerState.stateful_callbacks


@dataclass(frozen=True)
class GuardRule:
    """The guard's parameters (module docstring). ``floor``: lowest entropy H (nats, as the probe
    reports ``H_orig``); ``max_decay`` (> 0): largest decrease per step; ``target_deltaH``: the
    change to steer each step to; ``z``: the resolution a prediction needs before the guard acts;
    ``min_factor`` / ``max_factor``: the factor's range; ``recovery`` (> 1): its geometric return to 1."""
    floor: float | None = None
    max_decay: float | None = None
    target_deltaH: float | None = None
    z: float = 1.96
    min_factor: float = 0.05
    max_factor: float = 1.0
    recovery: float = 1.5
    horizon: int | None = None  # steps ahead the forecast must stay above the floor (guard_forecast.py)
    entropy_coef_max: float | None = None  # the entropy bonus knob's largest coefficient (None: off; guard_bonus.py)
    entropy_coef: float | None = None  # its starting coefficient (None: 0, or TRL's GRPOConfig.entropy_coef)
    ceiling: float | None = None  # highest entropy H (nats): a resolved rise past it is cut (the band's upper edge)

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            error = param_error(name, value)
            if error:
                raise ConfigError(f"{name}={value!r}: {error}")
            if value is not None:  # a numpy or integer value, as a float (the horizon as an int)
                object.__setattr__(self, name, int(value) if name in INTEGER_PARAMS else float(value))
        if self.floor is None and self.max_decay is None and self.target_deltaH is None and self.ceiling is None:
            raise ConfigError("EntropyGuard: give floor, max_decay, ceiling or target_deltaH (what to hold entropy to)")
        if self.ceiling is not None and self.floor is not None and not self.ceiling > self.floor:
            raise ConfigError(f"EntropyGuard: ceiling={self.ceiling:g} must be above floor={self.floor:g} (the band "
                              "between them is where entropy is held)")
        if self.horizon is not None and self.floor is None:
            raise ConfigError(f"EntropyGuard: horizon={self.horizon} keeps the forecast above the floor: give floor")
        error = coef_error(self.entropy_coef_max, self.entropy_coef, self.floor, self.max_decay)
        if error:
            raise ConfigError(f"EntropyGuard: {error}")

    def limits(self) -> str:
        """``, floor 0.2, ceiling 2, max_decay 0.05``: the band's limits that are set, as printed lines show them."""
        return "".join(f", {k} {v:g}" for k, v in (("floor", self.floor), ("ceiling", self.ceiling),
                                                   ("max_decay", self.max_decay),
                                                   ("target_deltaH", self.target_deltaH)) if v is not None)


@dataclass
class Decision:
    """One decision: the factor for the coming steps, its action and why."""
    step: int
    factor: float
    action: str  # cut, steer, recover, hold (nothing to recover)
    reason: str
    prev: float = 1.0  # the factor before it
    deltaH_pred: float = math.nan  # at the scheduler's lr (factor 1)
    SE: float = math.nan
    H: float = math.nan
    edge: float | None = None
    forecast: object = None  # guard_forecast.ForecastCall the rule acted on (horizon=K)
    coef: object = None  # guard_bonus.CoefCall: the entropy bonus's coefficient for the next steps (entropy_coef_max)

    @property
    def code(self) -> int:
        """``entprobe/guard_action``: -1 the factor went down, +1 up, 0 unchanged."""
        return (self.factor > self.prev) - (self.factor < self.prev)

    def line(self, rule: GuardRule) -> str:
        """The decision in one printed line: ``entprobe guard: step 16: lr x0.02, cut (predicted
        -3 +- 2 nats at the scheduler's lr, H 0.25, floor 0.2)``, with the rule's
        floor / max_decay / target_deltaH (those set)."""
        limits = rule.limits()
        fc = f"; {self.forecast.text(rule.floor)}" if self.forecast is not None else ""
        fc += f"; {coef_text(self.coef)}" if self.coef is not None else ""
        return (f"entprobe guard: step {self.step}: lr x{self.factor:.3g}, {self.action} (predicted "
                f"{self.deltaH_pred:+.3g} +- {self.SE:.2g} nats at the scheduler's lr, H {self.H:.3g}{limits}{fc})")


def band_edge(H: float, floor: float | None, max_decay: float | None, ceiling: float | None = None) -> float | None:
    """The lowest change allowed this step: ``max(-max_decay, floor - H)`` of those given (``max_decay``
    not above the ``ceiling``: there a fall back toward the band is what is wanted)."""
    decay = max_decay is not None and not (ceiling is not None and H > ceiling)
    edges = ([-max_decay] if decay else []) + ([floor - H] if floor is not None else [])
    return max(edges) if edges else None


def resolved_below(d: float, se: float, edge: float, z: float) -> bool:
    """Whether the prediction's upper z-bound is below the edge: ``d + z se < edge``."""
    return d + z * se < edge


def ratio_factor(d: float, want: float) -> float:
    """The lr factor that makes a prediction ``d`` (linear in the lr) equal ``want``: ``want / d``
    (+inf for ``d == 0``; <= 0 when no lr > 0 reaches it)."""
    return want / d if d != 0 else math.inf


def clamp(f: float, lo: float, hi: float) -> float:
    return min(max(f, lo), hi)


def recovered(prev: float, recovery: float) -> float:
    """One geometric move of the factor toward 1."""
    return min(1.0, prev * recovery) if prev < 1 else max(1.0, prev / recovery)


def decide_with_forecast(rule: GuardRule, step: int, p, prev: float) -> Decision:
    """``decide`` on the pending prediction ``p`` (``OnlineProbe.pending``), and with ``rule.horizon``
    the forecast's rule first (guard_forecast.py): a resolved fall across the floor within the horizon
    cuts to the factor that keeps the forecast on it; otherwise ``decide``'s factor, a rise held where
    a point forecast falls across the floor."""
    if rule.horizon is None:
        return decide(rule, step, p.deltaH_pred, p.SE, p.H, prev)
    if p.forecast is None:  # the probe made no forecast (forecast_inputs): never the one-step rule in silence
        raise ConfigError(f"EntropyGuard: horizon={rule.horizon} acts on the entropy forecast and the probe made none "
                          f"at step {step} (it forecasts with source='rollouts' when every param group has the same betas)")
    fc = forecast_call(p.forecast, p.H, rule.floor, rule.horizon)
    base = {"step": step, "deltaH_pred": p.deltaH_pred, "SE": p.SE, "H": p.H, "prev": prev, "forecast": fc,
            "edge": rule.floor - p.H}
    if fc.resolved:
        f = clamp(fc.factor if p.H > rule.floor else rule.min_factor, rule.min_factor, rule.max_factor)
        return Decision(factor=f, action="cut", reason=(
            f"{fc.text(rule.floor)} within horizon {rule.horizon}: lr x {f:.3g} keeps the point forecasts "
            f"{'on or above the floor' if f == fc.factor else 'as near the floor as allowed'}"), **base)
    dec = decide(rule, step, p.deltaH_pred, p.SE, p.H, prev)
    dec.forecast = fc
    if dec.factor > prev and fc.factor < dec.factor:  # no recovery into a forecast fall across the floor
        dec.factor = max(prev, fc.factor)
        dec.action = "recover" if dec.factor > prev else "hold"
        dec.reason += f"; held at x{dec.factor:.3g} by the {fc.text(rule.floor)}"
    return dec


def decide(rule: GuardRule, step: int, d: float, se: float, H: float, prev: float) -> Decision:
    """The factor for the step predicted ``d`` +- ``se`` at factor 1, at entropy ``H``; ``prev``:
    the factor in force (module docstring's rule)."""
    edge = band_edge(H, rule.floor, rule.max_decay, rule.ceiling)
    base = {"step": step, "deltaH_pred": d, "SE": se, "H": H, "edge": edge, "prev": prev}
    pm = f"deltaH_pred {d:+.3e} +- {se:.1e} at the scheduler's lr"
    if edge is not None and resolved_below(d, se, min(edge, 0.0), rule.z):
        f = clamp(ratio_factor(d, edge), rule.min_factor, rule.max_factor)  # edge >= 0: ratio <= 0, min_factor
        which = "floor" if rule.floor is not None and edge == rule.floor - H else "max_decay"
        return Decision(factor=f, action="cut", reason=(
            f"{pm}: its upper bound {d + rule.z * se:+.3e} (z={rule.z}) is below the {which} edge {edge:+.3e}; "
            f"lr x {f:.3g} puts the prediction {'on the edge' if f == ratio_factor(d, edge) else 'as near it as allowed'}"),
            **base)
    hi = rule.ceiling - H if rule.ceiling is not None else None  # the upper edge: the highest change allowed
    if hi is not None and d - rule.z * se > max(hi, 0.0):
        f = clamp(ratio_factor(d, hi) if hi > 0 else rule.min_factor, rule.min_factor, rule.max_factor)
        return Decision(factor=f, action="cut", reason=(
            f"{pm}: its lower bound {d - rule.z * se:+.3e} (z={rule.z}) is above the ceiling edge {hi:+.3e}; "
            f"lr x {f:.3g} puts the prediction {'on the edge' if hi > 0 and f == ratio_factor(d, hi) else 'as near it as allowed'}"),
            **base)
    if rule.target_deltaH is not None:
        t = rule.target_deltaH
        if abs(d - t) > rule.z * se and ratio_factor(d, t) > 0:
            f = clamp(ratio_factor(d, t), rule.min_factor, rule.max_factor)
            if edge is not None and d < 0:
                f = min(f, max(rule.min_factor, ratio_factor(d, edge)) if edge < 0 else rule.min_factor)
            return Decision(factor=f, action="steer", reason=(
                f"{pm}: resolved away from target_deltaH {t:+.3e} (|d - target| > {rule.z} SE); lr x {f:.3g}"), **base)
    f = recovered(prev, rule.recovery)
    if hi is not None and hi < 0:  # above the ceiling: no knob but the step's own gradient lowers entropy
        if d + rule.z * se <= 0:
            why = f"above the ceiling (edge {hi:+.3e}) but the step lowers entropy (a smaller lr would not help)"
        elif d >= 0:
            why, f = f"above the ceiling (edge {hi:+.3e}), a rise of unresolved sign: factor held", prev
        else:
            why = f"above the ceiling (edge {hi:+.3e}), a fall of unresolved sign: the factor recovers (only the step lowers entropy)"
    elif edge is None or d - rule.z * se >= edge:
        why = "inside the band"
    elif edge > 0 and d - rule.z * se < 0:
        why, f = f"below the floor (edge {edge:+.3e}) and the sign of the change unresolved: factor held", prev
    elif edge > 0:
        why = f"below the floor (edge {edge:+.3e}) but the step raises entropy (a smaller lr would not help)"
    else:
        why = f"its interval holds the edge {edge:+.3e} (unresolved: no action on noise)"
    if hi is not None and hi > 0 and d > 0 and f > prev and f * d > hi:  # no recovery into a rise past the ceiling
        f = max(prev, hi / d)
        why += f", no higher than the ceiling edge allows ({hi:+.3e})"
    return Decision(factor=f, action="recover" if f != prev else "hold",
                    reason=f"{pm}: {why}; factor {prev:.3g} -> {f:.3g}", **base)


class EntropyGuard:
    """The guard around a plain loop's ``optimizer.step()`` (module docstring), on an
    ``OnlineProbe`` that predicts every ``probe.every`` steps. ``decisions``: every decision with
    its reason; ``lrs``: ``(step, [each group's lr used])`` of every step taken; ``time_s``: the wall
    seconds spent in ``before_step`` and ``after_step`` (the probe's included)."""

    def __init__(self, probe: OnlineProbe, floor: float | None = None, max_decay: float | None = None,
                 target_deltaH: float | None = None, z: float = 1.96, min_factor: float = 0.05,
                 max_factor: float = 1.0, recovery: float = 1.5, horizon: int | None = None,
                 entropy_coef_max: float | None = None, entropy_coef: float | None = None,
                 ceiling: float | None = None):
        self.probe = probe
        self.rule = GuardRule(floor, max_decay, target_deltaH, z, min_factor, max_factor, recovery, horizon,
                              entropy_coef_max, entropy_coef, ceiling)
        if entropy_coef_max is not None and getattr(probe, "source", "held_out") != "rollouts":
            raise ConfigError(f"EntropyGuard: entropy_coef_max={entropy_coef_max} sets the entropy bonus from its "
                              "effect on the step's own batch: use OnlineProbe(..., source='rollouts')")
        self.entropy_coef = float(self.rule.entropy_coef or 0.0)  # the loss's coefficient from the next step on
        if horizon is not None and getattr(probe, "source", "held_out") != "rollouts":
            raise ConfigError(f"EntropyGuard: horizon={horizon} acts on the entropy forecast, which the online probe "
                              "makes from the step's own batch: use OnlineProbe(..., source='rollouts')")
        model = getattr(probe, "model", None)
        trainable = [p for p in model.parameters() if p.requires_grad] if model is not None else None
        betas = betas_error(probe.optimizer, trainable) if horizon is not None else None
        if betas is not None:  # refused now, not at the first probe inside training
            raise ConfigError(f"EntropyGuard: horizon={horizon}: {betas}")
        self.factor = 1.0
        self.decisions: list[Decision] = []
        self.lrs: list[tuple[int, list[float]]] = []
        self._scheduled: list[float] | None = None
        self._decision: Decision | None = None
        self.time_s = 0.0

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as the uninterrupted one would: the factor in force (it
        holds until the next probe), the step of the last decision, and with ``horizon`` the probe's
        (the forecast's filter over the run: ``OnlineProbe.state_dict``)."""
        return {"factor": self.factor, "decided_at": self.decisions[-1].step if self.decisions else None,
                **({"entropy_coef": self.entropy_coef} if self.rule.entropy_coef_max is not None else {}),
                **({"probe": self.probe.state_dict()} if self.rule.horizon else {})}  # the forecast's filter

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s factor (a ConfigError for a value no guard could have set: not a
        finite number > 0, or outside this guard's ``[min_factor, max_factor]``)."""
        f = state.get("factor") if isinstance(state, dict) else None
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not (f > 0 and math.isfinite(f)):
            raise ConfigError(f"EntropyGuard state {state!r}: its 'factor' must be a finite number > 0 "
                              "(a state saved by EntropyGuard.state_dict())")
        lo, hi = self.rule.min_factor, self.rule.max_factor
        if not lo <= f <= hi:  # every factor the guard sets is clamped to the range
            raise ConfigError(f"EntropyGuard state: 'factor' {f!r} is outside this guard's [min_factor, max_factor] "
                              f"= [{lo:g}, {hi:g}]: the state was saved by a guard with another range, or edited; "
                              "resume with the guard's own min_factor / max_factor, or from another checkpoint")
        self.factor = float(f)
        if self.rule.entropy_coef_max is not None:
            self.entropy_coef = loaded_coef(state, self.rule.entropy_coef_max)
        if "probe" in state:  # a state saved before the forecast's filter has none
            self.probe.load_state_dict(state["probe"])

    def before_step(self, step: int, **rollouts) -> float:
        """Call with the step's gradient in ``.grad``, the scheduler's lr in the param groups: the
        probe predicts (when due), the guard decides, each group's lr is multiplied by the factor.
        ``rollouts``: ``OnlineProbe.before_step``'s (``rollouts=``, ``grad_norm=``) for
        ``source="rollouts"``. Returns the factor."""
        t0, probe = time.perf_counter(), self.probe
        self.restore_lr()  # a step whose optimizer.step() raised never reached after_step: no factor on a factor
        self._decision = None
        knob = self.rule.entropy_coef_max is not None
        if knob and "entropy_coef" in rollouts:
            raise ConfigError("EntropyGuard.before_step: with entropy_coef_max the guard passes its own coefficient "
                              "(guard.entropy_coef, the one your loss must use): leave entropy_coef out")
        bonus = {"entropy_coef": self.entropy_coef, "bonus_effect": True} if knob else {}
        if probe.before_step(step, **rollouts, **bonus):
            p = probe.pending
            dec = decide_with_forecast(self.rule, step, p, self.factor)
            if knob:  # the coefficient for the next steps, from the same prediction (at the scheduler's lr)
                edge = band_edge(p.H, self.rule.floor, self.rule.max_decay, self.rule.ceiling)
                dec.coef = coef_call(self.rule, p, self.entropy_coef, edge)
                self.entropy_coef = dec.coef.coef
            self.factor, self._decision = dec.factor, dec
            self.decisions.append(dec)
            probe.rescale_pending(dec.factor)
        groups = probe.optimizer.param_groups
        self._scheduled = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * self.factor
        self.lrs.append((step, [g["lr"] for g in groups]))
        self.time_s += time.perf_counter() - t0
        return self.factor

    def restore_lr(self) -> None:
        """Put the scheduler's lr back in every param group that still holds the lr ``before_step``
        set (a group whose lr was written since, by the scheduler, is left as it is); nothing when
        no step is open. ``after_step`` calls it; call it yourself when ``optimizer.step()`` raised
        and the loop goes on without ``after_step`` (the next ``before_step`` also does it first)."""
        if self._scheduled is None:
            return
        scaled = self.lrs[-1][1]
        for g, lr, mine in zip(self.probe.optimizer.param_groups, self._scheduled, scaled):
            if g["lr"] == mine:
                g["lr"] = lr
        self._scheduled = None

    def after_step(self) -> dict:
        """Call after ``optimizer.step()`` (before the scheduler's step): puts the scheduler's lr
        back and returns the probe's metrics (when it predicted) and ``entprobe/guard_lr_factor``,
        ``entprobe/guard_action`` (-1 lowered, +1 raised, 0 kept; with a decision) and
        ``entprobe/guard_lr`` (the first group's lr used)."""
        t0 = time.perf_counter()
        self.restore_lr()
        out = dict(self.probe.after_step() or {})
        out["entprobe/guard_lr_factor"] = self.factor
        out["entprobe/guard_lr"] = self.lrs[-1][1][0] if self.lrs else math.nan
        if self.rule.entropy_coef_max is not None:  # the coefficient for the next steps, and the effect it acted on
            out["entprobe/guard_entropy_coef"] = self.entropy_coef
            if self._decision is not None:
                out["entprobe/guard_bonus_effect"] = self._decision.coef.effect
        if self._decision is not None:
            out["entprobe/guard_action"] = float(self._decision.code)
            fc = self._decision.forecast
            if fc is not None:  # the forecast the decision acted on (at the scheduler's lr)
                out.update({"entprobe/guard_forecast_k": float(fc.k), "entprobe/guard_forecast_H": fc.H,
                            "entprobe/guard_forecast_high": fc.high})
            history = getattr(self.probe, "history", None)
            if history and history[-1].get("step") == self._decision.step:
                history[-1]["guard_lr_factor"] = self.factor
        self.time_s += time.perf_counter() - t0
        return out
