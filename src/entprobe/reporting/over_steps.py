"""A training run probed checkpoint by checkpoint (``python -m entprobe.probe_run``) or online
(``EntropyProbeCallback`` / ``python -m entprobe.train --probe-every``): one row per training step
(``over_steps_row``), ``over_steps.csv`` (``write_csv``), ``over_steps.png`` (``plot``: H with its 95%
band on top, predicted and measured entropy change with their 95% intervals below) and the run's
``report.md`` (``report``). Pure functions of the probes' flat results; docs/over_steps.md describes
each column.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from entprobe.reporting.plots import PRED_STYLE, TRUE_STYLE, _note, _save, ci95
from entprobe.runtime.atomic_io import write_text_atomic

CSV_FILE, PLOT_FILE = "over_steps.csv", "over_steps.png"
ONLINE_PREFIX = "entprobe_"  # the online probe's files in a trainer's output_dir: entprobe_over_steps.csv / .png
PRED_COLOR, TRUE_COLOR = "C0", "C1"  # predicted / measured, as in plots.projections
# the CSV's columns, in order: the row's own, then result keys (``FROM_RESULTS``)
HORIZONS = (1, 5, 10)  # math/forecast.py's: the online probe's forecasts k steps ahead (source="rollouts")
FORECAST_COLUMNS = tuple(f"forecast_H_k{k}{s}" for k in HORIZONS for s in ("", "_low", "_high"))
COLUMNS = ("step", "status", "H", "SE_H", "ci95_H_low", "ci95_H_high", "H_batch", "H_rollouts",
           "deltaH_pred", "SE_deltaH_pred", "ci95_pred_low", "ci95_pred_high",
           "deltaH_true", "SE_deltaH_true", "ci95_true_low", "ci95_true_high",
           "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred", "lr", "time_s", "job_dir", "reason",
           *FORECAST_COLUMNS, "H_logged", *(f"H_logged_k{k}" for k in HORIZONS), "guard_lr_factor")
FROM_RESULTS = {"H": "H_orig", "SE_H": "SE_H_orig", "H_rollouts": "H_rollouts",
                **{k: k for k in COLUMNS[COLUMNS.index("deltaH_pred"):COLUMNS.index("lr") + 1]},
                **{k: k for k in FORECAST_COLUMNS}, "guard_lr_factor": "guard_lr_factor"}


def h_batch(results: Mapping, online: bool) -> str:
    """Whose entropy a row's ``H`` (the results' ``H_orig``) is: ``E``, the held-out responses (a
    checkpoint's job; an online probe's held-out source, or its ``source="rollouts"`` measured on a
    fresh E), or ``rollouts``, the probed step's own batch (``source="rollouts"`` measuring nothing:
    its results have the forecasts, ``forecast_H_k*``, and no ``deltaH_pred_E``)."""
    rollouts = online and any(k in results for k in ("H_rollouts", f"forecast_H_k{HORIZONS[0]}"))
    return "rollouts" if rollouts and "deltaH_pred_E" not in results else "E"


def over_steps_row(step: int, status: str, results: Mapping | None = None, job_dir: str = "", reason: str = "",
                   time_s: float = math.nan, logged: Mapping[int, float] | None = None, online: bool = False) -> dict:
    """One checkpoint's (or online probe's, ``online``) row: ``status`` ok / skipped / failed, the
    numbers of its ``results`` (NaN where absent), H's 95% interval (``mean -+ t_{B_E-1} SE``, as the
    verdict's), whose entropy H is (``H_batch``, ``h_batch``) and the step's own batch's
    (``H_rollouts``, ``source="rollouts"``: where the forecasts start), the job's folder, why it was
    skipped or failed, and the seconds it took (``time_s`` if given, else the results' own).
    ``logged``: the trainer's logged entropy by step (online probes): the row's ``H_logged`` (at its
    step) and ``H_logged_k<k>`` (k steps later: what ``forecast_H_k<k>`` forecast)."""
    r = dict(results or {})
    row = {"step": int(step), "status": status, "job_dir": job_dir, "reason": reason}
    for col, key in FROM_RESULTS.items():
        row[col] = _number(r.get(key))
    row["H_batch"] = h_batch(r, online) if results else ""
    if row["H_batch"] == "rollouts" and math.isnan(row["H_rollouts"]):
        row["H_rollouts"] = row["H"]
    row["ci95_H_low"], row["ci95_H_high"] = ci95(row["H"], row["SE_H"], _number(r.get("B_E")))
    if math.isnan(time_s):
        time_s = _number(r.get("time/total_s", r.get("time_s")))
    row["time_s"] = time_s
    logged = logged or {}
    row["H_logged"] = _number(logged.get(int(step)))
    for k in HORIZONS:
        row[f"H_logged_k{k}"] = _number(logged.get(int(step) + k))
    return {c: row[c] for c in COLUMNS}


def history_rows(history: Sequence[Mapping], logged: Mapping[int, float] | None = None) -> list[dict]:
    """The online probe's ``history`` (its full results, each with its ``step``) as rows, by step;
    ``logged``: the trainer's logged entropy by step (``over_steps_row``)."""
    return [over_steps_row(int(r["step"]), "ok", r, logged=logged, online=True)
            for r in sorted(history, key=lambda r: r["step"])]


def _number(v) -> float:
    """``v`` as a float (NaN for None, a bool as 0/1, anything not a number as NaN)."""
    try:
        return math.nan if v is None else float(v)
    except (TypeError, ValueError):
        return math.nan


def csv_text(rows: Sequence[Mapping]) -> str:
    """The rows as CSV text (``COLUMNS``; NaN written empty)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return buf.getvalue()


def write_csv(rows: Sequence[Mapping], path: str | Path) -> Path:
    """``over_steps.csv`` (``csv_text``), atomically."""
    return write_text_atomic(path, csv_text(rows))


def read_csv(path: str | Path) -> list[dict]:
    """A written ``over_steps.csv`` back as rows (numbers as floats, empty as NaN, step as int)."""
    text_cols = {"status", "job_dir", "reason", "H_batch"}
    with open(path, newline="") as f:
        return [{k: v if k in text_cols else int(v) if k == "step" else _number(v or None) for k, v in r.items()}
                for r in csv.DictReader(f)]


def _errorbars(ax, rows: Sequence[Mapping], key: str, lo: str, hi: str, label: str, color: str, style: dict,
               dx: float) -> bool:
    """One series ``key`` against step with its 95% interval ``[lo, hi]`` as bars; False when it has no
    finite value."""
    rs = [r for r in rows if math.isfinite(r[key])]
    if not rs:
        return False
    x = np.array([r["step"] for r in rs], dtype=float) + dx
    y = np.array([r[key] for r in rs], dtype=float)
    low = np.array([r[lo] for r in rs], dtype=float)
    high = np.array([r[hi] for r in rs], dtype=float)
    err = np.vstack([np.where(np.isfinite(low), y - low, 0), np.where(np.isfinite(high), high - y, 0)])
    ax.errorbar(x, y, yerr=err, marker=style["marker"], ls=style["ls"] if len(rs) > 1 else "none", ms=5,
                capsize=3, lw=1.2, color=color, mfc=style["mfc"] or color, label=label)
    return True


def plot(rows: Sequence[Mapping], path: str | Path, title: str = "", online: bool = False,
         logged: Mapping[int, float] | None = None, factors: Mapping[int, float] | None = None) -> Path:
    """``over_steps.png``: against the training step, H with its 95% band (top) and the predicted
    (filled, solid) and measured (open, dashed) entropy change of the next step with their 95%
    intervals as bars, a zero line (bottom); nats. Rows that were skipped or failed are marked on the
    step axis. ``online``: the rows are an online probe's (H just before each probed step), not
    checkpoints'. With ``logged`` (the trainer's logged entropy by step) the top panel also draws that
    realised curve, and each row's forecasts ``forecast_H_k<k>`` at step + k with their 95% intervals
    (bars); with ``factors`` (EntropyGuard's lr factor by step) a third panel shows the factor."""
    rows = sorted(rows, key=lambda r: r["step"])
    ok = [r for r in rows if r["status"] == "ok"]
    fig = Figure(figsize=(8, 8.6 if factors else 6.4))
    axes = fig.subplots(3 if factors else 2, 1, sharex=True, height_ratios=[3, 3, 1.4] if factors else None)
    ax_h, ax_d = axes[0], axes[1]
    if logged:
        xs = sorted(logged)
        ax_h.plot(xs, [logged[x] for x in xs], "-", color="0.55", lw=1.0, label="logged entropy (the trainer's)")
    _forecasts(ax_h, ok)
    h = [r for r in ok if math.isfinite(r["H"])]
    if h:
        x = [r["step"] for r in h]
        ax_h.plot(x, [r["H"] for r in h], "o-", color="black", ms=4, lw=1.2, label=_h_label(h, online))
        lo, hi = np.array([r["ci95_H_low"] for r in h], float), np.array([r["ci95_H_high"] for r in h], float)
        if np.isfinite(lo).any():
            ax_h.fill_between(x, lo, hi, color="gray", alpha=0.25, lw=0, label="95% interval (t, B_E - 1 df)")
        ax_h.legend(fontsize=8)
    own = [r for r in ok if r.get("H_batch") == "E" and math.isfinite(r.get("H_rollouts", math.nan))]
    if own:  # source="rollouts" measured on E: the step's own batch's H too, where its forecasts start
        ax_h.plot([r["step"] for r in own], [r["H_rollouts"] for r in own], "x--", color="0.3", ms=5, lw=0.8,
                  label="H of the step's rollouts (the forecasts' start)")
        ax_h.legend(fontsize=8)
    elif not h and not logged:
        _note(ax_h, "no entropy measured")
    if logged and not h:
        ax_h.legend(fontsize=8)
    seen = [v for v in [r["H"] for r in h] + [r["H_rollouts"] for r in own] + list((logged or {}).values())
            if math.isfinite(v)]
    if seen and any(math.isfinite(r.get(c, math.nan)) for r in ok for c in FORECAST_COLUMNS):
        ax_h.set_ylim(0, 1.6 * max(seen))  # a forecast's far bound (first order, 10 steps out) off the chart
    ax_h.set_ylabel("entropy H (nats)")
    width = max(1.0, (rows[-1]["step"] - rows[0]["step"]) if rows else 1.0)
    shown = [_errorbars(ax_d, ok, "deltaH_pred", "ci95_pred_low", "ci95_pred_high", "predicted (first order)",
                        PRED_COLOR, PRED_STYLE, -0.006 * width),
             _errorbars(ax_d, ok, "deltaH_true", "ci95_true_low", "ci95_true_high", "measured (one real step)",
                        TRUE_COLOR, TRUE_STYLE, 0.006 * width)]
    ax_d.axhline(0, color="black", lw=0.6)
    measuring = any(math.isfinite(r["deltaH_true"]) for r in ok)  # (source="rollouts" may measure nothing)
    for r in rows:  # why a step has no point: skipped / failed checkpoint, or its step unmeasurable
        mark = r["status"] if r["status"] != "ok" else "no measurement" if measuring and math.isnan(r["deltaH_true"]) else ""
        if mark:
            ax_d.axvline(r["step"], color="gray", ls=":", lw=0.8)
            ax_d.annotate(mark, (r["step"], 0), xycoords=("data", "axes fraction"), xytext=(2, 3),
                          textcoords="offset points", fontsize=7, color="gray", rotation=90, va="bottom")
    ax_d.set_ylabel(f"entropy change of the {'probed' if online else 'next'} step (nats)")
    axes[-1].set_xlabel("training step (probed online)" if online else "training step (checkpoint)")
    if any(shown):
        ax_d.legend(fontsize=8, title="bars: 95% intervals", title_fontsize=8)
    else:
        _note(ax_d, "no checkpoint probed")
    if factors:
        xs = sorted(factors)
        axes[2].step(xs, [factors[x] for x in xs], where="post", color="C3", lw=1.2)
        axes[2].axhline(1.0, color="black", lw=0.6)
        axes[2].set_ylabel("lr factor\n(EntropyGuard)")
        axes[2].set_ylim(bottom=0)
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title or "entropy over training: H and the predicted / measured change of the next step",
                 fontsize=10)
    return _save(fig, path)


FORECAST_COLORS = {1: "C2", 5: "C4", 10: "C5"}


def _h_label(rows: Sequence[Mapping], online: bool) -> str:
    """The H series' legend: whose entropy it is (``H_batch``) and when."""
    if not online:
        return "H of E at the checkpoint"
    batches = {r.get("H_batch") for r in rows}
    whose = ("the step's rollouts" if batches == {"rollouts"} else "held-out E" if batches == {"E"} else
             "held-out E (the step's rollouts where not measured)")
    return f"H of {whose} before the probed step"


def _forecasts(ax, rows: Sequence[Mapping]) -> None:
    """Each row's ``forecast_H_k<k>`` drawn at step + k with its 95% interval (the logged entropy's)."""
    for k in HORIZONS:
        rs = [r for r in rows if math.isfinite(r.get(f"forecast_H_k{k}", math.nan))]
        if not rs:
            continue
        x = np.array([r["step"] + k for r in rs], float)
        y = np.array([r[f"forecast_H_k{k}"] for r in rs], float)
        lo = np.array([r[f"forecast_H_k{k}_low"] for r in rs], float)
        hi = np.array([r[f"forecast_H_k{k}_high"] for r in rs], float)
        ax.errorbar(x, y, yerr=np.vstack([y - lo, hi - y]), fmt="s", ms=3, lw=0.8, capsize=2, alpha=0.8,
                    color=FORECAST_COLORS.get(k, "C6"), label=f"forecast {k} step{'s' if k > 1 else ''} ahead (95%)")


def _cell(v, fmt: str = "{:+.3g}") -> str:
    return "" if isinstance(v, float) and math.isnan(v) else fmt.format(v)


def _pm(r: Mapping, key: str, se: str, fmt: str = "{:+.3g}") -> str:
    return f"{_cell(r[key], fmt)} ± {_cell(r[se], '{:.2g}')}" if math.isfinite(r[key]) else ""


def report(rows: Sequence[Mapping], run_dir: str, csv_name: str = CSV_FILE, plot_name: str | None = PLOT_FILE) -> str:
    """``report.md`` of a probed run: the table (± 1 SE), the figure, a link to each step's report."""
    lines = [f"# Entropy over the training run {run_dir}", "",
             "Each checkpoint probed as `python -m entprobe.main` would (its own report linked). Entropy and "
             "its changes in nats; ± is 1 SE; the figure's bars and band are 95% intervals "
             "(docs/over_steps.md).", "",
             "| step | status | H of E | deltaH_pred | deltaH_true | true - pred | lr | time (s) | report |",
             "|---:|---|---|---|---|---|---|---:|---|"]
    for r in rows:
        link = f"[{r['job_dir']}/report.md]({r['job_dir']}/report.md)" if r["job_dir"] and r["status"] == "ok" else ""
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "")
        lines.append(f"| {r['step']} | {status.replace('|', '/')} | {_pm(r, 'H', 'SE_H', '{:.4g}')} | "
                     f"{_pm(r, 'deltaH_pred', 'SE_deltaH_pred')} | {_pm(r, 'deltaH_true', 'SE_deltaH_true')} | "
                     f"{_pm(r, 'deltaH_true_minus_pred', 'SE_deltaH_true_minus_pred')} | {_cell(r['lr'], '{:.3g}')} | "
                     f"{_cell(r['time_s'], '{:.1f}')} | {link} |")
    lines += ["", f"The table as CSV: [{csv_name}]({csv_name})."]
    if plot_name:
        lines += ["", f"![entropy over training]({plot_name})"]
    return "\n".join(lines) + "\n"


def merged_history(log_history: Sequence[Mapping], history: Sequence[Mapping]) -> list[dict]:
    """A resumed run's probes: those an earlier process logged (``log_history`` entries holding
    ``entprobe/deltaH_pred``, at the probed step ``entprobe/step``, else the entry's ``step``), as
    logged (``entprobe/`` dropped from their keys), then this process's full ``history`` over them."""
    probed = {}
    for e in log_history:
        if "entprobe/deltaH_pred" in e:
            step = int(e.get("entprobe/step", e.get("step", -1)))
            probed[step] = {**{k[len("entprobe/"):]: v for k, v in e.items() if k.startswith("entprobe/")},
                            "step": step}
    probed.update({int(r["step"]): dict(r) for r in history})
    return list(probed.values())


def write_history(history: Sequence[Mapping], folder: str | Path, title: str = "",
                  log_history: Sequence[Mapping] | None = None) -> list[Path]:
    """The online probe's ``history`` as ``entprobe_over_steps.csv`` and ``.png`` in ``folder`` (the
    trainer's output folder); their paths, none when nothing was probed. ``log_history``: the trainer's
    per-step log (``entropy``, and ``entprobe/guard_lr_factor`` of a guarded run): the realised entropy
    beside the forecasts, and the lr factor's panel."""
    if not history:
        return []
    logged = {int(h["step"]): float(h["entropy"]) for h in log_history or () if "entropy" in h and "step" in h}
    factors = {int(h["step"]): float(h["entprobe/guard_lr_factor"]) for h in log_history or ()
               if "entprobe/guard_lr_factor" in h and "step" in h}
    rows, folder = history_rows(history, logged), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [write_csv(rows, folder / (ONLINE_PREFIX + CSV_FILE)),
            plot(rows, folder / (ONLINE_PREFIX + PLOT_FILE), title=title or "online probe over training: H and "
                 "the predicted / measured change of the probed step", online=True, logged=logged or None,
                 factors=factors or None)]
