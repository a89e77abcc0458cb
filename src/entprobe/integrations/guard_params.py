"""EntropyGuard's parameters: each one's range (``PARAM_RANGES``) and the check of a value against it
(``param_error``), shared by ``GuardRule`` and the command lines that take them."""
from __future__ import annotations

import math
import numbers

# the horizon's largest value: each decision reads the forecast of every k = 1..K (its cost grows with
# K: ~12 ms at K = 100 on one core), and the forecast is first order at theta from one step's batch,
# checked to 10 steps ahead (docs/forecast.md): a horizon beyond 100 steps extrapolates a tangent
MAX_HORIZON = 100
INTEGER_PARAMS = ("horizon",)


# each parameter's range (GuardRule): (may be None, test of a finite number, what it must be)
PARAM_RANGES = {
    "floor": (True, lambda v: v >= 0, "the lowest entropy to hold, in nats: a finite number >= 0 (entropy is "
              "never negative, so a floor below 0 never acts)"),
    "max_decay": (True, lambda v: v >= 0, "the largest entropy decrease per step, in nats: a finite number >= 0 "
                  "(0: no decrease allowed)"),
    "target_deltaH": (True, lambda v: v != 0, "the change to steer each step to, in nats: a finite nonzero number "
                      "(no lr > 0 scales a nonzero predicted change to 0; max_decay=0 allows no decrease)"),
    "z": (False, lambda v: v >= 0, "the resolution a prediction needs before the guard acts: a finite number >= 0"),
    "min_factor": (False, lambda v: 0 < v <= 1, "the smallest lr factor: a number in (0, 1]"),
    "max_factor": (False, lambda v: v >= 1, "the largest lr factor: a finite number >= 1"),
    "recovery": (False, lambda v: v > 1, "the factor's geometric return to 1 per probe: a finite number > 1"),
    "horizon": (True, lambda v: 1 <= v <= MAX_HORIZON, "the steps ahead the entropy forecast must stay above "
                f"the floor: an integer from 1 to {MAX_HORIZON} (the forecast is first order, checked to 10 steps "
                "ahead, and each decision computes every step up to it)"),
    "entropy_coef_max": (True, lambda v: v > 0, "the entropy bonus's largest coefficient: a finite number > 0"),
    "entropy_coef": (True, lambda v: v >= 0, "the entropy bonus's starting coefficient: a finite number >= 0"),
    "ceiling": (True, lambda v: v > 0, "the highest entropy to hold, in nats: a finite number > 0 (above the floor)"),
}


def param_error(name: str, value, leave_out: str = "None to leave it out") -> str | None:
    """What is wrong with ``value`` for the guard's parameter ``name`` (``PARAM_RANGES``): not a
    number (a string, a bool, ...), not an integer for ``INTEGER_PARAMS`` (``horizon``: 5, not 5.0),
    not finite, out of range; None when it is fine. ``leave_out``: how the caller leaves an optional
    parameter out (said with its range)."""
    optional, ok, what = PARAM_RANGES[name]
    what += f" (or {leave_out})" if optional else ""
    if value is None:
        return None if optional else f"must be {what}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"is a {type(value).__name__}, not a number; give {what}"
    if name in INTEGER_PARAMS and not isinstance(value, numbers.Integral):
        return f"is a {type(value).__name__}, not an integer; give {what}"
    finite = isinstance(value, numbers.Integral) or math.isfinite(value)  # (10**400 has no float)
    if not (finite and ok(value)):  # NaN compares False: a guard that never acts
        return f"must be {what}"
    return None
