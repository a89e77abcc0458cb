"""PNG figures of one run and of a sweep (matplotlib's object API on the Agg canvas: no pyplot, no
global backend switch, no display needed). Each function takes plain numbers, writes one PNG and
returns its path; callers decide what a failure means (reporting/markdown.py turns it into a warning).

- ``attribution``: ``bars_dot`` (the deltaH1 dot product) by layer and by module kind;
- ``importance_weights``: the distribution of the log importance weights of the measured step,
  with PSIS k-hat and ESS/N;
- ``projections``: per-prompt values (each panel's series: one point per prompt) with their mean
  and the mean's standard error ``sd / sqrt(n)`` -- the numbers the headline SEs are made of;
- ``sweep``: predicted +- SE and measured +- SE against lr (and against B when B varies).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from entprobe.runtime.atomic_io import atomic_open

DPI = 110


def _save(fig: Figure, path: str | Path) -> Path:
    """Render on an Agg canvas into ``path``, atomically (``atomic_io``: a failed render leaves
    the earlier file, never a partial one)."""
    path = Path(path)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, dpi=DPI, format=path.suffix.lstrip(".") or "png")
    return path


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean ``sd / sqrt(n)`` (nan below 2 values)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size >= 2 else math.nan


def attribution(by_layer: Mapping[str, float], by_kind: Mapping[str, float], path: str | Path,
                title: str = "") -> Path:
    """Two bar charts of the per-parameter terms ``Xbar_i . P_i . Ybar_i`` summed by layer (in
    layer order) and by module kind; the terms sum to ``bars_dot``."""
    fig = Figure(figsize=(10, 3.8))
    ax_l, ax_k = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(len(by_layer), 3), max(len(by_kind), 3)]})
    for ax, data, what in ((ax_l, by_layer, "layer"), (ax_k, by_kind, "module kind")):
        names = list(data)
        vals = [data[n] for n in names]
        ax.bar(range(len(names)), vals, color=["tab:red" if v < 0 else "tab:blue" for v in vals])
        ax.set_xticks(range(len(names)), [n.replace("layer_", "") for n in names], rotation=60, ha="right",
                      fontsize=8)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(what)
        ax.set_ylabel("contribution to Xbar.P.Ybar")
    fig.suptitle(title or "attribution of Xbar.P.Ybar (deltaH1 = -lr x the sum)")
    return _save(fig, path)


def importance_weights(log_weights: Sequence[float], khat: float, ess_frac: float, path: str | Path,
                       item: str = "response") -> Path:
    """Histogram of the log importance weights ``log w = S(theta_plus) - S(theta)`` of the measured
    step (one per ``item``), and the sorted normalised weights on a log scale (a heavy right tail
    is what a large PSIS k-hat means: k-hat > 0.7 is unreliable)."""
    lw = np.asarray(log_weights, dtype=float).reshape(-1)
    lw = lw[np.isfinite(lw)]
    fig = Figure(figsize=(10, 3.6))
    ax_h, ax_s = fig.subplots(1, 2)
    ax_h.hist(lw, bins=min(50, max(5, lw.size // 4)), color="tab:blue")
    ax_h.axvline(0, color="black", lw=0.6)
    ax_h.set_xlabel(f"log importance weight per {item}")
    ax_h.set_ylabel("count")
    if lw.size:
        w = np.exp(lw - lw.max())
        w = np.sort(w / w.sum())[::-1]
        ax_s.semilogy(np.arange(1, w.size + 1), w, ".-", ms=3)
        ax_s.axhline(1.0 / w.size, color="gray", ls="--", lw=0.8, label="uniform 1/N")
        ax_s.legend(fontsize=8)
    ax_s.set_xlabel("rank")
    ax_s.set_ylabel("normalised weight")
    k = f"{khat:.2f}" if math.isfinite(khat) else "n/a (< 25 weights or fit failed)"
    fig.suptitle(f"importance weights of the measured step: PSIS k-hat {k}, ESS/N {ess_frac:.2f}, N {lw.size}")
    return _save(fig, path)


def projections(panels: Sequence[tuple[str, Mapping[str, Sequence[float]]]], path: str | Path) -> Path:
    """One panel per ``(title, {label: per-prompt values})``: each series as points by prompt, its
    mean as a line and the band mean +- SE (``mean_se``)."""
    fig = Figure(figsize=(10, 3.4 * len(panels)))
    axes = np.atleast_1d(fig.subplots(len(panels), 1, squeeze=False)[:, 0])
    for ax, (title, series) in zip(axes, panels):
        for i, (label, values) in enumerate(series.items()):
            x = np.asarray(values, dtype=float)
            m, se = mean_se(x)
            color = f"C{i}"
            offset = (i - (len(series) - 1) / 2) * 0.15
            ax.plot(np.arange(x.size) + offset, x, "o", ms=3.5, color=color, alpha=0.75,
                    label=f"{label}: {m:+.3g} ± {se:.2g}")
            ax.axhline(m, color=color, lw=1.2)
            if math.isfinite(se):
                ax.axhspan(m - se, m + se, color=color, alpha=0.15)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_title(title, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("prompt")
        ax.set_ylabel("nats")
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def sweep(rows: Sequence[Mapping[str, float]], path: str | Path, x_keys: Sequence[str],
          series_key=None) -> Path:
    """Predicted (``deltaH_pred`` +- ``SE_deltaH_pred``) and measured (``deltaH_true`` +-
    ``SE_deltaH_true``) entropy change, one panel per x in ``x_keys`` (e.g. ``lr``, ``B_E``).
    ``series_key(row, x)``: the label of the line a row belongs to in the panel of ``x`` (the other
    settings that vary), so each line changes only ``x``. lr panels use a log x axis; the y axis is
    symmetric-log when values span decades."""
    fig = Figure(figsize=(6.5 * len(x_keys), 4.2))
    axes = fig.subplots(1, len(x_keys), squeeze=False)[0]
    for ax, xk in zip(axes, x_keys):
        groups: dict[str, list] = {}
        for r in rows:
            groups.setdefault(series_key(r, xk) if series_key else "", []).append(r)
        for gi, (label, rs) in enumerate(sorted(groups.items())):
            rs = sorted(rs, key=lambda r: r[xk])
            x = np.array([r[xk] for r in rs], dtype=float)
            for j, (key, what, mk) in enumerate((("deltaH_pred", "predicted", "o-"), ("deltaH_true", "measured", "s--"))):
                y = np.array([r.get(key, math.nan) for r in rs], dtype=float)
                se = np.array([r.get(f"SE_{key}", math.nan) for r in rs], dtype=float)
                if not np.isfinite(y).any():
                    continue
                shift = x * (1.0 + 0.04 * (j - 0.5)) if xk == "lr" else x + 0.08 * (j - 0.5) * max(np.ptp(x), 1)
                ax.errorbar(shift, y, yerr=np.where(np.isfinite(se), se, 0), fmt=mk, ms=4, capsize=3,
                            color=f"C{2 * gi + j}", label=f"{what} {label}".strip())
        if xk == "lr":
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ys = [abs(r.get(k, 0.0)) for r in rows for k in ("deltaH_pred", "deltaH_true")
              if math.isfinite(r.get(k, math.nan)) and r.get(k, 0.0) != 0]
        if ys and max(ys) / min(ys) > 1e3:
            ax.set_yscale("symlog", linthresh=min(ys))
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel(xk)
        ax.set_ylabel("entropy change of the step (nats)")
        ax.legend(fontsize=7)
    fig.suptitle("predicted vs measured entropy change (± SE)")
    return _save(fig, path)
