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
         "logging.wandb.mode=offline", "logging.progress=false", "logging.console_table=true",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((run_dir / "results.json").read_text())
    assert math.isfinite(res["deltaH1"]) and res["SE_deltaH1"] > 0
    assert (res["B_E"], res["B_U"], res["G"]) == (4, 4, 4)

    # wandb offline keeps its files under the run directory, with the results logged to the run.
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert not (tmp_path / "wandb").exists()

    # The verdict first: predicted and measured change of the step, their difference, each +- SE.
    out = proc.stdout
    head = out[:out.index("phases:")]
    for what, key in (("predicted", "deltaH_pred"), ("measured", "deltaH_true"),
                      ("difference", "deltaH_true_minus_pred")):
        line = next(x for x in head.splitlines() if what in x)
        assert f"{res[key]:+.4g} ± {res['SE_' + key]:.2g}" in line, (line, res[key])
    assert ("NOT consistent" in head) == (not res["pred_consistent"]) and "entropy change of the next step" in head
    assert res["flags"] == "" or all(f"! {c}" in out for c in res["flags"].split(","))

    # The full table (logging.console_table=true): headline first, every value with 10 significant digits.
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in proc.stdout.splitlines() if line.count("│") == 3}
    assert float(rows["deltaH1"]) == float(f"{res['deltaH1']:.10g}")
    assert float(rows["SE_deltaH1"]) == float(f"{res['SE_deltaH1']:.10g}")
    assert proc.stdout.index("deltaH1") < proc.stdout.index("attr/")


def test_verdict_flags_say_what_to_change():
    """Each flag fires on its case and only there (hand-made results)."""
    from entprobe.verdict import flags, verdict_lines

    base = {"deltaH_pred": -0.05, "SE_deltaH_pred": 0.01, "H_orig": 2.0, "ESS_frac": 0.9,
            "batch_U/frac_zero_var_groups": 0.25, "deltaH_true": -0.04, "SE_deltaH_true": 0.01,
            "deltaH_true_minus_pred": 0.01, "SE_deltaH_true_minus_pred": 0.01, "pred_consistent": True,
            "deltaH1": -0.3}
    assert flags(base) == []
    cases = {"noise_dominated": {"SE_deltaH_pred": 0.08}, "larger_than_entropy": {"deltaH_pred": -2.5},
             "empty_gradient": {"batch_U/frac_zero_var_groups": 1.0}, "low_ess": {"ESS_frac": 0.1},
             "inconsistent": {"pred_consistent": False}, "non_finite": {"deltaH_true": float("nan")}}
    for code, change in cases.items():
        got = [c for c, _ in flags({**base, **change})]
        assert got == [code], (code, got)
    assert [c for c, _ in flags(base, truncated_sampling=True)] == ["truncated_sampling"]
    rows = {w: v for w, v, _, _ in verdict_lines(base)}
    assert rows["predicted"].startswith("-0.05 ± 0.01") and rows["difference"] == "+0.01 ± 0.01"


def test_deltaH1_from_coordinates_without_history_is_flagged():
    """An early checkpoint: coordinates Adam never updated have P = 1/eps; the part of deltaH1 they
    carry is reported (paramvec.dot_where by hand) and flagged when it is most of deltaH1."""
    import torch

    from entprobe import paramvec as pv
    from entprobe.verdict import flags

    a = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0]])]
    b = [torch.tensor([1.0, 1.0, -1.0]), torch.tensor([[0.5]])]
    P = [torch.tensor([1e8, 2.0, 1e8]), torch.tensor([[1e8]])]
    assert pv.dot_where(a, b, P, 0.5e8) == 1.0 * 1.0 + 3.0 * -1.0 + 4.0 * 0.5  # = 0
    assert pv.dot_where(a, b, P, 1.0) == 1.0 + 2.0 - 3.0 + 2.0
    base = {"deltaH1": 10.0, "deltaH1_no_history": 9.0}
    assert [c for c, _ in flags(base)] == ["deltaH1_no_history"]
    assert flags({"deltaH1": 10.0, "deltaH1_no_history": 1.0}) == []
