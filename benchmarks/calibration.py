"""Calibration of the probe on real checkpoints: do the paired 95% intervals hold 0 as often as they say?

For each checkpoint, each E draw (``batch.seed_E`` = ``--seed-E0`` + d, d = 0 .. ``--draws`` - 1; U is
fixed per checkpoint by ``batch.seed_U``, so every draw predicts and takes the *same* real step and
only the evaluation responses change) and each lr, it composes entprobe's real Hydra config
(``_common.compose``, as the CLI would) and calls ``entprobe.main.run(cfg)``. The lrs of one draw
share one batch cache (``batch.share_across_lr``): the first lr samples E and U and computes
Stages 1-2, the others rescale them, so each further lr costs one prediction and one real step.

Per (checkpoint, lr) it reports, over the draws whose measurement is trusted (``measurable``):

- ``holds0``: the fraction of paired intervals ``ci95_true_minus_pred`` holding 0 (target 0.95; the
  probe's intervals are stated to cover 0.93-0.97 where ESS/N >= 0.9), its binomial SE
  ``sqrt(p (1 - p) / n)`` and a one-sided binomial p-value of ``n - k`` or more rejections at 5%;
- sign agreement of ``deltaH_pred`` and ``deltaH_true``: among draws where both exceed their own SE
  in size ("resolved"), and among all measurable draws;
- ``measured/predicted``: ``mean(deltaH_true) / mean(deltaH_pred)`` over draws, with a 95%
  percentile bootstrap over draws (2000 resamples, seeded) and the delta-method SE; and the
  least-squares slope of measured on predicted through 0 with its bootstrap interval (better
  conditioned when the draws' predictions scatter around 0);
- the median of ``SE_deltaH_true_minus_pred / SE_deltaH_true`` (how much the pairing sharpens the
  test), the median ESS/N, the count of unmeasurable draws, the median fraction of U's groups
  without reward variance;

and per checkpoint where first order stops holding: the lowest lr whose rejections are clearly
above 5% (binomial p < 0.05) or whose ratio's interval excludes 1.

Writes ``<out>/calibration_runs.csv`` (one row per run), ``<out>/calibration.csv`` (one row per
(checkpoint, lr)) and ``<out>/calibration.md`` (the table docs/calibration.md shows). Exit status 0
whatever the numbers (a measurement, not a test); a failing run is recorded and the rest go on.

The command behind docs/calibration.md (from the repository root, after building the two checkpoints
with ``benchmarks/smollm2_checkpoint.py`` as the doc shows; runtime on 2 CPU cores shared with other
jobs, torch CPU fp32, ``OMP_NUM_THREADS=1``, ~30 min; with 2 threads on loaded cores a SmolLM2
draw ran 5-6x slower):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration.py --builtin --builtin-draws 40 \\
        --ckpt smollm2_dr_grpo=/tmp/calib/smollm2_dr_grpo --ckpt-grpo smollm2_grpo=/tmp/calib/smollm2_grpo \\
        --lrs 1e-6,1e-5,3e-5 --draws 10 --out /tmp/calib/bench -- importance.resample_on_low_ess=false \\
        task.tokenize=entprobe task.reward=last_number 'task.system_prompt="Answer with just the number."'

Smallest run (the built-in model only, ~30 s; tests/test_calibration_cmd.py):

    .venv/bin/python benchmarks/calibration.py --builtin --draws 2 --builtin-lrs 1e-3,1e-2 --B-E 4 --B-U 4 \\
        --out /tmp/calib_small

Overrides after ``--`` apply to the ``--ckpt`` / ``--ckpt-grpo`` checkpoints (not to the built-in
model, whose task and tokenizer differ); ``--probe KEY=VALUE`` to every checkpoint, the built-in
model's included (the probe's own settings: ``--probe probe.weighting_mode=dr_grpo`` calibrates
another functional on the same draws).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calibration_stats import NAN, breakdown, fmt, summarise  # noqa: E402

HF_LRS = "1e-6,1e-5,3e-5"
BUILTIN_LRS = "1e-5,1e-4,3e-4,1e-3,1e-2"
KEYS = ["deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred",
        "SE_deltaH_true_minus_pred", "ci95_true_minus_pred_low", "ci95_true_minus_pred_high", "ESS_frac",
        "psis_khat", "H_orig", "deltaH1", "deltaH_resample", "SE_deltaH_resample",
        "batch_U/frac_zero_var_groups", "batch_E/frac_zero_var_groups", "batch_U/reward_mean",
        "batch_E/reward_mean", "time/total_s"]
TEXT = ["measurable", "pred_consistent", "unmeasurable_reason", "batch_source", "reused_stage12"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builtin", action="store_true", help="the built-in default model (model=tiny)")
    ap.add_argument("--ckpt", action="append", default=[], metavar="LABEL=DIR",
                    help="an HF Trainer folder probed with the default (DR-GRPO) objective")
    ap.add_argument("--ckpt-grpo", action="append", default=[], metavar="LABEL=DIR",
                    help="an HF Trainer folder trained with the grpo loss: objective=trl objective.loss_type=grpo")
    ap.add_argument("--lrs", default=HF_LRS, help=f"lrs for --ckpt/--ckpt-grpo (default {HF_LRS})")
    ap.add_argument("--builtin-lrs", default=BUILTIN_LRS, help=f"lrs for --builtin (default {BUILTIN_LRS})")
    ap.add_argument("--draws", type=int, default=10, help="E draws per checkpoint (default 10)")
    ap.add_argument("--builtin-draws", type=int, default=None, help="E draws for --builtin (default --draws)")
    ap.add_argument("--builtin-max-new-tokens", type=int, default=8,
                    help="sampling.max_new_tokens for --builtin (default 8: its answers are 1-2 tokens + EOS)")
    ap.add_argument("--seed-E0", type=int, default=101, help="draw d uses batch.seed_E = seed_E0 + d")
    ap.add_argument("--seed-U", type=int, default=2, help="batch.seed_U, fixed per checkpoint")
    ap.add_argument("--B-E", dest="B_E", type=int, default=8)
    ap.add_argument("--B-U", dest="B_U", type=int, default=4)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(HERE / "results" / "calibration"))
    ap.add_argument("--resume", action="store_true",
                    help="take the draws whose every lr already has a results.json under <out>/runs from there")
    ap.add_argument("--probe", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every checkpoint, the built-in model's included (e.g. "
                         "probe.weighting_mode=dr_grpo to calibrate another functional); repeatable")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for the checkpoints, after --")
    return ap.parse_args(argv)


def fnum(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return NAN


def checkpoints(a) -> list[tuple[str, list[str], list[float], int]]:
    """(label, overrides, lrs, draws) per checkpoint."""
    lrs = [float(x) for x in a.lrs.split(",") if x.strip()]
    out = []
    for spec, extra in [(s, []) for s in a.ckpt] + [(s, ["objective=trl", "objective.loss_type=grpo"])
                                                     for s in a.ckpt_grpo]:
        label, _, d = spec.partition("=")
        ck = Path(d).expanduser().resolve()
        out.append((label, ["model=hf", f"model.path={ck}", f"optimizer.state_path={ck}",
                            f"sampling.max_new_tokens={a.max_new_tokens}", *extra, *a.overrides, *a.probe],
                    lrs, a.draws))
    if a.builtin:  # last: the checkpoints' numbers come first
        out.append(("builtin", [f"sampling.max_new_tokens={a.builtin_max_new_tokens}", *a.probe],
                    [float(x) for x in a.builtin_lrs.split(",") if x.strip()],
                    a.draws if a.builtin_draws is None else a.builtin_draws))
    return out


def jobs(a) -> list[tuple[str, list[str], list[float], int]]:
    """(label, overrides, lrs, draw) in the order they run: the built-in model's draws first (seconds),
    then the checkpoints' draws interleaved (draw 0 of each, draw 1 of each, ...), so that a run cut
    short has as many draws of each."""
    cks = checkpoints(a)
    out = [(lb, ov, lrs, d) for lb, ov, lrs, n in cks if lb == "builtin" for d in range(n)]
    hf = [c for c in cks if c[0] != "builtin"]
    for d in range(max([n for *_, n in hf], default=0)):
        out += [(lb, ov, lrs, d) for lb, ov, lrs, n in hf if d < n]
    return out


def row_from(res: dict, row: dict) -> dict:
    for k in KEYS:
        row[k] = fnum(res.get(k, NAN))
    for k in TEXT:
        row[k] = res.get(k, "")
    return row


def run_all(a, out: Path, on_draw=lambda rows: None) -> list[dict]:
    sys.path.insert(0, str(HERE))
    from _common import compose
    from entprobe.cli.probe_job import run

    base = [f"batch.B_E={a.B_E}", f"batch.B_U={a.B_U}", f"batch.G={a.G}", f"batch.seed_U={a.seed_U}",
            "batch.share_across_lr=true",
            "logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false",
            "logging.report=false", "logging.verdict=false"]
    rows = []
    for label, ck_ov, lrs, d in jobs(a):
        seed_E = a.seed_E0 + d
        dirs = [out / "runs" / label / f"draw{d}" / f"lr_{lr:g}" for lr in lrs]
        fresh = lambda lr: {"checkpoint": label, "draw": d, "seed_E": seed_E, "seed_U": a.seed_U, "lr": lr,
                            **{k: NAN for k in KEYS}, **{k: "" for k in TEXT}, "status": "ok", "error": "",
                            "wall_s": NAN, "resumed": False}
        if a.resume and all((p / "results.json").is_file() and not (p / "FAILED").exists() for p in dirs):
            for lr, p in zip(lrs, dirs):  # a finished draw of an earlier invocation with the same --out
                res = json.loads((p / "results.json").read_text())
                row = row_from(res, fresh(lr))
                row["wall_s"], row["resumed"] = fnum(res.get("time/total_s")), True
                rows.append(row)
            print(f"[{label} draw {d}] resumed from {dirs[0].parent}", flush=True)
            on_draw(rows)
            continue
        cache = out / "batch_cache" / label
        shutil.rmtree(cache, ignore_errors=True)  # this draw's lrs share one cache entry
        for lr, rd in zip(lrs, dirs):
            ov = [*ck_ov, *base, f"batch.seed_E={seed_E}", f"optimizer.lr={lr!r}", f"run_dir={rd}"]
            row = fresh(lr)
            t0 = time.perf_counter()
            try:
                row_from(run(compose(ov), batch_cache=cache), row)
            except Exception as exc:  # a measurement: record and go on
                traceback.print_exc()
                row["status"], row["error"] = "error", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            row["wall_s"] = time.perf_counter() - t0
            print(f"[{label} draw {d} lr {lr:g}] {row['status']} {row['wall_s']:.1f}s pred {fmt(row['deltaH_pred'])} "
                  f"true {fmt(row['deltaH_true'])} diff {fmt(row['deltaH_true_minus_pred'])} ± "
                  f"{fmt(row['SE_deltaH_true_minus_pred'], 2)} (SE_true {fmt(row['SE_deltaH_true'], 2)}) "
                  f"ESS/N {fmt(row['ESS_frac'])} measurable {row['measurable']} "
                  f"U zero-var {fmt(row['batch_U/frac_zero_var_groups'])}", flush=True)
            rows.append(row)
        shutil.rmtree(cache, ignore_errors=True)  # SmolLM2's entry is ~1 GB
        on_draw(rows)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})


def write_md(summary: list[dict], path: Path, header: str) -> None:
    lines = [f"# Calibration: {header}", "",
             "holds 0 = fraction of measurable draws whose paired 95% interval of deltaH_true - deltaH_pred holds 0 "
             "(± binomial SE; p = P(this many rejections or more | 5%)); sign = agreement of predicted and measured "
             "among draws where both exceed their SE (resolved) / among all; measured/predicted = ratio of the "
             "means over draws [95% bootstrap over draws]; slope = least-squares slope of measured on predicted "
             "through 0 over draws [95% bootstrap]; "
             "SE ratio = median SE_deltaH_true_minus_pred / SE_deltaH_true; "
             "sd z = spread of (measured - predicted) / its SE over draws (1 if calibrated); unmeasurable = draws the "
             "probe declined to measure, by reason (k-hat > 0.7, ESS/N < 0.3; a draw can have both); "
             "verdict resolves = draws whose prediction exceeds its SE (the verdict is not noise_dominated); "
             "pred 95% excl. 0 = draws whose prediction's 95% t interval excludes 0 (+ / -); sd pred = the "
             "prediction's spread over draws, median SE = its median SE_deltaH_pred.", "",
             "| checkpoint | lr | measurable / draws | holds 0 ± SE | rejections (p) | sign: resolved / all | "
             "verdict resolves | pred 95% excl. 0 (+/-) | sd pred / median SE | "
             "mean predicted | mean measured | measured/predicted [95%] | slope [95%] | SE ratio | sd z | "
             "median ESS/N | "
             "unmeasurable (k-hat, ESS) | U zero-var groups |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['checkpoint']} | {s['lr']:g} | {s['measurable']} / {s['runs']} | "
            f"{fmt(s['holds0'], 2)} ± {fmt(s['SE_holds0'], 2)} | "
            f"{s['rejections']} ({fmt(s['p_excess_rejections'], 2)}) | "
            f"{s['sign_resolved_agree']}/{s['sign_resolved_n']} / {s['sign_all_agree']}/{s['measurable']} | "
            f"{s['pred_resolved']}/{s['runs'] - s['errors']} | {s['pred_excl0_pos']}/{s['pred_excl0_neg']} | "
            f"{fmt(s['sd_pred'], 2)} / {fmt(s['median_se_pred'], 2)} | "
            f"{fmt(s['mean_pred'])} | {fmt(s['mean_true'])} | {fmt(s['ratio'], 4)} [{fmt(s['ratio_lo'], 4)}, "
            f"{fmt(s['ratio_hi'], 4)}] | {fmt(s['slope'], 4)} [{fmt(s['slope_lo'], 4)}, {fmt(s['slope_hi'], 4)}] | "
            f"{fmt(s['median_se_ratio'], 2)} | {fmt(s['sd_z'], 2)} | "
            f"{fmt(s['median_ESS_frac'])} | "
            f"{s['unmeasurable']} ({s['unmeasurable_khat']}, {s['unmeasurable_ess']}) | "
            f"{fmt(s['median_U_zero_var'], 2)} |")
    lines += ["", "Where first order stops holding (lowest lr with rejections clearly above 5%, binomial p < 0.05, "
              "or the interval of measured/predicted or of the slope excluding 1):", ""]
    lines += [f"- {ck}: {why}" for ck, why in breakdown(summary).items()]
    path.write_text("\n".join(lines) + "\n")


def write_outputs(rows: list[dict], out: Path, header: str, B_E: int = 8) -> None:
    if not rows:
        return
    try:
        summary = summarise(rows, B_E)
        write_csv(rows, out / "calibration_runs.csv")
        write_csv(summary, out / "calibration.csv")
        write_md(summary, out / "calibration.md", header)
    except Exception:
        traceback.print_exc()


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    bd = a.draws if a.builtin_draws is None else a.builtin_draws
    header = (f"B_E={a.B_E} B_U={a.B_U} G={a.G}, max_new_tokens {a.max_new_tokens} (builtin "
              f"{a.builtin_max_new_tokens}), {a.draws} E draws per checkpoint (builtin {bd}; seed_E from "
              f"{a.seed_E0}), seed_U={a.seed_U} fixed per checkpoint")
    t0 = time.perf_counter()
    try:  # the outputs are rewritten after every draw: a run cut short leaves its table so far
        rows = run_all(a, out, on_draw=lambda rows: write_outputs(rows, out, header, a.B_E))
    except Exception:  # set-up failed (imports, config): report, still exit 0
        traceback.print_exc()
        return 0
    if not rows:
        print("nothing to run: give --builtin, --ckpt or --ckpt-grpo")
        return 0
    write_outputs(rows, out, header, a.B_E)
    print(f"[calibration] {len(rows)} runs in {time.perf_counter() - t0:.1f}s "
          f"(runs' own time {sum(r['wall_s'] for r in rows if math.isfinite(r['wall_s'])):.0f}s) -> "
          f"{out}/calibration{{.md,.csv,_runs.csv}}")
    print((out / "calibration.md").read_text() if (out / "calibration.md").is_file() else "")
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
