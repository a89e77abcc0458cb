"""Calibration of the k-step entropy forecast (docs/forecast.md) on training runs of the built-in
model: ``python -m entprobe.train``'s trainer (DR-GRPO, 16 prompts x G = 4, 4 new tokens) with the
online probe on the step's own batch (``--probe-source rollouts``, token_mean, nothing measured),
for each lr and seed. Each probe forecasts the logged entropy k = 1, 5, 10 steps later with a 95%
interval; the run logs the realised entropy at every step (TRL's ``entropy``: the mean full-vocabulary
token entropy of the step's batch). Prints, per lr and k, how many forecasts had a realised value,
the fraction whose interval holds it, the median interval width and the median |forecast - realised|,
and the same over all runs; exits 0 whatever they are.

    OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py                       # ~4 min on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/forecast_calibration.py --lrs 1e-3 --seeds 0  # one run
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

HORIZONS = (1, 5, 10)


def run(out: str, lr: float, seed: int, steps: int, every: int) -> list[dict]:
    from entprobe.integrations.grpo_trainer import TrainArgs, train

    hist: list[dict] = []
    train(TrainArgs(out=out, steps=steps, lr=lr, seed=seed, save_every=steps, probe_every=every,
                    probe_source="rollouts", probe_B_E=0), log=lambda line: None, on_step=hist.append)
    return hist


def pairs(hist: list[dict], k: int) -> list[tuple[float, float, float, float]]:
    """(forecast, low, high, realised) of every probe whose step + k was logged."""
    logged = {h["step"]: h["entropy"] for h in hist}
    key = f"entprobe/forecast_H_k{k}"
    return [(h[key], h[key + "_low"], h[key + "_high"], logged[h["step"] + k])
            for h in hist if key in h and h["step"] + k in logged]


def summary(ps: list[tuple[float, float, float, float]]) -> str:
    if not ps:
        return "no forecast with a realised value"
    cover = sum(lo <= r <= hi for _, lo, hi, r in ps) / len(ps)
    width = statistics.median(hi - lo for _, lo, hi, _ in ps)
    err = statistics.median(abs(f - r) for f, _, _, r in ps)
    return f"n {len(ps):4d}  coverage {cover:6.1%}  median width {width:.3f}  median |forecast - realised| {err:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="comma-separated lrs")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=2, help="probe every N steps")
    a = ap.parse_args()
    lrs = [float(x) for x in a.lrs.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    every_run: dict[int, list] = {k: [] for k in HORIZONS}
    print(f"built-in model, {a.steps} steps, the probe every {a.every} (source rollouts, token_mean), "
          f"seeds {seeds}; per lr and horizon k: forecasts with a realised logged entropy k steps later")
    with tempfile.TemporaryDirectory() as tmp:
        for lr in lrs:
            per_lr: dict[int, list] = {k: [] for k in HORIZONS}
            H0 = H1 = None
            for seed in seeds:
                hist = run(str(Path(tmp) / f"lr{lr}-s{seed}"), lr, seed, a.steps, a.every)
                H0, H1 = (H0 or []) + [hist[0]["entropy"]], (H1 or []) + [hist[-1]["entropy"]]
                for k in HORIZONS:
                    per_lr[k] += pairs(hist, k)
            print(f"lr {lr:g} (logged entropy from {statistics.mean(H0):.3f} at step 1 to {statistics.mean(H1):.3f} "
                  f"at step {a.steps}, mean over seeds):")
            for k in HORIZONS:
                print(f"  k {k:2d}: {summary(per_lr[k])}")
                every_run[k] += per_lr[k]
    print("all runs:")
    for k in HORIZONS:
        print(f"  k {k:2d}: {summary(every_run[k])}")


if __name__ == "__main__":
    main()
