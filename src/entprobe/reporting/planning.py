"""Batch-size planner: the batch sizes that reach a target standard error, from a finished run.

    python -m entprobe.plan RUN_DIR target_se=0.01        # or: --target-se 0.01
    python -m entprobe.plan SWEEP_DIR target_se=0.01      # a multirun directory (one plan per job;
                                                          # single_batch jobs over B: the zeta fit)

A two-batch run writes its per-unit projections into ``per_unit.json`` (``projections_record``);
the planner reads them, estimates each side's per-unit variance (and how well the run pins it
down), and prints, for each estimate, the sizes now, the SE now, the cheapest sizes for the target
SE (plan_math.optimal_sizes), the SE they give, and their cost in units of one forward+backward
over the run's E and U. G is held at the run's value: the run saves one projection per prompt,
not per response, so the per-prompt variance cannot be split into its between-prompt part (which
a larger G does not reduce) and its within-prompt part (which it does). docs/planning.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from entprobe.config import ConfigError
from entprobe.math import planning as pm
from entprobe.reporting.tables import PER_UNIT_FILE

RESULTS_FILE = "results.json"


# ---------------------------------------------------------------- what a run saves
def projections_record(B_E: int, B_U: int, G: int, lr: float, a: torch.Tensor, b: torch.Tensor,
                       parts: list[str]) -> dict:
    """The two-batch probe's per-unit projections, a few floats per prompt: ``a`` [B_E, 1 + parts]:
    ``X_u . P Ybar`` then ``X_u . Delta theta_part`` (the prediction's per-unit contributions ``e``
    are their negatives); ``b`` [B_U, 1 or 2]: ``Y_v . P Xbar`` then, when the step has a Jacobian,
    ``Y_v . (J * Xbar)`` (``u`` is its negative)."""
    a, b = a.double().cpu(), b.double().cpu()
    return {"format": 1, "B_E": int(B_E), "B_U": int(B_U), "G": int(G), "lr": float(lr),
            "a": a[:, 0].tolist(), "b": b[:, 0].tolist(),
            "e": {k: (-a[:, 1 + j]).tolist() for j, k in enumerate(parts)},
            "u": (-b[:, 1]).tolist() if b.shape[1] > 1 else None}


# ---------------------------------------------------------------- what is planned
@dataclass
class Target:
    """One estimate: its results key and the sides its variance comes from."""

    key: str
    sides: list[pm.Side]
    note: str = ""
    prompts_per_unit: int = 1


def prediction_sides(B_E: int, B_U: int, G: int, var_e: float, rel_se: float = math.nan,
                     held: str = "B_U") -> list[pm.Side]:
    """``deltaH_pred``'s sides: given U (the step the optimizer takes on it), the prediction is a
    mean over E, so its SE is the E side's alone; the update batch (``held``: B_U, or B of the
    single-batch mode) is held: it changes the step, not this SE."""
    return [pm.Side("B_E", B_E, var_e, G, rel_se_var=rel_se), pm.Side(held, B_U, 0.0, G, fixed=True)]


def two_batch_targets(proj: dict) -> list[Target]:
    """The plans of a two-batch run from its ``per_unit.json`` record."""
    B_E, B_U, G, lr = int(proj["B_E"]), int(proj["B_U"]), int(proj["G"]), float(proj["lr"])
    e = torch.tensor(list(proj["e"].values()), dtype=torch.float64).sum(0)  # [B_E]

    def side(name, x, B, scale=1.0):
        return pm.Side(name, B, scale * pm.unit_variance(x), G, rel_se_var=pm.variance_rel_se(x))

    out = [Target("deltaH_pred", prediction_sides(
        B_E, B_U, G, pm.unit_variance(e), pm.variance_rel_se(e)), "B_U held: the SE is E's given the step")]
    if proj.get("u") is not None:
        u = torch.tensor(proj["u"], dtype=torch.float64)
        out.append(Target("deltaH_pred_expected", [side("B_E", e, B_E), side("B_U", u, B_U)],
                          "conservative at small B"))
    a, b = (torch.tensor(proj[k], dtype=torch.float64) for k in ("a", "b"))
    out.append(Target("deltaH1", [side("B_E", a, B_E, lr * lr), side("B_U", b, B_U, lr * lr)],
                      "conservative at small B"))
    return out


def _sq(x) -> float:
    """``x * x`` as a float: inf where ``x ** 2`` would raise OverflowError (an SE of 1e200)."""
    x = float(x)
    return x * x


def single_batch_targets(res: dict) -> list[Target]:
    """The plans of a single-batch run from its results: deltaH1's jackknife SE over M units of k
    prompts (``B * SE_jack^2`` as the per-unit variance counts the U-statistic's degenerate part at
    this B: conservative for a larger B), and the held-out prediction's E side when measured."""
    M, k, G = int(res["M"]), int(res.get("unit_size", 1)), int(res["G"])
    out = [Target("deltaH1", [pm.Side("B", M, M * _sq(res["SE_deltaH1"]), k * G)],
                  "conservative for larger B", prompts_per_unit=k)]
    if math.isfinite(res.get("SE_deltaH_pred", math.nan)):
        B_E = int(res["gt/B_E"])
        out.append(Target("deltaH_pred", prediction_sides(
            B_E, int(res["B"]), G, B_E * _sq(res["SE_deltaH_pred"]), held="B"), "B held: the SE is E's given the step"))
    return out


def sign_plan_row(r: dict) -> tuple[str, str, str, str] | None:
    """The verdict's planning row, from the flat results of a run whose prediction's sign is not
    resolved at ~95% (SE > |deltaH_pred| / 2): the B_E that brings the SE to |deltaH_pred| / 2,
    B_U held (the prediction's SE is the E side's), and its cost. None otherwise."""
    pred, se = r.get("deltaH_pred"), r.get("SE_deltaH_pred")
    try:
        B_E, B_U, G = int(r["B_E"]), int(r["B_U"]), int(r["G"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (isinstance(pred, float) and isinstance(se, float) and math.isfinite(pred) and math.isfinite(se)):
        return None
    if pred == 0 or se <= abs(pred) / 2:
        return None
    sides = prediction_sides(B_E, B_U, G, B_E * se * se)
    try:
        n = pm.optimal_sizes(sides, abs(pred) / 2)["B_E"]
    except ValueError as exc:  # |deltaH_pred| so small (or the SE so large) that no batch resolves it
        return ("to resolve its sign", "not reachable", "", str(exc))
    return ("to resolve its sign", f"B_E = {n}", "",
            f"for SE = |predicted|/2 at B_U = {B_U}: {pm.cost_ratio(sides, {'B_E': n}):.3g}x this run's batches "
            "(python -m entprobe.plan)")


@dataclass
class PlanRow:
    target: Target
    se_now: float
    sizes: dict[str, int] = field(default_factory=dict)  # planned units per side (all sides)
    se_planned: float = math.nan
    se_rel_error: float = math.nan
    cost: float = math.nan  # units of one forward+backward over the run's batches
    problem: str = ""


def plan_rows(targets: list[Target], target_se: float) -> list[PlanRow]:
    """One row per target: the cheapest sizes with SE <= target_se (or why there are none)."""
    rows = []
    for t in targets:
        row = PlanRow(t, pm.standard_error(t.sides))
        try:
            sizes = pm.optimal_sizes(t.sides, target_se)
        except ValueError as exc:
            row.problem = str(exc)
            rows.append(row)
            continue
        row.sizes = {s.name: sizes.get(s.name, s.B) for s in t.sides}
        row.se_planned = pm.standard_error(t.sides, sizes)
        row.se_rel_error = pm.se_rel_error(t.sides, sizes)
        row.cost = pm.cost_ratio(t.sides, sizes)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- reading run and sweep directories
def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # both ValueErrors; bytes that are not UTF-8 too
        raise PlanError(f"{path} is not valid JSON ({exc}): the file is damaged; rerun the job") from exc
    if not isinstance(out, dict):
        raise PlanError(f"{path} holds a {type(out).__name__}, not the run's record: the file is damaged; rerun the job")
    return out


class PlanError(ValueError):
    """A run or sweep directory the planner cannot use; the message says what to change."""


def _targets(make, record, path: Path):
    """``make(record)``; a PlanError naming ``path`` when a value it needs is missing or not a number."""
    try:
        return make(record)
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: {type(exc).__name__} {exc} reading the run's numbers: the file is damaged or "
                        "from another entprobe version; rerun the job") from exc


def _number_of(r: dict, key: str, path: Path) -> int:
    try:
        return int(r[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: '{key}' is {r.get(key)!r}, not a number: the file is damaged; rerun the job") from exc


def run_targets(run_dir: Path) -> tuple[dict, list[Target]]:
    """A run directory's results and its plan targets."""
    res_path = run_dir / RESULTS_FILE
    if not res_path.is_file():
        raise PlanError(f"{run_dir} has no {RESULTS_FILE}: not a finished entprobe run (python -m entprobe.main "
                        "writes it at the end of a run)")
    res = _read_json(res_path)
    if res.get("mode") == "single_batch":
        if res.get("pairs_per_block", 0) or not math.isfinite(res.get("SE_deltaH1", math.nan)):
            raise PlanError(f"{run_dir}: a single_batch run with an incomplete design (pairs_per_block > 0) "
                            "or no SE: plan from a complete-design run (probe.pairs_per_block=0)")
        return res, _targets(single_batch_targets, res, res_path)
    proj_path = run_dir / PER_UNIT_FILE
    proj = _read_json(proj_path) if proj_path.is_file() else {}
    if "a" not in proj:
        raise PlanError(f"{run_dir} has no per-prompt projections in {PER_UNIT_FILE} (what the planner needs): "
                        "the run had probe.variance_enabled=false or predates the planner; rerun it "
                        "with variance_enabled=true")
    missing = [k for k in ("B_E", "B_U", "G", "lr", "a", "b", "e") if k not in proj]
    if missing:
        raise PlanError(f"{proj_path} lacks {missing}: incomplete; rerun the job")
    return res, _targets(two_batch_targets, proj, proj_path)


def _job_number(name: str) -> tuple[int, int] | None:
    """``<num>`` -> (num, 1), ``<num>-<k>`` (a concurrent multirun's job: reporting/sweep.py) -> (num, k)."""
    num, _, k = name.partition("-")
    return (int(num), int(k or 1)) if num.isdigit() and (k.isdigit() or not _) else None


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    """The job directories (numbered subfolders with a results file) of a multirun directory."""
    jobs = [p for p in sweep_dir.iterdir()
            if p.is_dir() and _job_number(p.name) and (p / RESULTS_FILE).is_file()]
    return sorted(jobs, key=lambda p: _job_number(p.name))


@dataclass
class SweepFit:
    """zeta_1, zeta_2 of the single-batch U-statistic fitted over a sweep's B (``plan_math.fit_zeta``
    on the runs' jackknife variances), the per-B points, and the B for the target."""

    fit: pm.ZetaFit
    points: list[tuple[int, int, float, float]]  # (M units, runs, mean M SE_jack^2, replicate M Var(U_cross) or nan)
    lr: float  # nan when the runs differ in lr
    prompts_per_unit: int
    M_planned: int = 0
    problem: str = ""  # why there is no M_planned although the runs share one lr


def zeta_sweep(results: list[dict], target_se: float) -> SweepFit:
    """The slope model from complete-design single-batch runs at two or more distinct M."""
    runs = [r for r in results if r.get("mode") == "single_batch" and not r.get("pairs_per_block", 0)]
    ks = {int(r.get("unit_size", 1)) for r in runs}
    if len(ks) > 1:
        raise PlanError(f"the single_batch runs use different unit sizes {sorted(ks)}: fit runs with one block_size")
    M = [int(r["M"]) for r in runs]
    try:
        fit = pm.fit_zeta(M, [_sq(r["SE_jack"]) for r in runs], "jackknife")
    except ValueError as exc:
        raise PlanError(f"the zeta fit: {exc}") from exc
    points = []
    for m in sorted(set(M)):
        at = [r for r in runs if int(r["M"]) == m]
        jack = sum(m * _sq(r["SE_jack"]) for r in at) / len(at)
        rep = m * float(torch.tensor([r["U_cross"] for r in at], dtype=torch.float64).var()) if len(at) > 1 else math.nan
        points.append((m, len(at), jack, rep))
    lrs = {float(r["lr"]) for r in runs}
    out = SweepFit(fit, points, lrs.pop() if len(lrs) == 1 else math.nan, ks.pop())
    if math.isfinite(out.lr):
        per_lr = target_se / out.lr
        try:
            out.M_planned = pm.ustat_size_for(fit.zeta1, fit.zeta2, per_lr * per_lr)  # x*x: inf, not OverflowError
        except ValueError as exc:
            out.problem = f"no B for SE(deltaH1) <= {target_se:.3g}: {exc}"
    return out


# ---------------------------------------------------------------- printing
def _sizes(t: Target, sizes: dict[str, int]) -> str:
    k = t.prompts_per_unit
    return " ".join(f"{n}={sizes.get(n, s.B) * k}" for n, s in ((s.name, s) for s in t.sides))


def format_rows(rows: list[PlanRow], target_se: float) -> list[str]:
    """The plan table: one line per estimate."""
    head = f"{'estimate':<30} {'now':<16} {'SE now':>9}   {'plan (SE <= ' + f'{target_se:.3g})':<19} " \
           f"{'SE planned':>18} {'cost':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r.target
        now = f"{t.key:<30} {_sizes(t, {}):<16} {r.se_now:>9.3g}   "
        if r.problem:
            lines.append(now + f"not reachable: {r.problem}")
            continue
        err = f" (≥±{r.se_rel_error:.0%})" if math.isfinite(r.se_rel_error) else ""
        lines.append(now + f"{_sizes(t, r.sizes):<19} {f'{r.se_planned:.3g}{err}':>18} {r.cost:>7.3g} units"
                     + (f"   {t.note}" if t.note else ""))
    return lines


def format_sweep_fit(sf: SweepFit, target_se: float) -> list[str]:
    f = sf.fit
    k = sf.prompts_per_unit
    lines = [f"single_batch sweep over B: B Var(U_B) = 4 zeta1 + 2 (zeta2 - 2 zeta1)/(B - 1)"
             f"{f' (B in units of {k} prompts)' if k > 1 else ''}",
             f"  zeta1 = {f.zeta1:.4g}, zeta2 = {f.zeta2:.4g} (least squares on the runs' jackknife variances, "
             f"{f.n_points} runs; rms residual {f.rel_rms_residual:.1%} of the mean)",
             f"  {'B':>6} {'runs':>5} {'B SE_jack^2':>12} {'its fit':>12} {'B Var(U_B)':>12} {'replicates':>11}"]
    for m, n, jack, rep in sf.points:
        lines.append(f"  {m:>6} {n:>5} {jack:>12.4g} {m * pm.ustat_jackknife_mean(f.zeta1, f.zeta2, m):>12.4g} "
                     f"{m * pm.ustat_variance(f.zeta1, f.zeta2, m):>12.4g} {rep:>11.4g}")
    if sf.M_planned:
        se = sf.lr * math.sqrt(pm.ustat_variance(f.zeta1, f.zeta2, sf.M_planned))
        lines.append(f"  SE(deltaH1) <= {target_se:.3g} at B = {sf.M_planned * k} prompts (SE {se:.3g}; lr {sf.lr:.3g})")
    elif sf.problem:
        lines.append(f"  {sf.problem}")
    else:
        lines.append("  the runs differ in lr: no B for a target SE of deltaH1 (zeta1, zeta2 are lr-free)")
    return lines


def plan_directory(path: Path, target_se: float) -> list[str]:
    """The planner's report for a run or a sweep directory, as lines."""
    if not path.is_dir():
        raise PlanError(f"{path} is not a directory: pass a run directory (with {RESULTS_FILE}) or a sweep directory")
    problem = pm.target_se_problem(target_se)
    if problem:
        raise ConfigError(problem)
    if (path / RESULTS_FILE).is_file():
        res, targets = run_targets(path)
        G = res.get("G")
        lines = [f"{path}: {res.get('mode', 'two_batch')}, G={G}, lr {res.get('lr', math.nan):.3g}; target SE {target_se:.3g}"]
        lines += format_rows(plan_rows(targets, target_se), target_se)
        lines.append(f"G held at {G} (the run saves one projection per prompt, not per response). cost: forward+backward "
                     "over the planned batches in units of one over this run's. (≥±x%): the planned SE's error from "
                     "this run's sampling of the per-prompt variances (a floor when a few prompts dominate).")
        return lines
    jobs = sweep_jobs(path)
    if not jobs:
        raise PlanError(f"{path} has no {RESULTS_FILE} and no job directories with one: not a finished run or sweep")
    results = {j: _read_json(j / RESULTS_FILE) for j in jobs}
    lines = [f"{path}: sweep of {len(jobs)} jobs; target SE {target_se:.3g}"]
    single = {j: r for j, r in results.items() if r.get("mode") == "single_batch" and not r.get("pairs_per_block", 0)}
    fitted = len({_number_of(r, "M", j / RESULTS_FILE) for j, r in single.items()}) >= 2
    if fitted:
        fit = _targets(lambda rs: zeta_sweep(rs, target_se), list(single.values()), path / "*" / RESULTS_FILE)
        lines += format_sweep_fit(fit, target_se)
    for j in jobs:
        if fitted and results[j].get("mode") == "single_batch":
            continue
        try:
            _, targets = run_targets(j)
        except PlanError as exc:
            lines.append(f"job {j.name}: {exc}")
            continue
        lines.append(f"job {j.name} (lr {results[j].get('lr', math.nan):.3g}):")
        lines += ["  " + x for x in format_rows(plan_rows(targets[:1], target_se), target_se)[2:]]
    return lines
