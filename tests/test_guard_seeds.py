"""benchmarks/guard_seeds.py (the table of ``entropy_guard.py --seeds``) on hand-made figures, and the
documented multi-seed command, shortened: each seed's runs reported under its own header, the table
over seeds, and the same report again from the runs it wrote (``--from-json``)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import run_documented_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import guard_seeds  # noqa: E402


def fig(below: int, track: float, reward: float) -> dict:
    return {"below_floor": below, "track": track, "reward_all": reward}


FIGS = {0: {"recommended": fig(0, 0.4, 0.05), "trl_adaptive": fig(3, 1.0, 0.01), "lower_lr": fig(0, 0.2, 0.3)},
        1: {"recommended": fig(2, 0.6, 0.02), "trl_adaptive": fig(1, 1.0, 0.04), "lower_lr": fig(0, 0.1, 0.4)}}


def test_totals_sum_the_steps_below_and_average_the_rest():
    t = guard_seeds.totals(FIGS, "recommended")
    assert t["below_floor"] == 2 and t["seeds"] == 2
    assert t["track"] == pytest.approx(0.5) and t["reward_all"] == pytest.approx(0.035)


def test_standard_errors_are_the_seeds_spread_over_their_root():
    se = guard_seeds.standard_errors(FIGS, "recommended")  # tracks 0.4, 0.6: stdev 0.1414, over sqrt(2)
    assert se["track"] == pytest.approx(0.1) and se["reward_all"] == pytest.approx(0.015)
    assert "recommended 0.100 / 0.015" in guard_seeds.markdown(FIGS)[6]
    one = guard_seeds.standard_errors({0: FIGS[0]}, "recommended")
    assert one["track"] != one["track"]  # one seed: no spread to read (nan)
    short = {s: {"recommended": {**f["recommended"], "track": float("nan")}} for s, f in FIGS.items()}
    assert math.isnan(guard_seeds.standard_errors(short, "recommended")["track"])  # no step 21: nan, as the mean
    assert guard_seeds.standard_errors(short, "recommended")["reward_all"] == pytest.approx(0.015)


def test_comparisons_count_the_seeds_that_meet_each_goal():
    peer, lower = guard_seeds.comparisons(FIGS)
    # seed 0: 0 <= 3 below, 0.4 <= 0.5, 0.05 >= 0.01; seed 1: 2 > 1 below, 0.6 > 0.5, 0.02 < 0.04
    assert "no more steps below the floor on 1 of 2 seeds (2 against 4 in all)" in peer
    assert "at most half the peer's on 1 of 2 (0.500 against 1.000 over the seeds, a ratio of 0.50)" in peer
    assert "a reward no lower on 1 of 2 (0.035 against 0.025)" in peer
    assert "a reward no lower on 0 of 2 seeds (0.035 against 0.350)" in lower


def test_markdown_has_a_row_per_seed_and_the_totals():
    lines = guard_seeds.markdown(FIGS)
    assert lines[0] == "| seed | recommended | trl_adaptive | lower_lr |"
    assert lines[2] == "| 0 | 0 / 0.400 / 0.050 | 3 / 1.000 / 0.010 | 0 / 0.200 / 0.300 |"
    assert lines[4] == "| all | 2 / 0.500 / 0.035 | 4 / 1.000 / 0.025 | 0 / 0.150 / 0.350 |"
    missing = guard_seeds.markdown({0: {"recommended": fig(0, 0.4, 0.05)}, 1: {"trl_adaptive": fig(1, 1.0, 0.0)}})
    assert missing[2].endswith("| - |") and not any("against" in line for line in missing)  # no seed has both


def test_the_documented_seeds_command_runs_and_reads_back(tmp_path):
    cmd = ("OMP_NUM_THREADS=1 python benchmarks/entropy_guard.py --runs unguarded,recommended,trl_adaptive,lower_lr "
           "--ceiling 0.5 --seeds 0,1,2,3,4 --json /tmp/guard_builtin_seeds.json")
    short = " --steps 3 --seeds 0,1 --runs recommended,trl_adaptive --json runs.json"
    proc = run_documented_benchmark(tmp_path, "guard.md", cmd, short)
    out = proc.stdout
    assert "seed 0:" in out and "seed 1:" in out and "over 2 seeds (0, 1):" in out
    assert "| seed | recommended | trl_adaptive |" in out and "recommended against trl_adaptive" in out
    again = run_documented_benchmark(tmp_path, "guard.md", cmd, short.replace("--json", "--from-json"))

    def report(text: str) -> list[str]:
        lines = text.splitlines()
        return lines[lines.index("seed 0:"):lines.index("runs: runs.json") if "runs: runs.json" in lines else None]
    assert report(again.stdout) == report(out) and len(report(out)) > 10
