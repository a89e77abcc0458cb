"""The online probe's forecast over the run (``source="rollouts"``): math/entropy_filter.py's filter,
fed by every probe (its H, predicted changes and fresh part) and by the entropy the trainer logs at
every step (``OnlineProbe.observe_entropy``; ``python -m entprobe.train`` and the TRL callback feed it).

Until the run has given enough (``MIN_PROBES`` probes and ``MIN_OBSERVED`` logged entropies since
the first probe: without the trainer's logged entropy, never) the forecast is the one-batch one (math/forecast.py: still valid, wider);
then the filter's, with a normal quantile (its variances come from many batches).

Steps: a probe at step p predicts step p (the step about to be taken) from the batch whose entropy
the trainer logs as step p's: that entry observes the entropy after p - 1 steps. The forecast k steps
ahead is of the entropy logged at step p + k.
"""
from __future__ import annotations

import math

from entprobe.math import entropy_filter as ef
from entprobe.math import forecast as fc

MIN_PROBES = 3  # probes pooled before the filter's forecast replaces the one-batch one
MIN_OBSERVED = 2  # logged entropies (observe) since the first probe before it does
FORGET = 0.95  # lambda: a step's discount of older probes and errors (memory ~ 1 / (1 - lambda) = 20 steps)
PRIOR_ERRORS = 4.0  # n0: pseudo-errors of size 1 in the run's calibration of the SE (run_scale)
STORED = 32  # predicted changes kept per probe to move the level between probes (the last one repeats)
Z95 = 1.959963984540054
GAIN_PRIOR = 1.0  # the prior SD of the gain on the predicted changes (its mean: 1)


class RunFilter:
    """The filter's state and its forecast (module docstring). ``observe(step, H)`` an entropy the
    trainer logged; ``on_probe(step, f, lr)`` a probe's ``ForecastInputs`` (None: no forecast);
    ``forecast_at(k, factor)`` the forecast dict of math/forecast.py's ``forecast``, ``results(factor)``
    its ``forecast_H_k*`` keys; ``rescale(factor)`` the probe's step is taken at factor x its lr."""

    def __init__(self, forget: float = FORGET, prior_errors: float = PRIOR_ERRORS):
        self.forget, self.prior_errors = forget, prior_errors
        self.u_taken: list[list[float]] = []  # [step, its predicted change at the factor taken]: the last few
        self.last_obs: list[list[float]] = []  # [step, H]: the last two observed
        self.lag_errors: list[list[list[float]]] = [[], []]  # [step, e^2]: realised - predicted over 1, 2 steps
        self.m: list[float] | None = None  # (level after `n` steps, the gain on the predicted changes)
        self.P: list[list[float]] | None = None
        self.n = 0  # the steps the level is after
        self.observed_to = 0  # the last step whose logged entropy was used (a probe's batch included)
        self.n_observed = 0
        self.R = 0.0  # a batch's sampling variance (the last probe's)
        self.q_gain = (1 - self.forget) ** 2 * GAIN_PRIOR ** 2  # the gain's random walk a step: memory ~ 1 / (1 - lambda)
        self.probes: list[list[float]] = []  # [step, Gamma / lr, its variance / lr^2]
        self.steps_u: list[float] = []  # the last probe's predicted changes of its steps p, p + 1, ... (factor 1)
        self.q_u = 0.0  # their variance, one step (factor 1)
        self.u_from = 0  # the step steps_u[0] predicts
        self.factor = 1.0
        self.errors: dict[int, list[list[float]]] = {k: [] for k in fc.HORIZONS}  # [step, y - mean, SE]
        self.checks: list[list[float]] = []  # [target step, k, mean, SE]: forecasts waiting for their value
        self._f: fc.ForecastInputs | None = None
        # pooled_changes' (Gamma pooled, at this probe's lr; the pool's variance this batch's rows do not
        # show; this batch's weight in the pool)
        self._pool = (0.0, 0.0, 1.0)

    # ---- the run's observations -------------------------------------------------------------
    def _advance(self, n: int) -> None:
        """Move the level to after n steps by the last probe's predicted changes (each step's kept:
        the run's noise is measured against them)."""
        q_x = self.noise()[0]
        while self.n < n:
            j = self.n + 1 - self.u_from  # step n + 1 is the probe's j-th (0: its own)
            u = self.steps_u[min(max(j, 0), len(self.steps_u) - 1)] if self.steps_u else 0.0
            f = self.factor
            change = f * u * self.m[1]  # the model's predicted change of this step
            self.m, self.P = ef.kalman_predict(self.m, self.P, 0.0, f * u, f * f * self.q_u + q_x, self.q_gain)
            self.n += 1
            self.u_taken = [x for x in self.u_taken if x[0] > self.n - 3] + [[self.n, change]]

    def _observe_level(self, step: int, H: float, R: float) -> None:
        """``H`` observes the level after step - 1 steps: the Kalman update, and the realised-minus-
        predicted changes since the last two observations (the run's noise, ``noise``)."""
        self._advance(step - 1)
        u = {s: x for s, x in self.u_taken}
        for s0, y0 in self.last_obs:
            lag = step - s0
            if lag in (1, 2) and all(s in u for s in range(s0, step)):
                self.lag_errors[lag - 1].append([step, (H - y0 - sum(u[s] for s in range(s0, step))) ** 2])
        self.lag_errors = [[e for e in es if self.forget ** (step - e[0]) > 1e-3] for es in self.lag_errors]
        self.last_obs = [o for o in self.last_obs if o[0] > step - 2] + [[step, H]]
        self.m, self.P = ef.kalman_update(self.m, self.P, H, max(R, self.noise()[1]))
        self.observed_to = step

    def noise(self) -> tuple[float, float]:
        """``variogram_noise`` of the run's realised-minus-predicted changes over 1 and 2 steps (their
        ``robust_square_mean``s): (the step noise the predictions leave out, the logged entropy's noise)."""
        now = self.observed_to
        a1, a2 = (ef.robust_square_mean([e[1] for e in es], [now - e[0] for e in es], self.forget) for es in self.lag_errors)
        return ef.variogram_noise(a1, a2) if self.lag_errors[1] else (0.0, 0.0)

    def observe(self, step: int, H: float) -> None:
        """The entropy the trainer logged at ``step`` (its batch, sampled after step - 1 steps)."""
        if not math.isfinite(H):
            return
        for target, k, mean, se in [c for c in self.checks if c[0] == step]:  # their errors calibrate the SE
            if se > 0:
                self.errors[int(k)].append([step, H - mean, se])
        self.checks = [c for c in self.checks if c[0] > step]
        self.errors = {k: [e for e in es if self.forget ** (step - e[0]) > 1e-3] for k, es in self.errors.items()}
        if self.m is None:  # before the first probe
            return
        self.n_observed += 1
        if step > self.observed_to:  # (a probe's own batch observed the level already)
            self._observe_level(step, H, self.R)

    def on_probe(self, step: int, f: fc.ForecastInputs | None, lr: float) -> dict:
        """A probe at ``step``: its batch's H observes the level after step - 1 steps; its fresh part
        joins the pool; its predicted changes move the level from now. Returns ``results(1)``."""
        self._f = f
        if f is None:
            return {}
        self.R = f.var_H
        if self.m is None:  # the first probe: the level is its batch's H, the gain's prior N(1, GAIN_PRIOR^2)
            self.m, self.P, self.n = [f.H, 1.0], [[f.var_H, 0.0], [0.0, GAIN_PRIOR ** 2]], step - 1
            self.observed_to, self.last_obs = step, [[step, f.H]]
        else:
            self._observe_level(step, f.H, f.var_H)
        self.factor = 1.0
        gram = fc.centred_gram(f.grad_rows.reshape(1, -1))
        v = fc.jackknife_variance(gram, [1.0], f.grad_rows.numel())
        self.probes = [p for p in self.probes if self.forget ** (step - p[0]) > 1e-3][-63:]
        self.probes.append([step, f.grad / lr, v / lr ** 2])
        g, var, w, _ = ef.pool([p[1] for p in self.probes], [p[2] for p in self.probes],
                               [step - p[0] for p in self.probes], self.forget)
        # this batch's share of the pool's variance is in its rows (pooled_changes): the rest is not
        self._pool = (lr * g, lr * lr * max(var - w[-1] ** 2 * v / lr ** 2, 0.0), w[-1])
        series = ef.pooled_changes(f, range(1, STORED + 1), 1.0, *self._pool)
        U = [pts[1] for pts, _ in series]
        self.steps_u, self.u_from, self.q_u = [U[0]] + [b - a for a, b in zip(U, U[1:])], step, series[0][1]
        return self._register(step)

    def rescale(self, factor: float) -> dict:
        """The probe's step (and the steps after it, until the next probe) at ``factor`` x its lr."""
        if self._f is None:
            return {}
        self.factor = factor
        self.checks = [c for c in self.checks if c[0] - c[1] != self.u_from]
        return self._register(self.u_from, factor)

    def _register(self, step: int, factor: float = 1.0) -> dict:
        """The forecasts at the logged horizons, kept to be checked against the entropy logged then."""
        for k in fc.HORIZONS:
            r = self._model(k, factor)
            self.checks.append([step + k, k, r[0], math.sqrt(r[1] + max(self.R, self.noise()[1]))])
        return self.results(factor)

    # ---- the forecast ---------------------------------------------------------------------------
    def active(self) -> bool:
        """Whether the run has given enough for the filter's forecast (module docstring)."""
        return len(self.probes) >= MIN_PROBES and self.n_observed >= MIN_OBSERVED

    def _model(self, k: int, factor: float) -> tuple[float, float, float, float, float]:
        """(mean, Var level, Var change, band low, band high) of the entropy k steps after the probe's."""
        (points, V), = ef.pooled_changes(self._f, (k,), factor, *self._pool)
        q_x, _ = self.noise()  # the run's own noise a step, on top of the prediction's: a random walk over k
        V = V * (self.m[1] ** 2 + self.P[1][1])  # beta U_k: U_k's own variance times E beta^2
        mean, var, var_dH = ef.horizon_moments(self.m, self.P, 0.0, points[1], V + k * q_x)
        return mean, var, var_dH, min(points) - points[1], max(points) - points[1]

    def scale(self, k: int) -> float:
        """``run_scale`` at horizon k of the errors ``(y - mean) / SE`` of the forecasts made at the
        logged horizons, linear in k between them (the last one's beyond it)."""
        now = self.u_from
        c = {h: ef.run_scale([(e[1] / e[2]) ** 2 for e in es], [now - e[0] for e in es], self.forget,
                             self.prior_errors) for h, es in self.errors.items()}
        hs = sorted(c)
        if k <= hs[0] or k >= hs[-1]:
            return c[hs[0] if k <= hs[0] else hs[-1]]
        lo, hi = max(h for h in hs if h <= k), min(h for h in hs if h >= k)
        return c[lo] if hi == lo else c[lo] + (c[hi] - c[lo]) * (k - lo) / (hi - lo)

    def forecast_at(self, k: int, factor: float = 1.0) -> dict:
        """math/forecast.py's ``forecast`` dict k steps ahead at factor x the lr (and ``H0``, the level
        it starts from), the filter's once ``active()``, else the one-batch forecast."""
        f = self._f
        if not self.active():
            return {**fc.forecast(f, k, factor), "H0": f.H}
        mean, var, var_dH, lo, hi = self._model(k, factor)
        c = self.scale(k)
        R = max(self.R, self.noise()[1])
        se_pop, se_log, se_dH = c * math.sqrt(var), c * math.sqrt(var + R), c * math.sqrt(var_dH)
        L, q = self.m[0], Z95
        return {"H": fc.clip_to(mean, f.H_max), "dH": mean - L, "SE": se_pop, "SE_logged": se_log, "H0": L,
                "low": fc.clip_to(mean + lo - q * se_log, f.H_logged_max),
                "high": fc.clip_to(mean + hi + q * se_log, f.H_logged_max),
                "pop_low": fc.clip_to(mean + lo - q * se_pop, f.H_max), "pop_high": fc.clip_to(mean + hi + q * se_pop, f.H_max),
                "dH_low": mean - L + lo - q * se_dH, "dH_high": mean - L + hi + q * se_dH}

    def results(self, factor: float = 1.0) -> dict:
        """``forecast_H_k<k>`` (``_low`` / ``_high``) and ``SE_forecast_H_k<k>`` at the logged horizons."""
        if self._f is None:
            return {}
        if not self.active():
            return fc.forecast_results(self._f, factor)
        out = {}
        for k in fc.HORIZONS:
            r = self.forecast_at(k, factor)
            out.update({f"forecast_H_k{k}": r["H"], f"forecast_H_k{k}_low": r["low"],
                        f"forecast_H_k{k}_high": r["high"], f"SE_forecast_H_k{k}": r["SE"]})
        return out

    # ---- resume -------------------------------------------------------------------------------
    KEYS = ("m", "P", "n", "observed_to", "n_observed", "R", "probes", "steps_u", "q_u", "u_from", "factor",
            "checks", "u_taken", "last_obs", "lag_errors")

    def state_dict(self) -> dict:
        """The filter's state, plain numbers and lists (JSON: a checkpoint's ``trainer_state.json``)."""
        return {**{k: getattr(self, k) for k in self.KEYS}, "errors": {str(k): v for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        from entprobe.config import ConfigError

        missing = [k for k in (*self.KEYS, "errors") if k not in state]
        if missing:
            raise ConfigError(f"the online probe's filter state: missing {', '.join(missing)} (a state saved by "
                              "OnlineProbe.state_dict())")
        for k in self.KEYS:
            setattr(self, k, state[k])
        self.errors = {int(k): v for k, v in state["errors"].items()}
        self._f = None

