"""``benchmarks/device_check.sh --toy``: every step of the GPU check (the online probe in TRL, the offline
probe, long responses, a random Qwen-shaped model, bf16 against fp32) runs end to end on CPU at toy
sizes and leaves one JSON and one table."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_runs_every_step_at_toy_sizes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", "--toy", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    steps = {s["name"]: s for s in res["steps"]}
    assert set(steps) == {"online", "offline", "long", "half_billion", "bf16"}
    assert all(s["status"] == "ok" and s["figures"] for s in steps.values())
    assert steps["online"]["figures"]["subset"] and steps["online"]["figures"]["probe_steps"] > 0
    table = (tmp_path / "table.md").read_text()
    assert table.count("| ok |") == 5


def test_device_check_names_its_steps_when_asked_for_one_it_lacks(tmp_path):
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", "--toy", "--only", "online,gpu", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "online, offline, long, half_billion, bf16" in proc.stderr
