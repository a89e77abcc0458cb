"""EntropyGuard's rule on the forecast (``horizon=K``, needs the online probe's ``source="rollouts"``):
act before the floor is crossed, not on the step that crosses it.

At a probe, with the forecast of the entropy k = 1..K steps ahead at the scheduler's lr (factor 1:
``forecast.forecast``: H_k and the population's 95% interval, whose upper bound ``pop_high``):

- a crossing is *resolved* when for some k <= K the upper bound is below the floor, ``pop_high_k <
  floor``, and the change is resolved to lower the entropy, ``dH_high_k < 0`` (the population's
  entropy, not a logged batch's: nothing is done on the noise of one batch, nor on an interval that
  holds the floor; and below the floor nothing is cut unless the forecast falls: a smaller lr only
  slows a rise, as in the one-step rule). The bounds are clipped to the entropy's range, and a bound
  below 0 clipped to 0 is below any floor > 0 as before;
- the factor is then the largest that keeps every point forecast on or above the floor: each part of
  the forecast change is proportional to the lr held over the horizon, so at factor f ``H_k(f) = H0 +
  f dH_k`` (H0 the level the forecast starts from: the run's filtered entropy, integrations/online_filter.py,
  or the probe's H before the filter has enough history) and ``f = min over k <= K with dH_k < 0 of (floor - H) / dH_k``, clamped to ``[min_factor,
  max_factor]`` (``min_factor`` when H is already below the floor: no lr > 0 turns a fall into a rise);
- otherwise the one-step rule decides (``guard.decide``), and a factor it would raise is held at the
  largest whose point forecasts stay above the floor (no recovery into a forecast crossing; below
  the floor: held while any point forecast k <= K falls, raised when none does).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ForecastCall:
    """What the horizon rule acted on: the horizon step ``k`` that decided (the first resolved to fall
    below the floor; else the one with the lowest forecast), its forecast at factor 1 (``H``, the
    population's interval ``low``/``high``) and the factor it allows."""
    k: int
    H: float
    low: float
    high: float
    factor: float  # the largest factor whose point forecasts stay >= floor (inf: none falls)
    resolved: bool  # some k <= K has its interval below the floor and its change resolved below 0

    def text(self, floor: float) -> str:
        return (f"forecast {self.k} step(s) ahead H {self.H:.4g} [{self.low:.4g}, {self.high:.4g}] at the scheduler's "
                f"lr ({'a' if self.resolved else 'no'} resolved fall below the floor {floor:g})")


def forecast_call(forecast_at: Callable[[int, float], dict], H: float, floor: float, horizon: int) -> ForecastCall:
    """The forecasts k = 1..horizon at factor 1 against the floor (module docstring)."""
    fcs = {k: forecast_at(k, 1.0) for k in range(1, horizon + 1)}
    below = [k for k, f in fcs.items() if f["pop_high"] < floor and f["dH_high"] < 0]
    # from the level the forecast starts at (``H0``: the run's filtered entropy; else the probe's H)
    limits = [(floor - f.get("H0", H)) / f["dH"] for f in fcs.values() if f["dH"] < 0]
    factor = min(limits) if limits else math.inf
    k = below[0] if below else min(fcs, key=lambda j: fcs[j]["H"])
    f = fcs[k]
    return ForecastCall(k, f["H"], f["pop_low"], f["pop_high"], factor, bool(below))
