"""docs/calibration.md's smallest command (the built-in model, 2 E draws, 2 lrs, B 4) runs, exits 0 and
writes the per-run CSV, the per-(checkpoint, lr) CSV and the markdown table with their columns."""
from __future__ import annotations

import csv
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from conftest import fp_tol

ROOT = Path(__file__).resolve().parents[1]
CMD = (".venv/bin/python benchmarks/calibration.py --builtin --draws 2 --builtin-lrs 1e-3,1e-2 "
       "--B-E 4 --B-U 4 --out /tmp/calib_small")


def test_calibration_small_command_writes_csv_and_table(tmp_path):
    args = shlex.split(CMD)
    args[0] = sys.executable
    args[args.index("--out") + 1] = str(tmp_path / "calib")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "calib"
    with open(out / "calibration_runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 4 and {r["checkpoint"] for r in runs} == {"builtin"}
    assert {"draw", "seed_E", "seed_U", "lr", "deltaH_pred", "deltaH_true", "SE_deltaH_true_minus_pred",
            "ci95_true_minus_pred_low", "ESS_frac", "measurable", "status"} <= set(runs[0])
    assert all(r["status"] == "ok" for r in runs), [r["error"] for r in runs]
    assert sorted({r["seed_E"] for r in runs}) == ["101", "102"] and {r["seed_U"] for r in runs} == {"2"}
    # the same E and U across the lrs of a draw: Stages 1-2 shared (tests/test_stage12_share.py checks
    # the rescaled numbers), so deltaH1 = -lr Xbar . P Ybar is the same dot times each lr: their
    # ratio is 10 to three fp64 roundings (the CSV holds repr(float), every digit)
    for d in ("0", "1"):
        a, b = sorted((r for r in runs if r["draw"] == d), key=lambda r: float(r["lr"]))
        ratio = float(b["deltaH1"]) / float(a["deltaH1"])
        assert abs(ratio - 10.0) <= fp_tol(torch.float64, 10.0, 3, worst_case=True), ratio
        assert a["reused_stage12"] == "False" and b["reused_stage12"] == "True"
    with open(out / "calibration.csv") as f:
        summary = list(csv.DictReader(f))
    assert [float(s["lr"]) for s in summary] == [1e-3, 1e-2]
    for s in summary:
        assert int(s["measurable"]) + int(s["unmeasurable"]) + int(s["errors"]) == int(s["runs"]) == 2
        h = float(s["holds0"])
        assert math.isnan(h) if int(s["measurable"]) == 0 else 0.0 <= h <= 1.0
        assert 0.0 <= float(s["median_ESS_frac"]) <= 1.0
        ok = [r for r in runs if float(r["lr"]) == float(s["lr"]) and r["status"] == "ok"]
        # the verdict's resolution: draws whose prediction exceeds its SE (not noise_dominated)
        assert int(s["pred_resolved"]) == sum(abs(float(r["deltaH_pred"])) > float(r["SE_deltaH_pred"]) for r in ok)
    md = (out / "calibration.md").read_text()
    assert "| checkpoint | lr | measurable / draws | holds 0 ± SE |" in md
    assert md.count("\n| builtin |") == 2 and "Where first order stops holding" in md
