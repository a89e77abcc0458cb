"""``python -m entprobe.probe_run RUN_DIR``: every checkpoint of a training run probed by the probe
job, its rows in over_steps.csv / .png / report.md; the online probe's history plotted the same way
at the end of training (``python -m entprobe.train``, ``EntropyProbeCallback``)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from entprobe.cli.probe_run import find_checkpoints, main, select
from entprobe.cli.train import main as train_main
from entprobe.config import ConfigError
from entprobe.reporting import over_steps as OS

# 3 steps, a checkpoint each; linear schedule: checkpoint-3's next lr is 0 (skipped)
TRAIN = ["--steps", "3", "--save-every", "1", "--B", "2", "--G", "2", "--max-new-tokens", "2",
         "--lr-scheduler", "linear", "--probe-every", "1", "--probe-B-E", "2"]
PROBE = ["batch.B_E=2", "batch.B_U=2", "batch.G=2", "sampling.max_new_tokens=2", "logging.logger=none",
         "logging.progress=false", "logging.verdict=false", "model.device=cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "run"
    train_main(["--out", str(out), *TRAIN])
    return out


@pytest.fixture(scope="module")
def probed(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("probed") / "out"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([str(run_dir), "--out", str(out), *PROBE])
    return rc, out, buf.getvalue()


def png_ok(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def test_every_checkpoint_probed_into_its_folder_and_the_table_is_their_results(probed, run_dir):
    rc, out, printed = probed
    assert rc == 0
    rows = OS.read_csv(out / OS.CSV_FILE)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (3, "skipped")]
    assert "the schedule has ended: the next step's lr is 0" in rows[2]["reason"]
    for r in rows[:2]:
        res = json.loads((out / r["job_dir"] / "results.json").read_text())
        assert r["job_dir"] == f"step-{r['step']}" and (out / r["job_dir"] / "report.md").is_file()
        for col, key in OS.FROM_RESULTS.items():  # (the online probe's forecasts and guard: empty here)
            assert r[col] == pytest.approx(res.get(key, math.nan), rel=1e-12, nan_ok=True), col
        assert all(math.isnan(r[c]) for c in OS.FORECAST_COLUMNS)
        assert r["SE_H"] > 0 and r["ci95_H_low"] < r["H"] < r["ci95_H_high"] and r["time_s"] > 0
        assert res["lr"] == pytest.approx(1e-3 * (3 - r["step"]) / 3)  # the checkpoint's own next lr
    assert all(math.isnan(rows[2][k]) for k in ("H", "deltaH_pred", "deltaH_true"))
    w, h = png_ok(out / OS.PLOT_FILE)
    assert w > 500 and h > 400
    report = (out / "report.md").read_text()
    assert "(step-1/report.md)" in report and "(step-2/report.md)" in report and f"]({OS.PLOT_FILE})" in report
    assert "skipped: the schedule has ended" in report
    last = printed.strip().splitlines()[-3:]  # the report, the CSV and the plot, as the probe job ends
    assert [line.split()[1] for line in last] == ["report", "results", "plots"]
    assert last[1].endswith(OS.CSV_FILE) and last[2].endswith(OS.PLOT_FILE)


def test_a_damaged_checkpoint_is_recorded_failed_and_the_others_run(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(run_dir / f"checkpoint-{step}", run / f"checkpoint-{step}")
    (run / "checkpoint-1" / "optimizer.pt").write_bytes(b"not a torch file")
    rc = main([str(run), "--out", str(tmp_path / "out"), *PROBE])
    assert rc == 0
    rows = OS.read_csv(tmp_path / "out" / OS.CSV_FILE)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "failed"), (2, "ok")]
    assert "optimizer.pt" in rows[0]["reason"] and "\n" not in rows[0]["reason"]
    assert "Traceback" not in capsys.readouterr().err
    (run / "checkpoint-2" / "optimizer.pt").write_bytes(b"")  # none probed: exit 1
    assert main([str(run), "--out", str(tmp_path / "out2"), *PROBE]) == 1
    assert [r["status"] for r in OS.read_csv(tmp_path / "out2" / OS.CSV_FILE)] == ["failed", "failed"]


def test_a_folder_without_checkpoints_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "empty"), *PROBE])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("entprobe: error: RUN_DIR=")
    assert str(tmp_path / "empty") in err and "checkpoint-<N>" in err and "global_step_<N>" in err


def test_a_bad_override_is_a_one_line_error_before_any_checkpoint(run_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(run_dir), "--out", str(tmp_path / "out"), "batch.nope=1"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("entprobe: error: batch.nope=1: batch has no key nope; python -m entprobe.main --help lists "
                   "every key")
    assert not (tmp_path / "out").exists()


FAKE_RESULTS = {"H_orig": 1.0, "SE_H_orig": 0.1, "B_E": 2, "deltaH_pred": -0.01, "deltaH_true": -0.02}


@pytest.fixture
def probed_jobs(monkeypatch):
    """``probe_run``'s probe job replaced by one that records the typed config it is given (no model)."""
    import entprobe.cli.probe_run as PR

    jobs = []
    monkeypatch.setattr(PR, "run", lambda typed, **kw: jobs.append(typed) or dict(FAKE_RESULTS))
    return jobs


def empty_run(root: Path, steps=(1, 2)) -> Path:
    for step in steps:
        (root / f"checkpoint-{step}").mkdir(parents=True)
    return root


@pytest.mark.parametrize("override,says", [
    ("batch.G=1", "batch.G: is 1; need >= 2 responses per prompt"),
    ("batch.B_E=1", "batch.B_E: is 1; need >= 2 prompts"),
    ("optimizer.lr=-1", "optimizer.lr: must be > 0"),
    ("importance.is_mode=bogus", "importance.is_mode=bogus: importance.is_mode takes one of cv, snis, clip, psis, "
                                 "not 'bogus'")])
def test_a_bad_value_is_refused_once_before_any_checkpoint(override, says, tmp_path, probed_jobs, capsys):
    """A value the probe job's config checks refuse (``to_typed``) stops the run before the first
    checkpoint, with the job's own message: exit 2, one line, nothing written."""
    run = empty_run(tmp_path / "run")
    with pytest.raises(SystemExit) as info:
        main([str(run), "--out", str(tmp_path / "out"), override, "logging.logger=none"])
    assert info.value.code == 2 and probed_jobs == []
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("entprobe: error: ") and says in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_value_a_checkpoint_settles_is_left_to_each_checkpoint(tmp_path, probed_jobs, capsys):
    """``objective.loss_type`` alone is refused (a key of objective=trl), but a TRL checkpoint's
    training_args.bin sets objective=trl: not refused up front. A first checkpoint whose
    training_args.bin is damaged fails alone; the next is probed. Without a task the TRL run is
    refused up front (its task is not in the file), once, before any checkpoint."""
    import torch
    import trl

    run = empty_run(tmp_path / "run")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[])
    for step in (1, 2):
        torch.save(args, run / f"checkpoint-{step}" / "training_args.bin")
    given = ["objective.loss_type=dapo", "logging.logger=none", "logging.progress=false"]
    capsys.readouterr()  # transformers' warnings while the GRPOConfig was built
    with pytest.raises(SystemExit) as info:
        main([str(run), "--out", str(tmp_path / "out0"), *given])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and probed_jobs == [] and not (tmp_path / "out0").exists()
    assert err.count("\n") == 0 and err.startswith("entprobe: error: task: not given") and "task=arithmetic" in err
    given.append("task=arithmetic")
    assert main([str(run), "--out", str(tmp_path / "out"), *given]) == 0
    assert [(j.objective.preset.value, j.objective.loss_type) for j in probed_jobs] == [("trl", "dapo")] * 2
    (run / "checkpoint-1" / "training_args.bin").write_bytes(b"not a torch file")
    assert main([str(run), "--out", str(tmp_path / "out2"), *given]) == 0
    rows = OS.read_csv(tmp_path / "out2" / OS.CSV_FILE)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "failed"), (2, "ok")]
    assert "training_args.bin" in rows[0]["reason"] and len(probed_jobs) == 3


def test_the_wandb_runs_of_one_probe_run_share_a_group_and_are_named_by_step(tmp_path, probed_jobs, monkeypatch,
                                                                             capsys):
    """``logging.logger=wandb``: a run per checkpoint, ``step-<N>``, all in one group (RUN_DIR's name
    and a random suffix: a second probe_run is another group); ``logging.wandb.group`` / ``.name``
    given: that group, ``<name>-step-<N>``. wandb itself faked: nothing leaves the process."""
    import sys
    from types import SimpleNamespace

    inits = []

    def init(**kw):
        inits.append(kw)
        return SimpleNamespace(summary={}, log=lambda media: None, finish=lambda exit_code: None)
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init, Table=lambda **kw: None, Image=str))
    for var in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "WANDB_DISABLE_GIT"):  # offline_env sets them
        monkeypatch.delenv(var, raising=False)
    run = empty_run(tmp_path / "grpo")
    given = ["logging.logger=wandb", "logging.wandb.mode=offline", "logging.progress=false"]
    for out in ("a", "b"):
        assert main([str(run), "--out", str(tmp_path / out), *given]) == 0
    groups = [kw["group"] for kw in inits]
    assert [kw["name"] for kw in inits] == ["step-1", "step-2"] * 2
    assert groups[0] == groups[1] != groups[2] == groups[3] and groups[0].startswith("grpo-")
    assert [kw["dir"] for kw in inits[:2]] == [str(tmp_path / "a" / "step-1"), str(tmp_path / "a" / "step-2")]
    assert f"step-<N>, in the group {groups[0]} (project entprobe)" in capsys.readouterr().out
    inits.clear()
    assert main([str(run), "--out", str(tmp_path / "c"), *given, "logging.wandb.group=mine",
                 "logging.wandb.name=lr3"]) == 0
    assert [(kw["group"], kw["name"]) for kw in inits] == [("mine", "lr3-step-1"), ("mine", "lr3-step-2")]


def test_checkpoints_found_by_step_and_chosen(tmp_path):
    for name in ("checkpoint-10", "checkpoint-2", "global_step_5/actor", "checkpoint-x", "other"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "global_step_5" / "actor" / "optim_world_size_1_rank_0.pt").write_bytes(b"")
    found = find_checkpoints(tmp_path)
    assert [c.step for c in found] == [2, 5, 10]
    verl = found[1]
    assert (verl.model_path, verl.state_path) == (tmp_path / "global_step_5/actor/huggingface",
                                                  tmp_path / "global_step_5/actor")
    assert [c.step for c in select(found, [10, 2], None)] == [2, 10]
    assert [c.step for c in select(found, None, 5)] == [5, 10]
    with pytest.raises(ConfigError, match=r"--steps: the run has no checkpoint at step 3; .* steps 2, 5, 10"):
        select(found, [3], None)


def test_the_trainer_plots_its_online_probes(run_dir):
    """``python -m entprobe.train --probe-every 1``: entprobe_over_steps.csv / .png in --out, a row per
    probed step with the numbers the log history holds (step 1 too: AdamW's first step is probed)."""
    rows = OS.read_csv(run_dir / "entprobe_over_steps.csv")
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    logged = {e["step"]: e for e in state["log_history"] if "entprobe/deltaH_pred" in e}
    assert [r["step"] for r in rows] == sorted(logged) == [1, 2, 3]
    for r in rows:
        e = logged[r["step"]]
        assert r["status"] == "ok" and r["deltaH_pred"] == pytest.approx(e["entprobe/deltaH_pred"], rel=1e-12)
        assert r["H"] == pytest.approx(e["entprobe/H_orig"], rel=1e-12) and r["SE_H"] > 0
        assert r["deltaH_true"] == pytest.approx(e["entprobe/deltaH_true"], rel=1e-12)
    png_ok(run_dir / "entprobe_over_steps.png")


def test_the_trl_callback_plots_its_history_at_the_end(tmp_path, capsys):
    from entprobe.integrations.trl import EntropyProbeCallback

    cb = EntropyProbeCallback.__new__(EntropyProbeCallback)  # only on_train_end: no trainer needed
    history = [{"step": s, "H_orig": 1.0 + s, "SE_H_orig": 0.1, "B_E": 8, "deltaH_pred": -0.01 * s,
                "SE_deltaH_pred": 0.005, "ci95_pred_low": -0.01 * s - 0.01, "ci95_pred_high": -0.01 * s + 0.01,
                "deltaH_true": -0.012 * s, "SE_deltaH_true": 0.006, "lr": 1e-6} for s in (20, 10)]
    cb.probe = SimpleNamespace(history=history)
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(is_world_process_zero=True, log_history=[])
    cb.on_train_end(args, state, None)
    rows = OS.read_csv(tmp_path / "entprobe_over_steps.csv")
    assert [(r["step"], r["H"], r["deltaH_pred"]) for r in rows] == [(10, 11.0, -0.1), (20, 21.0, -0.2)]
    assert math.isnan(rows[0]["ci95_true_low"]) and rows[0]["ci95_H_low"] < 11.0 < rows[0]["ci95_H_high"]
    png_ok(tmp_path / "entprobe_over_steps.png")
    assert str(tmp_path / "entprobe_over_steps.png") in capsys.readouterr().out
    cb.probe = None  # nothing probed: nothing written
    cb.on_train_end(SimpleNamespace(output_dir=str(tmp_path / "none")), state, None)
    assert not (tmp_path / "none").exists()


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0 and all(o in text for o in ("RUN_DIR", "--out", "--steps", "--every", "overrides"))
