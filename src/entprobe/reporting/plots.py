"""PNG figures of one run and of a sweep (matplotlib's object API on the Agg canvas: no pyplot, no
global backend switch, no display needed). Each function takes plain numbers, writes one PNG and
returns its path; callers decide what a failure means (reporting/markdown.py turns it into a warning).
Entropy changes are in nats with their own sign (negative: entropy falls); intervals are the 95%
intervals the verdict quotes (Student-t with n - 1 degrees of freedom unless given).

- ``attribution``: the headline ``deltaH_pred`` (the AdamW step's predicted change) split by layer
  and by module kind; a note on the figure when every part is 0;
- ``importance_weights``: the log importance weights of the measured step (a strip of points when
  there are few, else a histogram with whole-number counts), with PSIS k-hat and ESS/N;
- ``projections``: per-prompt values (one point per prompt), each series' mean and 95% interval;
  unrelated prompt sets (E's, U's) in panels of their own;
- ``sweep``: predicted and measured change with 95% intervals against lr, as they are (symmetric-log
  y where needed) and per unit lr (``deltaH / lr``: flat where first order holds).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, NullLocator

from entprobe.math.estimators import t_quantile
from entprobe.runtime.atomic_io import atomic_open

DPI = 110
FALLS, RISES = "tab:blue", "tab:red"  # an entropy change's sign, in every figure
PRED_STYLE = dict(marker="o", ls="-", mfc=None)  # predicted: filled markers, solid lines
TRUE_STYLE = dict(marker="s", ls="--", mfc="white")  # measured: open markers, dashed lines
KIND_ORDER = ("attention", "mlp", "embeddings", "norms", "lm_head", "other")


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


def ci95(mean: float, se: float, n: float) -> tuple[float, float]:
    """``mean -+ t_{n-1} SE`` (nan without a finite SE or below 2 values)."""
    if not (math.isfinite(se) and n >= 2):
        return math.nan, math.nan
    h = t_quantile(n - 1) * se
    return mean - h, mean + h


def _note(ax, text: str, y: float = 0.5) -> None:
    """A boxed note across ``ax`` at height ``y`` (axes fraction): why a panel is empty."""
    ax.text(0.5, y, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, wrap=True,
            bbox=dict(boxstyle="round", fc="lightyellow", ec="gray"))


def symlog_y(ax, values: Sequence[float]) -> bool:
    """A symmetric-log y axis when ``values`` (all a panel shows, interval ends included) mix
    signs across decades or span more than two decades; ticks at 0 and at most ~5 powers of ten
    per sign, none inside the linear band around 0, so no two labels collide. False: left linear."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    nz = np.abs(v[v != 0])
    if nz.size == 0 or nz.max() / nz.min() <= 100:
        return False
    e0, e1 = math.floor(math.log10(nz.min())), math.ceil(math.log10(nz.max()))
    ax.set_yscale("symlog", linthresh=10.0 ** e0, linscale=0.6)
    step = max(1, math.ceil((e1 - e0) / 5))
    pos = [10.0 ** e for e in range(e0 + step, e1 + 1, step)]
    ticks = ([-p for p in pos[::-1]] if (v < 0).any() else []) + [0.0] + (pos if (v > 0).any() else [])
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.margins(y=0.08)
    ax.yaxis.set_major_formatter(FuncFormatter(
        lambda y, _: "0" if y == 0 else "$" + ("-" if y < 0 else "") + f"10^{{{round(math.log10(abs(y)))}}}$"))
    return True


# ----------------------------------------------------------------------------- attribution
def _layer_label(name: str) -> str:
    """``layer_003`` -> ``3``; ``non_layer`` (embeddings, final norm, head) -> ``outside layers``."""
    if name == "non_layer":
        return "outside\nlayers"
    tail = name.rpartition("_")[2]
    return str(int(tail)) if tail.isdigit() else name


def attribution(by_layer: Mapping[str, float], by_kind: Mapping[str, float], path: str | Path,
                total: float = math.nan, note: str = "") -> Path:
    """Two bar charts of each parameter tensor's part of ``deltaH_pred`` (nats, negative: entropy
    falls), summed by layer (in layer order; embeddings, final norm and head are "outside layers")
    and by module kind; the bars of each panel sum to ``total``. ``note`` (why the step is what it
    is, e.g. no gradient) goes under the title; when every part is 0 it (or a default) is boxed in
    the empty panel instead."""
    layers = sorted((k for k in by_layer if k != "non_layer")) + (["non_layer"] if "non_layer" in by_layer else [])
    kinds = [k for k in KIND_ORDER if k in by_kind] + sorted(k for k in by_kind if k not in KIND_ORDER)
    fig = Figure(figsize=(11, 4.2))
    ax_l, ax_k = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(len(layers), 4), max(len(kinds), 3) + 1]})
    empty = not any(v for v in (*by_layer.values(), *by_kind.values()) if math.isfinite(v))
    for ax, names, data, label, what in ((ax_l, layers, by_layer, _layer_label, "layer"),
                                         (ax_k, kinds, by_kind, str, "module kind")):
        vals = [float(data[n]) for n in names]
        bars = ax.bar(range(len(names)), vals, color=[FALLS if v < 0 else RISES for v in vals], width=0.75)
        ax.set_xticks(range(len(names)), [label(n) for n in names], fontsize=8,
                      rotation=0 if what == "layer" and len(names) <= 16 else 45)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(what)
        ax.set_ylabel("part of ΔH_pred (nats)")
        if what == "module kind" and not empty:
            ax.bar_label(bars, [f"{v:+.2g}" for v in vals], fontsize=7, padding=2)
            ax.margins(y=0.15)
        if empty:
            ax.set_ylim(-1, 1)
    if empty:
        _note(ax_l, note or "every part is 0: the AdamW step does not change the entropy to first order", 0.75)
    ax_k.legend(handles=[Patch(color=c, label=t) for c, t in (
        (FALLS, "entropy falls (< 0)"), (RISES, "entropy rises (> 0)"))], loc="best", fontsize=7)
    tot = f"ΔH_pred = {total:+.3g} nats (each panel's bars sum to it)" if math.isfinite(total) else "ΔH_pred"
    fig.suptitle(f"Predicted entropy change of the next AdamW step, by layer and by module kind: {tot}"
                 + (f"\n{note}" if note and not empty else ""), fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- importance weights
FEW_WEIGHTS = 40  # below: a strip of points (a histogram of a handful of values says little)


def importance_weights(log_weights: Sequence[float], khat: float, ess_frac: float, path: str | Path,
                       item: str = "response") -> Path:
    """The log importance weights ``log w = S(theta_plus) - S(theta)`` of the measured step (one per
    ``item``): a strip of points below ``FEW_WEIGHTS`` values, else a histogram (whole-number count
    ticks); beside it the sorted normalised weights on a log scale (a heavy right tail is what a
    large PSIS k-hat means: k-hat > 0.7 is unreliable)."""
    lw = np.asarray(log_weights, dtype=float).reshape(-1)
    lw = lw[np.isfinite(lw)]
    fig = Figure(figsize=(10, 3.6))
    ax_h, ax_s = fig.subplots(1, 2)
    if lw.size < FEW_WEIGHTS:
        jitter = (np.arange(lw.size) % 5 - 2) * 0.08  # deterministic: ties stay visible
        ax_h.plot(lw, jitter, "o", ms=6, alpha=0.7, color="tab:blue")
        ax_h.set_ylim(-1, 1)
        ax_h.yaxis.set_major_locator(NullLocator())
        ax_h.set_ylabel(f"{lw.size} {item}s")
        if not lw.size:
            _note(ax_h, "no finite importance weight")
    else:
        ax_h.hist(lw, bins=min(50, max(5, lw.size // 4)), color="tab:blue")
        ax_h.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax_h.set_ylabel(f"{item}s")
    ax_h.axvline(0, color="black", lw=0.6)
    ax_h.set_xlabel(f"log importance weight per {item} (0: unchanged by the step)")
    if lw.size:
        w = np.exp(lw - lw.max())
        w = np.sort(w / w.sum())[::-1]
        ax_s.semilogy(np.arange(1, w.size + 1), w, ".-", ms=4)
        ax_s.axhline(1.0 / w.size, color="gray", ls="--", lw=0.8, label="uniform 1/N")
        ax_s.legend(fontsize=8)
    ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.set_xlabel("rank")
    ax_s.set_ylabel("normalised weight")
    k = f"{khat:.2f}" if math.isfinite(khat) else "n/a (< 25 weights or fit failed)"
    fig.suptitle(f"importance weights of the measured step: PSIS k-hat {k}, ESS/N {ess_frac:.2f}, N {lw.size}",
                 fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- per-prompt values
Panel = tuple  # (title, x label, {label: per-prompt values}, {label: (low, high)} 95% intervals given)


def _panel(ax, title: str, xlabel: str, series: Mapping[str, Sequence[float]],
           intervals: Mapping[str, tuple[float, float]]) -> None:
    xs = {}
    for i, (label, values) in enumerate(series.items()):
        x = np.asarray(values, dtype=float)
        m, se = mean_se(x)
        lo, hi = intervals.get(label) or ci95(m, se, x.size)
        color = f"C{i}"
        offset = (i - (len(series) - 1) / 2) * 0.15
        xs[label] = (np.arange(x.size) + offset, x)
        band = f", 95% [{lo:+.3g}, {hi:+.3g}]" if math.isfinite(lo) and math.isfinite(hi) else ", no interval"
        ax.plot(xs[label][0], x, "o" if i == 0 else "s", ms=4, color=color, alpha=0.8,
                mfc=color if i == 0 else "white", label=f"{label}: mean {m:+.3g}{band}")
        ax.axhline(m, color=color, lw=1.2)
        if math.isfinite(lo) and math.isfinite(hi):
            ax.axhspan(lo, hi, color=color, alpha=0.12)
    if len(series) == 2 and len({len(v) for v in series.values()}) == 1:  # paired: the same prompts
        (xa, ya), (xb, yb) = xs.values()
        for a, b, c, d in zip(xa, xb, ya, yb):
            ax.plot([a, b], [c, d], color="gray", lw=0.5, zorder=0)
    ax.axhline(0, color="black", lw=0.5)
    flat = [v for vals in series.values() for v in vals if math.isfinite(v)]
    if flat and not any(flat):  # e.g. the X / Y projections of a zero gradient
        ax.set_ylim(-1, 1)
        _note(ax, "every value is exactly 0", 0.75)
    ax.set_title(title, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("nats")
    if series:
        ax.legend(fontsize=7, loc="best")


def projections(rows: Sequence[Sequence[Panel]], path: str | Path) -> Path:
    """One row of panels per entry of ``rows``; each panel ``(title, x label, {label: per-prompt
    values}, {label: (low, high)})`` shows each series as points by prompt, its mean as a line and
    its 95% interval as a band (the one given, e.g. the verdict's, else ``ci95`` of the values).
    Series in one panel share the x axis (the same prompts: two of equal length are paired)."""
    rows = [list(r) for r in rows if r]
    ncol = max(len(r) for r in rows)
    fig = Figure(figsize=(10, 3.4 * len(rows)))
    grid = fig.add_gridspec(len(rows), ncol)
    for i, row in enumerate(rows):
        span = ncol // len(row)
        for j, (title, xlabel, series, intervals) in enumerate(row):
            _panel(fig.add_subplot(grid[i, j * span:(j + 1) * span]), title, xlabel, series, intervals)
    return _save(fig, path)


# ----------------------------------------------------------------------------- sweep
def _interval(r: Mapping[str, float], key: str) -> tuple[float, float]:
    """The row's 95% interval of ``key`` (``deltaH_pred``: ``ci95_pred_*``, ``deltaH_true``:
    ``ci95_true_*``), else ``ci95`` of its SE with ``B_E`` values."""
    tag = {"deltaH_pred": "pred", "deltaH_true": "true"}[key]
    lo, hi = r.get(f"ci95_{tag}_low", math.nan), r.get(f"ci95_{tag}_high", math.nan)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    return ci95(r.get(key, math.nan), r.get(f"SE_{key}", math.nan), r.get("B_E", math.nan))


def sweep(rows: Sequence[Mapping[str, float]], path: str | Path,
          series_of: Callable[[Mapping[str, float]], str] | None = None, title: str = "") -> Path:
    """Predicted (``deltaH_pred``: filled markers, solid lines) and measured (``deltaH_true``: open
    markers, dashed lines) entropy change with 95% intervals against lr (log x), left as they are
    (symmetric-log y where they span decades or mix signs), right divided by lr. One colour per
    series (``series_of(row)``: the other settings, e.g. ``B_E=8,B_U=8``), the same in both panels;
    lines join a series' points along lr only, and series are nudged apart in x."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(series_of(r) if series_of else "", []).append(r)
    fig = Figure(figsize=(12, 4.6))
    ax_raw, ax_per = fig.subplots(1, 2)
    shown: list[float] = []
    n = len(groups)
    def order(item):  # series by their settings' numbers (B_E=8 before B_E=16)
        return tuple(item[1][0].get(k, 0) for k in ("B_E", "B_U")), item[0]

    for gi, (label, rs) in enumerate(sorted(groups.items(), key=order)):
        rs = sorted(rs, key=lambda r: r["lr"])
        lr = np.array([r["lr"] for r in rs], dtype=float)
        color = f"C{gi}"
        for j, (key, what, style) in enumerate((("deltaH_pred", "predicted", PRED_STYLE),
                                                ("deltaH_true", "measured", TRUE_STYLE))):
            y = np.array([r.get(key, math.nan) for r in rs], dtype=float)
            if not np.isfinite(y).any():
                continue
            lo, hi = np.array([_interval(r, key) for r in rs], dtype=float).reshape(-1, 2).T
            err = np.vstack([np.where(np.isfinite(lo), y - lo, 0), np.where(np.isfinite(hi), hi - y, 0)])
            x = lr * 1.07 ** (2 * gi + j - (2 * n - 1) / 2)  # nudged apart on the log axis
            name = f"{what} {label}".strip() + ("" if np.isfinite(lo).any() else " (no interval: SE not finite)")
            kw = dict(marker=style["marker"], ls=style["ls"] if lr.size > 1 else "none", ms=5, capsize=3,
                      color=color, mfc=style["mfc"] or color, lw=1.2)
            ax_raw.errorbar(x, y, yerr=err, label=name, **kw)
            ax_per.errorbar(x, y / lr, yerr=err / lr, **kw)
            shown += [*y, *lo, *hi]
    lrs = [r["lr"] for r in rows if r.get("lr", 0) > 0]
    for ax in (ax_raw, ax_per):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        if lrs and max(lrs) / min(lrs) < 10:  # at least one labelled decade
            ax.set_xlim(min(lrs) / 3.2, max(lrs) * 3.2)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel("lr")
    symlog_y(ax_raw, shown)
    ax_raw.set_ylabel("entropy change of the step (nats)")
    ax_per.set_ylabel("entropy change / lr (nats per unit lr)")
    ax_per.set_title("per unit lr: flat where first order holds", fontsize=9)
    if not any(math.isfinite(v) for v in shown):
        _note(ax_raw, "no finite prediction or measurement")
    else:
        ax_raw.legend(fontsize=7)
    fig.suptitle(title or "predicted (filled, solid) and measured (open, dashed) entropy change; bars: 95% intervals",
                 fontsize=10)
    return _save(fig, path)
