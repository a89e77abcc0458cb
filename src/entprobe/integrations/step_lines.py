"""The one line printed per probed step (``python -m entprobe.train``, ``EntropyGuardCallback``): what
was predicted, on which batch and at which lr, and, when the step was measured, the two numbers the
consistency check compares.

    step 7: predicted +8.58e-02 ± 3.9e-02 from the step's rollouts (H 0.298); measured on held-out E
    (H 0.386) -6.88e-02 ± 1.8e-02 vs predicted on E -5.84e-02: consistent (0.1 s)

With ``source="rollouts"`` the headline prediction is the population's change estimated from the
step's own batch, and the measurement is made on a fresh held-out E, so the consistency check pairs
it with E's own prediction (``deltaH_pred_E``), not with the headline: the line names both numbers.
Each ``H`` says whose entropy it is (the step's rollouts, or held-out E). A guarded step is one line
too, its prediction at the lr the step used (the guard's factor applied), prefixed by the decision.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

ROLLOUTS, HELD_OUT = "the step's rollouts", "held-out E"  # whose entropy an H is


def _g(m: Mapping, key: str) -> float:
    v = m.get(f"entprobe/{key}", m.get(key))
    return math.nan if v is None else float(v)


def _pm(v: float, se: float) -> str:
    return f"{v:+.3e} ± {se:.1e}"


def measured_text(m: Mapping, source: str, H_E: float | None = None) -> str:
    """The measurement's part of the line: ``measured [on held-out E (H ..)] d ± se vs predicted [on E]
    p: consistent`` (``inconsistent``; ``not compared (unmeasurable ...)`` when the importance weights
    could not measure the step), or ``not measured`` when nothing was (``pred_consistent`` absent).
    ``m``: the probe's metrics (``entprobe/<key>`` or plain keys); ``H_E``: E's entropy for a
    ``source="rollouts"`` line (the metrics' ``H_orig`` is then E's)."""
    if "entprobe/pred_consistent" not in m and "pred_consistent" not in m:
        return "not measured"
    rollouts = source == "rollouts"
    where = f" on {HELD_OUT} (H {H_E:.3g})" if rollouts and H_E is not None and math.isfinite(H_E) else \
        f" on {HELD_OUT}" if rollouts else ""
    against = f"predicted on E {_g(m, 'deltaH_pred_E'):+.3e}" if rollouts else f"predicted {_g(m, 'deltaH_pred'):+.3e}"
    c = _g(m, "pred_consistent")
    if c != c:  # NaN: no test was made
        return f"measured{where}: unmeasurable (too few effective importance weights), not compared with the {against}"
    verdict = "consistent" if c else "inconsistent"
    return f"measured{where} {_pm(_g(m, 'deltaH_true'), _g(m, 'SE_deltaH_true'))} vs {against}: {verdict}"


def predicted_text(m: Mapping, source: str, H: float, at_used_lr: bool = False) -> str:
    """``predicted d ± se [at that lr] from the step's rollouts (H ..)`` / ``on held-out E (H ..)``; ``H``
    the entropy at theta of the batch the prediction is made from."""
    batch = f"from {ROLLOUTS}" if source == "rollouts" else f"on {HELD_OUT}"
    h = f" (H {H:.3g})" if math.isfinite(H) else ""
    lr = " at that lr" if at_used_lr else ""
    if _g(m, "update_zero") == 1:
        return f"predicted 0 exactly {batch}{h}: the update is exactly zero (every group tied, nothing carried)"
    tied = "; every group tied: the gradient is 0, only momentum and weight decay move" if _g(m, "gradient_zero") == 1 else ""
    return f"predicted {_pm(_g(m, 'deltaH_pred'), _g(m, 'SE_deltaH_pred'))}{lr} {batch}{h}{tied}"


def probe_line(step: int, m: Mapping, source: str = "held_out", H_rollouts: float | None = None,
               decision=None, rule=None) -> str:
    """The step's line (module docstring) from the probe's metrics ``m`` (after the step; without
    ``pred_consistent``: ``not measured``). ``H_rollouts``: the step's batch's entropy for
    ``source="rollouts"`` (``OnlineProbe.pending.H`` before ``after_step``; the metrics' ``H_orig``
    is E's once E was measured). ``decision`` / ``rule``: the guard's ``Decision`` of this step and its
    ``GuardRule``: the line starts with the decision and the lr it set, and its prediction is the
    one of the step at that lr (the probe's, rescaled by the guard)."""
    H_E = _g(m, "H_orig")
    if source == "rollouts":
        H_pred = H_rollouts if H_rollouts is not None else (H_E if "entprobe/deltaH_pred_E" not in m else math.nan)
    else:
        H_pred = H_E
    parts = [predicted_text(m, source, H_pred, at_used_lr=decision is not None)]
    if decision is not None:
        parts.insert(0, guard_text(decision, rule, _g(m, "lr")))
        fc = getattr(decision, "forecast", None)
        if fc is not None and rule is not None:
            parts.append(fc.text(rule.floor))
    parts.append(measured_text(m, source, H_E))
    t = _g(m, "time_s")
    return f"step {step}: " + "; ".join(parts) + (f" ({t:.1f} s)" if math.isfinite(t) else "")


def guard_text(decision, rule, lr: float) -> str:
    """``guard cut: lr x0.05 = 5.00e-05 (was x1; floor 0.2, max_decay 0.05)``: the decision's action, the
    factor it set and the lr the step used (``lr``: the probe's, already the factor's), the rule's limits."""
    limits = rule.limits() if rule is not None else ""  # guard.GuardRule's
    used = f" = {lr:.3g}" if math.isfinite(lr) else ""
    return f"guard {decision.action}: lr x{decision.factor:.3g}{used} (was x{decision.prev:.3g}{limits})"
