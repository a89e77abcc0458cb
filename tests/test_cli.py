"""The README's main command, ``python -m entprobe.main``, as a user runs it (shrunk batches)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys


def test_main_command_writes_results_wandb_and_table(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "entprobe.main", "batch.B_E=4", "batch.B_U=4", "batch.G=4",
         "logging.wandb.mode=offline", "logging.progress=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((run_dir / "results.json").read_text())
    assert math.isfinite(res["deltaH1"]) and res["SE_deltaH1"] > 0
    assert (res["B_E"], res["B_U"], res["G"]) == (4, 4, 4)

    # wandb offline keeps its files under the run directory, with the results logged to the run.
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert not (tmp_path / "wandb").exists()

    # The console table: headline first, every value with 10 significant digits.
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in proc.stdout.splitlines() if line.count("│") == 3}
    assert float(rows["deltaH1"]) == float(f"{res['deltaH1']:.10g}")
    assert float(rows["SE_deltaH1"]) == float(f"{res['SE_deltaH1']:.10g}")
    assert proc.stdout.index("deltaH1") < proc.stdout.index("attr/")
