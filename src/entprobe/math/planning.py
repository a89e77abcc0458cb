"""Pure math of the batch-size planner (docs/planning.md): the sizes that reach a target standard
error at the least cost, and the U-statistic's variance components from a sweep over B.

No config, no I/O. A *side* is a set of independent units (the prompts of E, of U, or of the single
batch) whose sample mean enters an estimate; with ``var_unit`` the variance of one unit's
projection, the side contributes ``var_unit / B`` to the estimate's squared standard error:

    SE^2(B_1, ..., B_k) = sum_i var_i / B_i

(the two-batch probe's SEs, ``V_X + V_Y`` for deltaH1 and ``Var(mean e) [+ Var(mean u)]`` for the
prediction, have exactly this form; see ``estimators.two_batch_variance`` and
``stages.prediction.prediction_results``). Minimising the cost ``sum_i c_i B_i`` subject to
``SE <= target`` (Lagrange) gives

    B_i = sqrt(var_i / c_i) * sum_j sqrt(var_j c_j) / target^2,   cost = (sum_j sqrt(var_j c_j))^2 / target^2,

each B_i rounded up (so the SE stays at or below the target). Sides held at their size (``fixed``)
spend part of the budget first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from entprobe.math import estimators as est

MIN_UNITS = 2  # a sample variance needs two units
MAX_UNITS = 2 ** 53  # a plan needing more units than this (exact float integers) is not reachable
TARGET_SE_RANGE = (1e-150, 1e150)  # its square (the variance budget) is a positive, finite float


def target_se_problem(target_se: float) -> str | None:
    """Why ``target_se`` cannot be planned for (not a finite positive number in ``TARGET_SE_RANGE``,
    where its square neither overflows nor rounds to 0), or None."""
    lo, hi = TARGET_SE_RANGE
    if not (isinstance(target_se, (int, float)) and math.isfinite(target_se) and target_se > 0):
        return f"target_se={target_se} must be a positive number (finite: the standard error wanted, in nats)"
    if not lo <= target_se <= hi:
        return (f"target_se={target_se:.3g} is outside [{lo:.0e}, {hi:.0e}] (its square, the variance budget, "
                "would overflow or round to 0); give the standard error wanted in nats, e.g. target_se=0.01")
    return None


def _units(exact: float, name: str, target_se: float) -> int:
    """``exact`` units rounded up (at least ``MIN_UNITS``); a ValueError when it is not finite or
    above ``MAX_UNITS`` (no batch reaches such a target)."""
    if not exact <= MAX_UNITS:  # inf and nan too
        raise ValueError(f"target_se={target_se:.3g} would need {name} = {exact:.3g} units (more than "
                         f"{MAX_UNITS:.3g}): not reachable; ask for a larger target_se")
    return max(MIN_UNITS, math.ceil(exact * (1 - 1e-12)))  # no extra unit from rounding noise


@dataclass(frozen=True)
class Side:
    """One batch's contribution to an estimate's variance: ``var_unit / B``."""

    name: str  # "B_E", "B_U" (two-batch) or "B" (single-batch)
    B: int  # units now (prompts; blocks of ``prompts_per_unit`` prompts in block mode)
    var_unit: float  # variance of one unit's projection (SE^2 = var_unit / B)
    cost_unit: float  # cost of one unit, in sequences (G; k G for blocks of k prompts)
    fixed: bool = False  # held at B: the estimate's SE does not depend on it, or the caller keeps it
    rel_se_var: float = math.nan  # relative SE of var_unit's estimate (from the units' fourth moment)


def unit_variance(x: torch.Tensor) -> float:
    """Sample variance of the per-unit values x (divides by B - 1): ``B * Var(mean x)``."""
    return x.numel() * est.mean_variance(x.double())


def variance_rel_se(x: torch.Tensor) -> float:
    """Relative standard error of the sample variance s^2 of x, ``sqrt(2/(B-1) + k/B)`` with k the
    excess kurtosis (its small-sample adjusted estimate G2): sqrt(2/(B-1)) for normal units.
    Heavy tails (a few units carrying most of the sum of squares) make it larger, and a sample of
    B units under-estimates them, so for such units it is a floor: measured on exponential units
    at B = 40, 0.35 against an actual 0.44 (tests/test_plan.py). nan for B < 4."""
    x = x.double()
    n = x.numel()
    if n < 4:
        return math.nan
    c = x - x.mean()
    m2, m4 = float((c ** 2).mean()), float((c ** 4).mean())
    if m2 <= 0:
        return math.nan
    g2 = m4 / (m2 * m2) - 3
    G2 = ((n + 1) * g2 + 6) * (n - 1) / ((n - 2) * (n - 3))
    return math.sqrt(max(2 / (n - 1) + G2 / n, 0.0))


def standard_error(sides: Sequence[Side], sizes: dict[str, int] | None = None) -> float:
    """``sqrt(sum_i var_i / B_i)`` at ``sizes`` (default: the sides' current sizes)."""
    return math.sqrt(sum(max(s.var_unit, 0.0) / (sizes or {}).get(s.name, s.B) for s in sides))


def se_rel_error(sides: Sequence[Side], sizes: dict[str, int]) -> float:
    """Relative SE of ``standard_error(sides, sizes)`` from the sampling error of the var_unit
    estimates (independent sides, delta method: half the variance's relative error)."""
    terms = [(max(s.var_unit, 0.0) / sizes.get(s.name, s.B), s.rel_se_var) for s in sides]
    total = sum(t for t, _ in terms)
    if total <= 0:
        return math.nan
    return 0.5 * math.hypot(*(t * r for t, r in terms if t > 0)) / total  # hypot: no overflow of (t r)^2


def optimal_sizes(sides: Sequence[Side], target_se: float) -> dict[str, int]:
    """The sizes of the non-fixed sides that reach ``SE <= target_se`` at the least cost
    ``sum c_i B_i`` (closed form above; each at least ``MIN_UNITS``). Raises ValueError, saying
    why, when the fixed sides alone exceed the target (then only those sides can lower the SE), when
    ``target_se`` is outside ``TARGET_SE_RANGE``, a variance is not finite, or a size would exceed
    ``MAX_UNITS``."""
    problem = target_se_problem(target_se)
    if problem:
        raise ValueError(problem)
    free = [s for s in sides if not s.fixed]
    if not free:
        raise ValueError("no batch size to plan: every side is held fixed")
    bad = [f"{s.name} ({s.var_unit})" for s in sides if not math.isfinite(s.var_unit)]
    if bad:
        raise ValueError(f"the per-unit variance of {', '.join(bad)} is not finite: the run's per-unit values "
                         "overflow or hold nan; rerun it")
    budget = target_se * target_se - sum(max(s.var_unit, 0.0) / s.B for s in sides if s.fixed)
    if budget <= 0:
        held = ", ".join(f"{s.name}={s.B}" for s in sides if s.fixed)
        raise ValueError(f"target_se={target_se:.3g} is below what the sides held fixed ({held}) give alone")
    total = sum(math.sqrt(max(s.var_unit, 0.0)) * math.sqrt(s.cost_unit) for s in free)
    return {s.name: _units(math.sqrt(max(s.var_unit, 0.0) / s.cost_unit) * total / budget, s.name, target_se)
            for s in free}


def cost_ratio(sides: Sequence[Side], sizes: dict[str, int]) -> float:
    """``sum c_i B_i'`` over ``sum c_i B_i`` (every side, fixed ones at their size): the planned
    batches' forward+backward cost in units of one forward+backward over the current batches."""
    now = sum(s.cost_unit * s.B for s in sides)
    return sum(s.cost_unit * sizes.get(s.name, s.B) for s in sides) / now


# ---------------------------------------------------------------- U-statistic: zeta_1 and zeta_2 from a sweep over B
def ustat_variance(zeta1: float, zeta2: float, B: int | float) -> float:
    """Exact variance of a complete degree-2 U-statistic on B units (Hoeffding):
    ``Var(U_B) = 2 (2 (B - 2) zeta1 + zeta2) / (B (B - 1))``, i.e.
    ``B Var(U_B) = 4 zeta1 + 2 (zeta2 - 2 zeta1) / (B - 1)``: zeta1 the variance of the kernel's
    one-unit projection, zeta2 the variance of the (symmetrised) kernel itself."""
    return 2 * (2 * (B - 2) * zeta1 + zeta2) / (B * (B - 1))


def ustat_jackknife_mean(zeta1: float, zeta2: float, B: int | float) -> float:
    """Expectation of the delete-1 jackknife variance of that U-statistic:
    ``E[Var_jack] = 4 zeta1 / B + 4 (zeta2 - 2 zeta1) / (B (B - 2))`` (the degenerate part is
    counted about twice: the jackknife is conservative, by O(1/B^2))."""
    return 4 * zeta1 / B + 4 * (zeta2 - 2 * zeta1) / (B * (B - 2))


class ZetaFit(NamedTuple):
    zeta1: float
    zeta2: float
    intercept: float  # 4 zeta1
    slope: float  # 2 (zeta2 - 2 zeta1) per 1/(B-1) (variances), 4 (zeta2 - 2 zeta1) per 1/(B-2) (jackknife)
    rel_rms_residual: float  # rms of (fit - B Var) / mean(B Var) over the points: the fit's own check
    n_points: int


def fit_zeta(B: Sequence[int], var: Sequence[float], estimator: str = "variance") -> ZetaFit:
    """Least-squares fit of the slope model ``B Var(U_B) = c0 + c1 x`` over a sweep of B.

    ``estimator="variance"``: ``var`` are (replicate) variances of U_B, ``x = 1/(B - 1)``,
    ``c0 = 4 zeta1``, ``c1 = 2 (zeta2 - 2 zeta1)`` (``ustat_variance``); ``"jackknife"``: ``var``
    are runs' squared jackknife SEs, ``x = 1/(B - 2)``, ``c1 = 4 (zeta2 - 2 zeta1)``
    (``ustat_jackknife_mean``). Needs two distinct B (three for a residual)."""
    if estimator not in ("variance", "jackknife"):
        raise ValueError(f"estimator must be 'variance' or 'jackknife', got {estimator!r}")
    Bt = torch.tensor([float(b) for b in B], dtype=torch.float64)
    v = torch.tensor([float(x) for x in var], dtype=torch.float64)
    if Bt.numel() != v.numel():
        raise ValueError("B and var differ in length")
    if bool((Bt < 3).any()):
        raise ValueError(f"every B must be >= 3 units (the jackknife needs 3), got {sorted(set(B))}")
    if len(set(Bt.tolist())) < 2:
        raise ValueError(f"the slope model needs runs at two or more distinct B, got B = {sorted(set(B))}")
    x = 1 / (Bt - (1 if estimator == "variance" else 2))
    y = Bt * v
    A = torch.stack([torch.ones_like(x), x], 1)
    c0, c1 = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()
    resid = (A @ torch.tensor([c0, c1], dtype=torch.float64) - y) / y.mean().abs().clamp(min=1e-300)
    zeta1 = c0 / 4
    zeta2 = 2 * zeta1 + c1 / (2 if estimator == "variance" else 4)
    return ZetaFit(zeta1, zeta2, c0, c1, float(resid.pow(2).mean().sqrt()), int(Bt.numel()))


def ustat_size_for(zeta1: float, zeta2: float, target_var: float) -> int:
    """The smallest B >= 3 with ``ustat_variance(zeta1, zeta2, B) <= target_var``: the larger
    root of ``t B^2 - (t + 4 zeta1) B + 8 zeta1 - 2 zeta2 = 0``, rounded up."""
    if not target_var > 0:
        raise ValueError(f"target variance must be positive, got {target_var}")
    if not (math.isfinite(zeta1) and math.isfinite(zeta2)):
        raise ValueError(f"the fitted zeta1 = {zeta1}, zeta2 = {zeta2} are not finite: the runs' SEs overflow or hold nan")
    t = target_var
    if t == math.inf:  # any B meets it
        return 3
    b = t + 4 * zeta1
    disc = b * b - 4 * t * (8 * zeta1 - 2 * zeta2)
    root = (b + math.sqrt(max(disc, 0.0))) / (2 * t)
    if not root <= MAX_UNITS:
        raise ValueError(f"it would need B = {root:.3g} units (more than {MAX_UNITS:.3g}): not reachable; ask for a "
                         "larger target_se")
    B = max(3, math.ceil(root * (1 - 1e-12)))
    while ustat_variance(zeta1, zeta2, B) > target_var:  # guards rounding at the root
        B += 1
    return B
