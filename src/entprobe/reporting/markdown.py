"""``report.md`` in the run dir: the verdict (reporting/verdict.py's text, as markdown), a table of the
headline values and the PNG plots (reporting/plots.py) of this run.

    attribution.png         deltaH_pred by layer and module kind, nats (two_batch: attr_pred/layer/*, attr_pred/kind/*)
    importance_weights.png  log importance weights of the measured step, PSIS k-hat, ESS/N
    projections.png         per-prompt contributions to deltaH_pred / deltaH_true / deltaH1, mean and 95% interval

Plots never cost a run: a plot that fails (or whose data is absent) is skipped with a warning and
the report says so; results.json is written before any of this.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Callable

from entprobe.reporting.tables import PER_UNIT_FILE, fmt, headline_rows
from entprobe.runtime.atomic_io import write_text_atomic
from entprobe.reporting.verdict import Flag, verdict_markdown

REPORT_FILE = "report.md"
PLOT_FILES = {"attribution": "attribution.png", "importance_weights": "importance_weights.png",
              "projections": "projections.png"}


def _prefixed(results: dict, prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in sorted(results.items()) if k.startswith(prefix)}


def _plot_attribution(results: dict, per_unit: dict, path: Path) -> Path | None:
    from entprobe.reporting import plots  # here, not at import: without matplotlib only the plots are lost

    by_layer, by_kind = _prefixed(results, "attr_pred/layer/"), _prefixed(results, "attr_pred/kind/")
    if not by_kind:
        return None
    note = ""
    if results.get("norm_PYbar") == 0:  # the verdict's empty_gradient
        note = ("no U group has reward variance, so the gradient is zero: this step is AdamW's momentum and "
                "weight decay only" if any(by_kind.values()) else "every part is 0: no U group has reward "
                "variance (zero gradient) and the optimizer has no momentum or weight decay to apply")
    return plots.attribution(by_layer, by_kind, path, float(results.get("deltaH_pred", math.nan)), note)


def _plot_weights(results: dict, per_unit: dict, path: Path) -> Path | None:
    from entprobe.reporting import plots

    lw = per_unit.get("E/log_weights")
    if not lw:
        return None
    group = results.get("is/stratified_by") == "group"  # dr_grpo: PSIS and ESS are over groups
    items = [sum(row) for row in lw] if group else [x for row in lw for x in row]
    return plots.importance_weights(items, float(results.get("psis_khat", math.nan)),
                                    float(results.get("ESS_frac", math.nan)), path, "group" if group else "response")


def _plot_projections(results: dict, per_unit: dict, path: Path) -> Path | None:
    from entprobe.reporting import plots

    def given(tag: str) -> tuple[float, float] | None:  # the verdict's interval, where the run has it
        lo, hi = results.get(f"ci95_{tag}_low", math.nan), results.get(f"ci95_{tag}_high", math.nan)
        return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None

    step, ci = {}, {}
    for k, label, tag in (("E/deltaH_pred", "predicted", "pred"), ("E/deltaH_true", "measured", "true")):
        if per_unit.get(k):
            step[label] = per_unit[k]
            if given(tag):
                ci[label] = given(tag)
    rows = [[("the step: each prompt of E's contribution to the entropy change", "prompt of E", step, ci)]
            if step else []]
    rows.append([(f"deltaH1 (-lr Xbar.P.Ybar), {side}'s prompts: {what}", f"prompt of {side}", {side: per_unit[k]}, {})
                 for k, side, what in (("E/deltaH1", "E", "-lr X_u.P.Ybar"), ("U/deltaH1", "U", "-lr Y_v.P.Xbar"))
                 if per_unit.get(k)])
    return plots.projections(rows, path) if any(rows) else None


PLOTTERS: dict[str, Callable[[dict, dict, Path], Path | None]] = {
    "attribution": _plot_attribution, "importance_weights": _plot_weights, "projections": _plot_projections}


def make_plots(results: dict, run_dir: str | Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Every plot whose data this run has: ``({name: png}, {name: why it is missing})``. A failing
    plot is a warning, never an exception."""
    run_dir = Path(run_dir)
    made, missing = {}, {}
    try:
        pu_file = run_dir / PER_UNIT_FILE
        per_unit = json.loads(pu_file.read_text()) if pu_file.is_file() else {}
    except (OSError, ValueError) as exc:
        per_unit = {}
        warnings.warn(f"report: could not read {PER_UNIT_FILE} ({exc}); per-prompt plots skipped")
    for name, plot in PLOTTERS.items():
        try:
            path = plot(results, per_unit, run_dir / PLOT_FILES[name])
        except Exception as exc:  # a plot is never worth a run
            warnings.warn(f"report: plot {name} failed ({type(exc).__name__}: {exc}); results are unaffected")
            missing[name] = f"failed: {type(exc).__name__}: {exc}"
            continue
        if path is None:
            missing[name] = "no data in this run"
        else:
            made[name] = path
    return made, missing


WHAT_IF_COLUMNS = ("deltaH_pred", "SE", "ci95_low", "ci95_high", "deltaH_true", "SE_deltaH_true",
                   "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred", "pred_consistent")


def what_if_section(results: dict) -> list[str]:
    """``## What-if``: one row per ``probe.what_if`` setting with its prediction and, where it was
    measured, the measured change and the paired difference (docs/what_if.md); [] without any."""
    w = results.get("what_if") or {}
    rows = {k: v for k, v in w.items() if "deltaH_pred" in v}
    if not w:
        return []
    out = ["", "## What-if", "", "The predicted change of the next step under other settings (`what_if` in "
           "`results.json`; docs/what_if.md).", ""]
    if rows:
        cols = [c for c in WHAT_IF_COLUMNS if any(c in v for v in rows.values())]
        out += ["| setting | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---|" + "---:|" * len(cols)]
        for k, v in rows.items():
            cells = [fmt(v[c]) if isinstance(v.get(c), float) else str(v.get(c, "")) for c in cols]
            out.append(f"| `{k}` | " + " | ".join(cells) + " |")
    target = w.get("lr_for_target")
    if target:
        out += ["", f"lr for a predicted change of {fmt(target['target_deltaH'])}: " + (
            f"{fmt(target['lr_star'])} (SE {fmt(target['SE_lr_star'])}, 95% interval "
            f"[{fmt(target['ci95_lr_low'])}, {fmt(target['ci95_lr_high'])}])" if target["status"] == "resolved"
            else target["status"])]
    notes = sorted({v["note"] for v in w.values() if v.get("note")})
    out += [""] + [f"- {n}" for n in notes] if notes else []
    return out


def render(results: dict, fl: list[Flag], images: dict[str, Path], missing: dict[str, str]) -> str:
    """The markdown text: verdict, headline table, images (relative links), what is missing."""
    lines = ["# entprobe run report", "",
             f"{results.get('model_source', '')} · {results.get('mode', 'two_batch')} · "
             f"{results.get('weighting_mode', '')} functional · lr {fmt(results.get('lr', math.nan))} · "
             f"B_E {results.get('B_E', results.get('gt/B_E', ''))}, B_U {results.get('B_U', results.get('B', ''))}, "
             f"G {results.get('G', '')}", "", "## Verdict", "", verdict_markdown(results, fl), "## Results", "",
             "| result | value |", "|---|---:|"]
    lines += [f"| `{k}` | {v:.6g} |" if isinstance(v, float) else f"| `{k}` | {v} |" for k, v in headline_rows(results)]
    lines += what_if_section(results)
    lines += ["", "Every number is in `results.json`; the per-prompt values behind the SEs in "
              f"`{PER_UNIT_FILE}`.", "", "## Plots", ""]
    for name, path in images.items():
        lines += [f"![{name}]({path.name})", ""]
    lines += [f"- {name}: {why}" for name, why in missing.items()]
    return "\n".join(lines).rstrip() + "\n"


def write_report(results: dict, fl: list[Flag], run_dir: str | Path) -> tuple[Path | None, dict[str, Path]]:
    """Plots, then ``report.md``. Returns its path (None if it could not be written: a warning)
    and the images made."""
    run_dir = Path(run_dir)
    images, missing = make_plots(results, run_dir)
    try:
        path = run_dir / REPORT_FILE
        write_text_atomic(path, render(results, fl, images, missing))
        return path, images
    except Exception as exc:
        warnings.warn(f"report: {REPORT_FILE} not written ({type(exc).__name__}: {exc}); results.json is")
        return None, images
