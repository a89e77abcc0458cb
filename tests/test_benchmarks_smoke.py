"""The benchmark scripts still run (benchmarks/README.md): each one's cheapest built-in form, verbatim
as a subprocess, exits 0 and prints its headline line. Their figures are measurements, not checked
here; this keeps a script from breaking silently when the code it drives changes (bench_variance.py
once called ``build_geometry`` with a signature two sessions old)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, lines", [
    (["benchmarks/bench_variance.py", "--reps", "1"], ["auto picks"]),
    # --trl: a TRL GRPOTrainer process of its own, whose peak the job's is set against
    (["benchmarks/bench_probe.py", "--reps", "1", "--trl"],
     ["floor ", "the job's peak (sampling E and U, then the probe)", "drew the probe's batches again: yes",
      "the job's peak / TRL's"]),
    (["benchmarks/online_probe.py", "--steps", "4", "--every", "2"], ["closed-form update vs the real step"]),
    # --calls: where the CPU time goes, the probe's passes against the trainer's
    (["benchmarks/online_probe.py", "--steps", "4", "--every", "2", "--source", "rollouts", "--calls"],
     ["CPU time by call", "probe: backward", "probe: forward", "trainer: backward", "trainer: generation + scoring"]),
    (["benchmarks/bench_rao_blackwell.py", "--B", "4", "--G", "4", "--reps", "1"], ["ESS/N after the step"]),
    (["benchmarks/zero_update_probe.py", "--reps", "1"], ["update exactly 0", "of the normal probe, passes {}"]),
], ids=["bench_variance", "bench_probe", "online_probe", "online_probe_rollouts_calls", "bench_rao_blackwell",
        "zero_update_probe"])
def test_benchmark_runs_on_the_builtin_model(args, lines):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in lines:
        assert line in proc.stdout, (line, proc.stdout[-2000:])


def test_the_benchmark_tasks_score_the_number_they_say(tmp_path):
    """``trainer_parts(scoring=...)`` (``entropy_guard.py --scoring``): ``first`` / ``last`` reward a
    completion whose first / last number is the sum, ``any`` one that states it anywhere; another
    value is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grpo_setup import trainer_parts

    completions, answers = ["7 is 3 + 4", "3 + 4 = 7", "3, then 7, then 9", "no number", "17"], ["7"] * 5
    for scoring, want in (("first", [1, 0, 0, 0, 0]), ("last", [0, 1, 0, 0, 0]), ("any", [1, 1, 1, 0, 0])):
        fn = trainer_parts(str(tmp_path), 1, scoring=scoring)["reward_fn"]
        assert fn(None, completions, answers) == want, scoring
    chat = [[{"role": "assistant", "content": c}] for c in completions]  # a chat model's completions
    assert trainer_parts(str(tmp_path), 1, question=True)["reward_fn"](None, chat, answers) == [0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="scoring='middle'"):
        trainer_parts(str(tmp_path), 1, scoring="middle")
