"""Results: the per-prompt arrays behind the SEs, the headline rows and a console table
(reporting/loggers.py sends them to wandb / csv; reporting/markdown.py writes report.md); JSON through atomic_io."""
from __future__ import annotations

import math
from pathlib import Path

from entprobe.runtime.atomic_io import write_json_atomic

PER_UNIT_FILE = "per_unit.json"


def write_per_unit(run_dir: str | Path, psi=None, e=None, log_weights=None, a=None, b=None,
                   lr: float = float("nan"), record: dict | None = None) -> Path:
    """``per_unit.json`` in the run dir: the per-prompt values behind the headline means and SEs
    (global, on rank 0), what reporting/markdown.py plots. Keys present when their inputs are given:

    - ``E/deltaH_pred`` [B_E]: ``e.sum(1)``, prompt n's contribution to the prediction (mean =
      ``deltaH_pred``, sd / sqrt(B_E) = ``SE_deltaH_pred``);
    - ``E/deltaH_true`` [B_E]: ``psi``, its measured contribution (mean = ``deltaH_true``);
    - ``E/log_weights`` [B_E][G]: ``S(theta_plus) - S(theta)`` of each response of E;
    - ``E/deltaH1`` [B_E], ``U/deltaH1`` [B_U]: ``-lr a_u``, ``-lr b_v`` (``a_u = X_u . P Ybar``,
      ``b_v = Y_v . P Xbar``; both means are ``deltaH1``, their SEs ``lr sqrt(V_X)``, ``lr sqrt(V_Y)``);
    - ``record``'s keys (``plan.projections_record``: sizes, lr and the raw projections the
      batch-size planner reads).
    """
    arrays = {"E/deltaH_pred": None if e is None else e.double().sum(1), "E/deltaH_true": psi,
              "E/log_weights": log_weights, "E/deltaH1": None if a is None else -lr * a.double(),
              "U/deltaH1": None if b is None else -lr * b.double()}
    out = {k: v.tolist() for k, v in arrays.items() if v is not None}
    return write_json_atomic({**(record or {}), **out}, Path(run_dir) / PER_UNIT_FILE)


def fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return "nan" if math.isnan(v) else f"{v:.10g}"


HEADLINE = ["deltaH_pred", "SE_deltaH_pred", "ci95_pred_low", "ci95_pred_high", "deltaH_true", "SE_deltaH_true",
            "ci95_true_low", "ci95_true_high", "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred",
            "pred_consistent", "deltaH1", "SE_deltaH1", "ci95_low", "ci95_high", "deltaH1_step", "deltaH_cov",
            "ESS_frac", "psis_khat", "H_orig", "H_upd", "U_cross", "SE_plugin", "SE_jack", "lr",
            "time/total_s"]


def headline_rows(results: dict, extra=()) -> list[tuple[str, object]]:
    """``(key, value)`` of the headline keys this run has, in ``HEADLINE`` order, then ``extra``:
    the console table's first rows, report.md's and wandb's results table."""
    keys = list(HEADLINE) + [k for k in extra if k not in HEADLINE]
    return [(k, results[k]) for k in keys if k in results]


def console_table(results: dict, title: str = "entprobe results", extra_headline=()) -> None:
    """Headline numbers first, then every scalar (10 significant digits)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("key", style="cyan")
    table.add_column("value", justify="right")
    head = headline_rows(results, extra_headline)
    shown = {k for k, _ in head}
    for k, v in head + sorted((k, v) for k, v in results.items() if k not in shown):
        if not k.startswith("attr/layer/") and not isinstance(v, dict):  # what_if: in the verdict
            table.add_row(k, fmt(v))
    Console(width=120).print(table)
