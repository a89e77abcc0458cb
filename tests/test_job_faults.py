"""The offline job's refusals and messages (issue 39, "main job"): each refused run is one line
``entprobe: error: ...``, exit 2, and (refused before Hydra starts) no run or sweep folder; the
verdict says what its numbers can and cannot tell.

Refusals run in process (``main()`` with the command line in ``sys.argv``): refused before any
model loads, a fraction of a second each.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import entprobe.main as entry

QUIET = ["logging.logger=none", "logging.progress=false"]


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    """An empty working folder (where Hydra would make outputs/ and multirun/), no HYDRA_FULL_ERROR."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    return tmp_path


def refused(monkeypatch, capsys, *argv: str) -> str:
    """``python -m entprobe.main argv`` in process: it must exit 2 with one line on stderr; that line."""
    monkeypatch.setattr(sys, "argv", ["entprobe", *argv])
    with pytest.raises(SystemExit) as info:
        entry.main()
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and out == "", err
    return err.strip()


@pytest.mark.parametrize("argv, want", [
    (["--lr", "1e-5"], "--lr is not an option: set optimizer.lr=1e-5"),
    (["--lr=1e-5"], "--lr is not an option: set optimizer.lr=1e-5"),
    (["--B_U", "4", "batch.G=4"], "--B_U is not an option: set batch.B_U=4"),
    (["-m", "--seed", "3"], "--seed is not an option: set seed=3"),
    (["--epochs", "3"], "--epochs is not an option: settings are key=value overrides (e.g. optimizer.lr=1e-5); "
                        "python -m entprobe.main --help lists every key"),
])
def test_an_unknown_flag_is_one_line_naming_the_override(cwd, monkeypatch, capsys, argv, want):
    """Not Hydra's 8-line usage: the override the flag means (common ones mapped), else --help."""
    assert refused(monkeypatch, capsys, *argv, *QUIET) == f"entprobe: error: {want}"
    assert list(cwd.iterdir()) == []


def test_hydra_flags_still_work(cwd, monkeypatch, capsys):
    """--cfg, -cn/--config-name, --help, --info are Hydra's and go through (no refusal)."""
    from entprobe.cli.command_line import unknown_flag

    for argv in (["--cfg", "job"], ["--help"], ["--hydra-help"], ["--info", "config"], ["-m", "batch.G=2,4"],
                 ["--multirun", "x=1"], ["--config-name", "config"], ["-cn", "config"], ["-cp", "conf"],
                 ["--config-dir=/tmp"], ["--", "--lr"]):
        assert unknown_flag(argv) is None, argv
    monkeypatch.setattr(sys, "argv", ["entprobe", "--cfg", "job", "batch.B_E=3"])
    entry.main()  # prints the job's config and returns
    assert "  B_E: 3\n" in capsys.readouterr().out and list(cwd.iterdir()) == []


@pytest.mark.parametrize("sweep, job", [
    (["batch.G=4,1"], "batch.G=1"),
    (["optimizer.lr=1e-6,-1.0", "batch.B_E=4"], "optimizer.lr=-1.0 batch.B_E=4"),
])
def test_a_sweep_checks_every_jobs_ranges_before_job_0(cwd, monkeypatch, capsys, sweep, job):
    """An out-of-range value in any job of a multirun refuses the sweep before job 0 runs: one line
    naming that job's overrides and the key, and no multirun/ folder (job 0 never ran)."""
    line = refused(monkeypatch, capsys, "-m", *sweep, *QUIET)
    key = "batch.G: is 1" if "G=" in job else "optimizer.lr: must be > 0"
    assert line.startswith(f"entprobe: error: job {job} logging.logger=none logging.progress=False: {key}"), line
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
def test_jsonl_without_a_path_says_it_is_unset(cwd, monkeypatch, capsys, multirun):
    argv = ["-m", "task=jsonl", "batch.seed_E=0,1"] if multirun else ["task=jsonl"]
    line = refused(monkeypatch, capsys, *argv, *QUIET)
    assert line.endswith("task.path is not set: task=jsonl needs task.path=FILE.jsonl (one prompt record per line)")
    assert list(cwd.iterdir()) == []
