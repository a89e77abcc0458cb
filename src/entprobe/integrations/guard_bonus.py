"""EntropyGuard's second knob: the coefficient c of an entropy bonus in the loss (``L = L_policy - c H``, TRL's
``GRPOConfig.entropy_coef``), set from the prediction; the lr factor stays the first knob and acts now.

The coefficient decided at a probe is the loss's from the NEXT step on (TRL reads ``trainer.entropy_coef``
when it computes the next step's loss, as its own adaptive rule does). The probe predicts the step taken
with the bonus in force (``c_now``, part of each prompt's Y) and ``b`` +- ``SE_b``, the entropy change per
unit of c added to the step (``-Xbar . J gH``, a plug-in: stages/rollout_bonus.py), both at the
scheduler's lr. With ``d`` the prediction at ``c_now`` and ``edge`` the band's edge (``guard.band_edge``):

- raise: ``d`` is resolved below the edge (``d + z se < edge``; below the floor, where the edge is
  positive, a flat entropy is below it: the bonus is what brings entropy back, which a smaller lr cannot)
  or, with ``horizon``, a forecast crossing of the floor is resolved (guard_forecast.py), and ``b`` is
  resolved > 0 (``b - z SE_b > 0``): ``c = c_now + (edge - d) / b`` (the first-order prediction is linear
  in c: this puts the step on the edge), with ``horizon`` at least the c that keeps every point forecast
  ``H_k + k (c - c_now) b`` on or above the floor; clamped to ``[0, entropy_coef_max]``;
- to 0 with the guard's ``ceiling``: entropy above it, or the step resolved to rise past it (unless a
  raise is due: the floor's edge comes first);
- decay: the prediction is inside the band with margin (``d - z se >= edge``, and with ``horizon`` no
  point forecast below the floor): ``c / recovery``, 0 once below ``OFF_FRACTION`` of the max;
- hold: otherwise (an interval that holds the edge, or an unresolved ``b``: no action on noise).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from entprobe.config import ConfigError

OFF_FRACTION = 1e-3  # a decaying coefficient below this fraction of entropy_coef_max is set to 0


@dataclass
class CoefCall:
    """The coefficient for the coming steps, what the rule did (raise, decay, hold) and why."""
    coef: float
    prev: float
    action: str
    reason: str
    effect: float = math.nan  # b, the change per unit coefficient (at the scheduler's lr)
    SE: float = math.nan


def horizon_increment(H_ahead: Sequence[tuple[int, float]], floor: float, b: float) -> float:
    """The smallest increase of c that keeps every point forecast ``H_k + k dc b`` (k steps ahead) on or
    above the floor: ``max_k (floor - H_k) / (k b)`` over the forecasts below it (0 when none; ``b > 0``)."""
    return max([(floor - H) / (k * b) for k, H in H_ahead if H < floor], default=0.0)


def decide_coef(c_now: float, c_max: float, d: float, se: float, edge: float | None, b: float, b_se: float,
                z: float, recovery: float, crossing: bool = False, floor: float | None = None,
                H_ahead: Sequence[tuple[int, float]] = (), past_ceiling: bool = False) -> CoefCall:
    """The coefficient for the next steps (module docstring). ``d`` +- ``se``: the step's prediction at
    ``c_now`` and the scheduler's lr; ``b`` +- ``b_se``: the change per unit c; ``crossing``: a resolved
    forecast fall below ``floor`` within the horizon, ``H_ahead`` the point forecasts ``(k, H_k)``;
    ``past_ceiling``: entropy above the guard's ceiling, or resolved to rise past it (the coefficient goes to 0)."""
    base = {"prev": c_now, "effect": b, "SE": b_se}
    below = edge is not None and d + z * se < edge
    if past_ceiling and not (below or crossing):  # a bonus only raises entropy: none at all past the ceiling
        return CoefCall(0.0, action="decay" if c_now > 0 else "hold", reason=(
            f"deltaH_pred {d:+.3e} +- {se:.1e}: entropy above the ceiling or resolved to rise past it: "
            f"coefficient {c_now:.3g} -> 0"), **base)
    if below or crossing:
        why = (f"deltaH_pred {d:+.3e} +- {se:.1e} below the edge {edge:+.3e}" if below else
               "a resolved forecast fall below the floor")
        if not (b - z * b_se > 0):
            return CoefCall(c_now, action="hold", reason=(
                f"{why}, but the bonus's effect {b:+.3e} +- {b_se:.1e} a unit is not resolved > 0: coefficient "
                f"held at {c_now:.3g}"), **base)
        up = max((edge - d) / b if below else 0.0, horizon_increment(H_ahead, floor, b) if floor is not None else 0.0)
        c = min(max(c_now + up, 0.0), c_max)
        return CoefCall(c, action="raise" if c > c_now else "hold", reason=(
            f"{why}; the bonus moves it {b:+.3e} +- {b_se:.1e} a unit: coefficient {c_now:.3g} -> {c:.3g}"
            + ("" if c < c_max else f" (entropy_coef_max {c_max:g})")), **base)
    ahead = floor is not None and any(H < floor for _, H in H_ahead)
    if (edge is None or d - z * se >= edge) and not ahead:
        c = c_now / recovery
        c = 0.0 if c < OFF_FRACTION * c_max else c
        return CoefCall(c, action="decay" if c < c_now else "hold", reason=(
            f"deltaH_pred {d:+.3e} +- {se:.1e} inside the band: coefficient {c_now:.3g} -> {c:.3g}"), **base)
    return CoefCall(c_now, action="hold", reason=(
        f"deltaH_pred {d:+.3e} +- {se:.1e}: its interval holds the edge"
        + (" or a point forecast is below the floor" if ahead else "") + f": coefficient held at {c_now:.3g}"), **base)


def coef_call(rule, p, c_now: float, edge: float | None) -> CoefCall:
    """``decide_coef`` on the pending prediction ``p`` (``OnlineProbe.pending``: at the scheduler's lr, with
    ``bonus_effect``) for ``rule`` (a ``guard.GuardRule`` with ``entropy_coef_max``), ``edge`` its band's edge;
    with ``rule.horizon``, the forecasts k = 1..K at factor 1 (guard_forecast.py's)."""
    crossing, H_ahead = False, ()
    if rule.horizon is not None and p.forecast is not None:
        fcs = [(k, p.forecast(k, 1.0)) for k in range(1, rule.horizon + 1)]
        crossing = any(f["pop_high"] < rule.floor and f["dH_high"] < 0 for _, f in fcs)
        H_ahead = [(k, f["H"]) for k, f in fcs]
    ceiling = getattr(rule, "ceiling", None)
    past = ceiling is not None and (p.H > ceiling or p.deltaH_pred - rule.z * p.SE > ceiling - p.H)
    return decide_coef(c_now, rule.entropy_coef_max, p.deltaH_pred, p.SE, edge, p.bonus_effect, p.SE_bonus_effect,
                       rule.z, rule.recovery, crossing, rule.floor, H_ahead, past)


def coef_text(call) -> str:
    """``entropy_coef 0.02 -> 0.05 (raise; bonus effect +1.2e-01 +- 3e-02 a unit)``."""
    return (f"entropy_coef {call.prev:.3g} -> {call.coef:.3g} ({call.action}; bonus effect {call.effect:+.2e} +- "
            f"{call.SE:.1e} a unit)")


def loaded_coef(state: dict, c_max: float) -> float:
    """The coefficient of a saved guard state (``EntropyGuard.state_dict``; 0 in a state saved without the
    knob), refused when no guard with this ``entropy_coef_max`` could have set it."""
    c = state.get("entropy_coef", 0.0)
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0 <= c <= c_max:
        raise ConfigError(f"EntropyGuard state: 'entropy_coef' {c!r} is not in [0, entropy_coef_max] = [0, {c_max:g}]: "
                          "resume with the guard's own entropy_coef_max")
    return float(c)


def coef_error(entropy_coef_max, start, floor, max_decay) -> str | None:
    """What is wrong with the knob's settings together (each alone is checked by ``guard.param_error``)."""
    if entropy_coef_max is None:
        return None if start is None else (f"entropy_coef={start!r} is the bonus knob's starting coefficient: "
                                           "give entropy_coef_max too (the knob is off without it)")
    if floor is None and max_decay is None:
        return (f"entropy_coef_max={entropy_coef_max!r}: the bonus knob holds entropy to the band: give floor or "
                "max_decay")
    if start is not None and start > entropy_coef_max:
        return f"entropy_coef={start!r} is above entropy_coef_max={entropy_coef_max!r}: start at or below the max"
    return None


def check_trl_bonus(trainer, source: str, rule) -> None:
    """What the entropy bonus knob needs of a GRPOTrainer, refused before training: TRL's bonus (its
    ``entropy_coef``, TRL 1.16), not its adaptive rule, the probe's ``source="rollouts"``, one micro-batch
    a step (TRL's bonus is a mean over each micro-batch's tokens)."""
    import trl

    a, what = trainer.args, f"EntropyGuard: entropy_coef_max={rule.entropy_coef_max:g}"
    if not (hasattr(trainer, "entropy_coef") and hasattr(trainer, "_entropy_bonus_enabled")):
        raise ConfigError(f"{what} sets GRPOTrainer's entropy bonus (trainer.entropy_coef), which TRL {trl.__version__} "
                          "does not have: use TRL 1.16 or later")
    if getattr(a, "use_adaptive_entropy", False):
        raise ConfigError(f"{what} and GRPOConfig.use_adaptive_entropy=True would both set trainer.entropy_coef: "
                          "use one (use_adaptive_entropy=False with the guard's knob)")
    if source != "rollouts":
        raise ConfigError(f"{what} reads the bonus's effect on the step's own batch: use source='rollouts'")
    if a.gradient_accumulation_steps != 1:
        raise ConfigError(f"{what}: GRPOConfig.gradient_accumulation_steps={a.gradient_accumulation_steps}: TRL's bonus "
                          "is a mean over each micro-batch's tokens, which the probe does not split: use 1")
