"""The forecast's calibration tables come from recorded training runs replayed through the filter
(benchmarks/forecast_calibration.py ``--record`` / ``--replay``): a replay gives back, number for
number, the forecasts the live run logged, and docs/forecast.md's tables are the committed
recordings (tests/data/forecast_runs/) replayed through the filter as it is now, so a change of the
filter that moves them fails here until the page is regenerated with its command."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "forecast_runs"
sys.path.insert(0, str(ROOT / "benchmarks"))

import forecast_calibration as fcb  # noqa: E402
from entprobe.integrations import online_filter as of  # noqa: E402

EPS64 = sys.float_info.epsilon


def replay_tolerance(rec: dict, value: float) -> float:
    """What another machine's fp64 kernels can move a replayed forecast by: each filter call sums at
    most ``len(probes kept) + STORED + M`` terms (the pool's 64 probes, the 32 stored steps, a batch's
    M <= 16 prompt rows), each rounding by eps64 of the value's size, and the calls' errors add along
    the run (the filter's recursion does not amplify them: its Kalman gains are below 1)."""
    per_call = 64 + of.STORED + 16
    return EPS64 * per_call * len(rec["calls"]) * max(1.0, abs(value))


@pytest.mark.parametrize("sub", ["builtin"])
def test_replay_gives_back_the_forecasts_the_run_logged(sub):
    """Every logged ``entprobe/forecast_*`` value of the recorded runs, replayed from the filter's
    recorded inputs alone, within ``replay_tolerance``; the recordings hold forecasts of every
    horizon (the test compares something)."""
    recs = [r for group in fcb.replay_groups(RUNS / sub).values() for r in group if "logged" in r]
    assert recs
    compared = 0
    for rec in recs:
        hist = {h["step"]: h for h in fcb.replay(rec)}
        for step, logged in rec["logged"].items():
            got = hist[int(step)]
            for key, v in logged.items():
                assert math.isclose(got[key], v, rel_tol=0.0, abs_tol=replay_tolerance(rec, v)), (rec["lr"], step, key)
                compared += 1
    assert compared > 100 and any("k10" in k for r in recs for v in r["logged"].values() for k in v)


def _doc_rows(heading: str) -> list[str]:
    """The table rows of docs/forecast.md's table under the line that starts with ``heading``."""
    text = (ROOT / "docs" / "forecast.md").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith(heading))
    rows = []
    for line in text[start:]:
        if line.startswith("| ") and not line.startswith("| lr") and not line.startswith("|---"):
            rows.append(line)
        elif rows and not line.startswith("|"):
            break
    return rows


@pytest.mark.parametrize("sub,heading", [("builtin", "| lr (logged entropy, step 1 -> 60)"),
                                         ("smollm2-B4", "| lr (logged entropy, step 1 -> 40)"),
                                         ("smollm2-B16", "| lr, 16 prompts a step (logged entropy, step 1 -> 40)")])
def test_docs_tables_are_the_recorded_runs_replayed(sub, heading):
    """docs/forecast.md's rows, verbatim, from its command ``python benchmarks/forecast_calibration.py
    --replay tests/data/forecast_runs/<sub> --markdown`` (run as the page shows it)."""
    import os
    import subprocess

    cmd = f"python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/{sub} --markdown"
    assert cmd in (ROOT / "docs" / "forecast.md").read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _doc_rows(heading) == proc.stdout.strip().splitlines()
    assert _doc_rows(heading) == fcb.markdown_rows(fcb.replay_groups(RUNS / sub))


def test_docs_rescaling_rows_are_the_recorded_runs_replayed():
    """docs/forecast.md's rescaling table, verbatim: the three ``--replay ... --best-scale`` commands,
    run as the page shows them, in order."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    printed = []
    for sub in ("builtin", "smollm2-B4", "smollm2-B16"):
        cmd = f"python benchmarks/forecast_calibration.py --replay tests/data/forecast_runs/{sub} --best-scale"
        assert cmd in (ROOT / "docs" / "forecast.md").read_text()
        proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed += proc.stdout.strip().splitlines()
    assert _doc_rows("| lr, recorded runs | k | forecasts | c for 90%") == printed


def test_best_scale_is_the_narrowest_factor_that_covers():
    """Four forecasts at 0 with intervals [-1, 1] and realised values 0.2, -0.5, 0.9, 3: the factors
    needed are 0.2, 0.5, 0.9, 3, so 75% coverage takes c = 0.9 and 50% c = 0.5 (the width then 2c,
    the lower end clipped at 0 only where it falls below: the forecasts here sit at 1 with [0, 2]);
    an interval's sides scale apart (the upper side 2 for a realised value above)."""
    ps = [(1.0, 0.0, 2.0, r) for r in (1.2, 0.5, 1.9, 4.0)]
    assert fcb.scale_needed(ps) == pytest.approx([0.2, 0.5, 0.9, 3.0])
    c, ratio = fcb.best_scale(ps, 0.75)
    err = sorted(abs(1.0 - r) for r in (1.2, 0.5, 1.9, 4.0))
    assert c == pytest.approx(0.9) and ratio == pytest.approx(2 * 0.9 / ((err[1] + err[2]) / 2))
    assert fcb.best_scale(ps, 0.5)[0] == pytest.approx(0.5)
    lopsided = [(1.0, 0.5, 3.0, 2.0), (1.0, 0.5, 3.0, 0.0)]  # upper side 2, lower side 0.5
    assert fcb.scale_needed(lopsided) == pytest.approx([0.5, 2.0])
