"""An lr sweep of the probe on shared batches: prediction vs measured entropy change per lr.

Composes entprobe's real Hydra config (``_common.compose``, as the CLI would) once per lr and calls
``entprobe.main.run(cfg)`` with ``optimizer.lr=<lr>``. The first lr samples E and U and writes them
with ``batch.save=<out>/batches``; every later lr reads them back with ``batch.load=<out>/batches``,
so all lrs see the same E, U and Adam state and differ only in the step size (the first-order
deltaH1 is exactly linear in lr; the measured deltaH_true is not). Each run writes its own
``results.json`` under ``<out>/runs/lr_<lr>/``. As in a multirun, the runs share one batch cache
(``<out>/batch_cache``, emptied at the start): the first lr computes Stages 1-2 and every later lr
rescales them (``batch.share_across_lr``, docs/scaling.md); ``--own-stage12`` makes every lr compute
its own, for timing the difference (columns ``wall_s``, ``stage12_s``: the Stage 1-2 phases, and
``reused_stage12``).

From each result dict it collects (``.get``, NaN when a key is absent): deltaH_pred,
SE_deltaH_pred, ci95_pred_low/high, deltaH1, SE_deltaH1, deltaH1_step, deltaH_true, SE_deltaH_true,
deltaH_true_minus_pred, SE_deltaH_true_minus_pred, ESS_frac, H_orig and the parts of the prediction
(gradient / momentum / weight decay), and writes

- ``<out>/lr_sweep.csv``: one row per lr (plus wall time, lr_source, batch_source, status, error);
- ``<out>/lr_sweep.md``: lr, prediction +- SE, measured +- SE, difference +- SE, z, ESS_frac (and
  deltaH1 +- SE beside); "prediction" is deltaH_pred, or deltaH1 where deltaH_pred is absent;
- ``<out>/lr_sweep.png``: prediction and measured with their 95% intervals (the runs' own,
  Student-t) against lr (log x, symmetric-log y in nats), and (measured - predicted) / |predicted|
  with its paired 95% interval in a second panel: where it leaves 0, first order stops holding
  (needs matplotlib: ``pip install matplotlib``; without it the PNG is skipped with a message).
  ``--replot`` redraws the PNG and the table from ``<out>/lr_sweep.csv`` without running.

A failing lr is recorded (status ``error`` and the message) and the sweep goes on; the exit status
is always 0 (a measurement, not a test). Commands (from the repository root):

    .venv/bin/python benchmarks/lr_sweep.py --checkpoint /tmp/smollm2_adamw          # SmolLM2 (smollm2_checkpoint.py)
    .venv/bin/python benchmarks/lr_sweep.py --builtin --out /tmp/lr_sweep_builtin     # built-in model, lrs 1e-4,1e-3,1e-2
    .venv/bin/python benchmarks/lr_sweep.py --checkpoint DIR --lrs 1e-6,1e-5 --B-E 4 --B-U 4 --G 4 \\
        --max-new-tokens 24 --weighting-mode sequence -- model.device=cpu             # extra Hydra overrides after --
"""
from __future__ import annotations

import argparse
import csv
import math
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_LRS = "1e-7,1e-6,1e-5,3e-5,1e-4"
BUILTIN_LRS = "1e-4,1e-3,1e-2"
KEYS = ["deltaH_pred", "SE_deltaH_pred", "ci95_pred_low", "ci95_pred_high", "deltaH1", "SE_deltaH1",
        "deltaH1_step", "deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred", "SE_deltaH_true_minus_pred",
        "ESS_frac", "H_orig", "deltaH_pred_gradient", "deltaH_pred_momentum", "deltaH_pred_weight_decay",
        "ci95_true_low", "ci95_true_high", "ci95_true_minus_pred_low", "ci95_true_minus_pred_high"]
EXTRA = ["lr_source", "batch_source", "weighting_mode", "time/total_s", "reused_stage12"]
STAGE12_PHASES = ("accumulate_Y_U", "accumulate_X_E", "variance", "stage12_load", "stage12_store")
NAN = float("nan")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="HF Trainer-layout folder (weights, tokenizer, optimizer.pt): "
                     "model=hf model.path=DIR optimizer.state_path=DIR")
    src.add_argument("--builtin", action="store_true",
                     help=f"the built-in default model and its own optimizer state (lrs default {BUILTIN_LRS})")
    ap.add_argument("--lrs", default=None, help=f"comma-separated (default {DEFAULT_LRS}; --builtin: {BUILTIN_LRS})")
    ap.add_argument("--out", default=str(HERE / "results" / "lr_sweep"))
    ap.add_argument("--B-E", dest="B_E", type=int, default=8)
    ap.add_argument("--B-U", dest="B_U", type=int, default=8)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--weighting-mode", default="sequence", choices=["sequence", "dr_grpo", "per_token_avg"])
    ap.add_argument("--reuse-batches", action="store_true",
                    help="load <out>/batches for every lr when E.pt and U.pt are already there")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: redraw lr_sweep.png and lr_sweep.md from <out>/lr_sweep.csv")
    ap.add_argument("--table", action="store_true", help="print entprobe's full results table per lr")
    ap.add_argument("--own-stage12", action="store_true",
                    help="every lr computes its own Stages 1-2 (batch.share_across_lr=false)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides after --")
    return ap.parse_args()


def fnum(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return NAN


def fmt(x: float, sig: int = 3) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.{sig}g}"


def pm(v: float, se: float) -> str:
    return f"{fmt(v)} ± {fmt(se, 2)}"


def prediction(row: dict) -> tuple[float, float, str]:
    """deltaH_pred +- SE when present, else the first-order deltaH1 +- SE."""
    if math.isfinite(row["deltaH_pred"]):
        return row["deltaH_pred"], row["SE_deltaH_pred"], "deltaH_pred"
    return row["deltaH1"], row["SE_deltaH1"], "deltaH1"


def difference(row: dict, pred: float) -> tuple[float, float]:
    """The probe's own deltaH_true - pred and its SE (paired on E); without it, the plain
    difference and SE NaN (the two share E, so their SEs do not add)."""
    if math.isfinite(row["deltaH_true_minus_pred"]):
        return row["deltaH_true_minus_pred"], row["SE_deltaH_true_minus_pred"]
    return row["deltaH_true"] - pred, NAN


def run_sweep(a: argparse.Namespace, lrs: list[float], out: Path) -> list[dict]:
    sys.path.insert(0, str(HERE))
    from _common import compose
    from entprobe.cli.probe_job import run

    batches, cache = out / "batches", out / "batch_cache"
    shutil.rmtree(cache, ignore_errors=True)  # the first lr computes Stages 1-2 in this invocation
    base = [f"batch.B_E={a.B_E}", f"batch.B_U={a.B_U}", f"batch.G={a.G}",
            f"sampling.max_new_tokens={a.max_new_tokens}", f"probe.weighting_mode={a.weighting_mode}",
            "logging.wandb.mode=disabled", "logging.progress=false",
            f"logging.console_table={'true' if a.table else 'false'}",
            f"batch.share_across_lr={'false' if a.own_stage12 else 'true'}"]
    if a.checkpoint:
        ck = Path(a.checkpoint).expanduser().resolve()
        base = ["model=hf", f"model.path={ck}", f"optimizer.state_path={ck}", *base]
    have = (batches / "E.pt").is_file() and (batches / "U.pt").is_file()
    rows = []
    for i, lr in enumerate(lrs):
        load = (a.reuse_batches and have) or (i > 0 and (batches / "E.pt").is_file())
        io = f"batch.load={batches}" if load else f"batch.save={batches}"
        ov = [*base, f"optimizer.lr={lr!r}", io, f"run_dir={out / 'runs' / f'lr_{lr:g}'}", *a.overrides]
        row = {"lr": lr, **{k: NAN for k in KEYS}, **{k: "" for k in EXTRA}, "status": "ok", "error": "",
               "wall_s": NAN, "stage12_s": NAN}
        print(f"[lr {lr:g}] {'load' if load else 'sample + save'} batches; overrides: {' '.join(ov)}", flush=True)
        t0 = time.perf_counter()
        try:
            res = run(compose(ov), batch_cache=cache)
            for k in KEYS:
                row[k] = fnum(res.get(k, NAN))
            for k in EXTRA:
                row[k] = res.get(k, "")
            row["stage12_s"] = sum(fnum(res.get(f"time/{p}_s", 0.0)) for p in STAGE12_PHASES)
        except Exception as exc:  # a measurement: record and go on
            traceback.print_exc()
            row["status"], row["error"] = "error", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
        row["wall_s"] = time.perf_counter() - t0
        p, se, which = prediction(row)
        first = "" if which == "deltaH1" else f"deltaH1 {pm(row['deltaH1'], row['SE_deltaH1'])}, "
        print(f"[lr {lr:g}] {row['status']} in {row['wall_s']:.1f}s (Stages 1-2 {row['stage12_s']:.1f}s, "
              f"reused {row['reused_stage12']}): {which} {pm(p, se)}, "
              f"{first}deltaH1_step {fmt(row['deltaH1_step'])}, "
              f"deltaH_true {pm(row['deltaH_true'], row['SE_deltaH_true'])}, ESS_frac {fmt(row['ESS_frac'])}",
              flush=True)
        rows.append(row)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    cols = ["lr", "status", "wall_s", "stage12_s", *KEYS, *EXTRA, "error"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})


def write_md(rows: list[dict], path: Path, header: str) -> None:
    lines = [f"# lr sweep: {header}", "",
             "prediction = deltaH_pred (deltaH1 where absent); measured = deltaH_true; "
             "difference = deltaH_true_minus_pred (paired SE); z = difference / SE.", "",
             "| lr | prediction ± SE | measured ± SE | difference ± SE | z | ESS_frac | deltaH1 ± SE | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['lr']:g} | error: {r['error'][:120]} | | | | | | {r['wall_s']:.1f} |")
            continue
        p, se, which = prediction(r)
        d, dse = difference(r, p)
        z = d / dse if math.isfinite(dse) and dse > 0 else NAN
        tag = "" if which == "deltaH_pred" else " (deltaH1)"
        lines.append(f"| {r['lr']:g} | {pm(p, se)}{tag} | {pm(r['deltaH_true'], r['SE_deltaH_true'])} | "
                     f"{pm(d, dse)} | {fmt(z)} | {fmt(r['ESS_frac'])} | {pm(r['deltaH1'], r['SE_deltaH1'])} | "
                     f"{r['wall_s']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def interval(r: dict, which: str, p: float, se: float) -> tuple[float, float]:
    """The run's own 95% interval (``ci95_pred_*`` / ``ci95_true_*``, Student-t as the verdict
    quotes it), else ``p -+ 1.96 se``."""
    tag = {"deltaH_pred": "pred", "deltaH_true": "true"}.get(which)
    lo, hi = (r.get(f"ci95_{tag}_low", NAN), r.get(f"ci95_{tag}_high", NAN)) if tag else (NAN, NAN)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    return p - 1.96 * se, p + 1.96 * se


def write_png(rows: list[dict], path: Path, header: str) -> None:
    """Prediction and measurement with their 95% intervals against lr (symmetric-log y in nats,
    ticks clear of 0: ``plots.symlog_y``), and (measured - predicted) / |predicted| with the paired
    95% interval below: where it leaves 0, first order stops holding."""
    try:
        from entprobe.reporting import plots
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (pip install matplotlib)", flush=True)
        return
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        print(f"no successful lr: no {path.name}", flush=True)
        return
    ok.sort(key=lambda r: r["lr"])
    lr = [r["lr"] for r in ok]
    pred = [prediction(r) for r in ok]
    fig = Figure(figsize=(7, 7))
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    shift = 1.04  # nudge the two series apart on the log axis
    shown = []
    for j, (name, vals, style) in enumerate((
            (pred[0][2], [(p, se) for p, se, _ in pred], plots.PRED_STYLE),
            ("deltaH_true", [(r["deltaH_true"], r["SE_deltaH_true"]) for r in ok], plots.TRUE_STYLE))):
        y = [v for v, _ in vals]
        lo, hi = zip(*(interval(r, name, v, se) for r, (v, se) in zip(ok, vals)))
        err = [[v - a if math.isfinite(a) else 0 for v, a in zip(y, lo)], [b - v if math.isfinite(b) else 0 for v, b in zip(y, hi)]]
        label = {"deltaH_pred": "predicted deltaH_pred", "deltaH1": "predicted deltaH1 (no deltaH_pred)",
                 "deltaH_true": "measured deltaH_true"}[name]
        ax.errorbar([x * shift ** (2 * j - 1) for x in lr], y, yerr=err, marker=style["marker"], ls=style["ls"],
                    mfc=style["mfc"] or f"C{j}", color=f"C{j}", capsize=3, label=f"{label}, 95% interval")
        shown += [*y, *lo, *hi]
    if pred[0][2] == "deltaH_pred" and any(math.isfinite(r["deltaH1"]) for r in ok):
        ax.plot(lr, [r["deltaH1"] for r in ok], "x:", color="grey", label="deltaH1 = -lr Xbar.P.Ybar (Adam's preconditioned gradient alone, not the AdamW step)")
        shown += [r["deltaH1"] for r in ok]
    ax.set_xscale("log")
    plots.symlog_y(ax, shown)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_ylabel("entropy change of the step (nats)")
    ax.set_title(header, fontsize=9)
    ax.legend(fontsize=7)
    # where first order stops holding: the paired difference relative to the prediction, 95% interval
    rel, err = [], []
    for r, (p, _, _) in zip(ok, pred):
        d, lo, hi = r["deltaH_true_minus_pred"], r["ci95_true_minus_pred_low"], r["ci95_true_minus_pred_high"]
        ok_p = math.isfinite(p) and p != 0
        rel.append(d / abs(p) if ok_p and math.isfinite(d) else NAN)
        err.append((hi - lo) / 2 / abs(p) if ok_p and math.isfinite(lo) and math.isfinite(hi) else 0.0)
    ax2.errorbar(lr, rel, yerr=err, fmt="o-", capsize=3, color="C2")
    ax2.axhline(0, color="k", lw=0.5, ls="--")
    ax2.set_xscale("log")
    ax2.set_xlabel("lr")
    ax2.set_ylabel("(measured - predicted) / |predicted|\n95% interval (paired), a fraction", fontsize=8)
    plots._save(fig, path)


def header_of(a: argparse.Namespace) -> str:
    """The figure's and table's title: the checkpoint by its folder name (never a full path)."""
    name = "built-in model" if a.builtin else Path(a.checkpoint).expanduser().resolve().name
    return (f"{name}: B_E={a.B_E} B_U={a.B_U} G={a.G}, {a.max_new_tokens} new tokens, "
            f"{a.weighting_mode} entropy")


def read_csv(path: Path) -> list[dict]:
    """The rows ``write_csv`` wrote (numbers back as floats), for ``--replot``."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: (v if k in ("status", "error", *EXTRA) else fnum(v)) for k, v in r.items()} for r in rows]


def main() -> int:
    a = parse_args()
    lrs = [float(x) for x in (a.lrs or (BUILTIN_LRS if a.builtin else DEFAULT_LRS)).split(",") if x.strip()]
    out = Path(a.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    header = header_of(a)
    t0 = time.perf_counter()
    try:
        rows = read_csv(out / "lr_sweep.csv") if a.replot else run_sweep(a, lrs, out)
    except Exception:  # set-up failed (imports, config): report, still exit 0
        traceback.print_exc()
        return 0
    for name, fn in (("lr_sweep.csv", lambda p: write_csv(rows, p)), ("lr_sweep.md", lambda p: write_md(rows, p, header)),
                     ("lr_sweep.png", lambda p: write_png(rows, p, header))):
        try:
            fn(out / name)
        except Exception:
            traceback.print_exc()
    print(f"[sweep] {len(rows)} lrs in {time.perf_counter() - t0:.1f}s (jobs {sum(r['wall_s'] for r in rows):.1f}s, "
          f"Stages 1-2 {sum(r['stage12_s'] for r in rows if math.isfinite(r['stage12_s'])):.1f}s) "
          f"-> {out}/lr_sweep.{{csv,md,png}}")
    print((out / "lr_sweep.md").read_text() if (out / "lr_sweep.md").is_file() else "")
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
