"""Faults of entprobe-run and of the torchrun sweep (issue 39, "runs"):

- ``entprobe-run`` on a fresh ``--out`` leaves each job's own wandb run in its ``step-<N>/wandb/``
  (it was moved into ``step-<N>/previous-*/`` with a false "held an earlier run" line: the job set
  aside the earlier outputs after its logger had started the run there);
- a lock waiter prints nothing while the holder is another rank of its own job, or has taken the
  lock but not yet recorded itself ("no holder recorded"); another job's holder it names;
- the sweep summary on the console is an aligned table, no markdown (that stays in the file).

The torchrun sweep's console (one ``Launching`` line, no raw markdown, no lock line) is checked in
tests/test_distributed.py's torchrun multirun test.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from entprobe.reporting import sweep
from entprobe.runtime import locks
from entprobe.runtime.distributed import launch_id

FAKE_RESULTS = {"H_orig": 1.0, "SE_H_orig": 0.1, "B_E": 2, "deltaH_pred": -0.01, "deltaH_true": -0.02}


def test_entprobe_run_keeps_each_jobs_wandb_run_in_its_step_folder(tmp_path, monkeypatch, capsys):
    """The real probe job (``probe_job.run``: its run dir handling) and a real offline wandb run per
    checkpoint; only the probe's computation (``probe_job._run``) is replaced. A second
    entprobe-run into the same --out does hold an earlier run: that one is moved aside, and says so."""
    import entprobe.cli.probe_job as PJ
    from entprobe.cli.probe_run import main

    monkeypatch.setattr(PJ, "_run", lambda cfg, *a, **kw: dict(FAKE_RESULTS))
    for var in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "WANDB_DISABLE_GIT", "WANDB_SILENT", "WANDB_QUIET"):
        monkeypatch.delenv(var, raising=False)  # offline_env sets the first three
    run = tmp_path / "grpo"
    for step in (3, 6):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    out = tmp_path / "over"
    given = ["logging.logger=wandb", "logging.wandb.mode=offline", "logging.progress=false"]
    assert main([str(run), "--out", str(out), *given]) == 0
    printed = "".join(capsys.readouterr())
    assert "held an earlier run" not in printed
    for step in (3, 6):
        job = out / f"step-{step}"
        assert not list(job.glob("previous-*")), sorted(p.name for p in job.iterdir())
        (wandb_run,) = job.glob("wandb/offline-run-*/run-*.wandb")  # where `wandb sync step-N/wandb/...` looks
        assert wandb_run.stat().st_size > 0
    first = {step: next((out / f"step-{step}").glob("wandb/offline-run-*")).name for step in (3, 6)}
    assert main([str(run), "--out", str(out), *given]) == 0
    printed = "".join(capsys.readouterr())
    for step in (3, 6):
        job = out / f"step-{step}"
        assert f"[entprobe] {job} held an earlier run: moved wandb into previous-" in printed
        (prev,) = job.glob("previous-*")
        assert [p.name for p in prev.glob("wandb/offline-run-*")] == [first[step]]  # the first run's, whole
        (now,) = job.glob("wandb/offline-run-*")
        assert now.name != first[step] and list(now.glob("run-*.wandb"))


@pytest.fixture
def in_a_job(monkeypatch):
    """This process as rank 0 of a hand-started 2-rank process group (``launch_id``: its rendezvous)."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert launch_id() == "group 127.0.0.1:29511"


def hold(path: Path, record: dict | None, seconds: float) -> threading.Thread:
    """Hold ``path``'s lock as another process would (filelock's own lock, another open file),
    with ``record`` as its holder record (None: none written yet), for ``seconds``."""
    held = threading.Event()

    def run():
        lock = FileLock(str(path), thread_local=False)
        lock.acquire()
        if record is not None:
            path.write_text(json.dumps(record))
        held.set()
        time.sleep(seconds)
        path.write_text("")
        lock.release()
    t = threading.Thread(target=run)
    t.start()
    assert held.wait(10)
    return t


def other_process(job: str) -> dict:
    return {"pid": os.getpid() + 1, "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00", "job": job}


@pytest.mark.parametrize("holder, says", [
    ("peer", None),  # another rank of this job: waiting for it is by design
    ("unrecorded", None),  # the holder has the lock but has not written its record yet (< UNRECORDED_S)
    ("other job", "held by pid {pid} on host"),  # another job's rank: named
])
def test_a_lock_waiter_is_quiet_about_its_own_jobs_ranks(holder, says, tmp_path, in_a_job, capsys):
    lock = tmp_path / "cache.lock"
    lock.touch()
    record = {"peer": other_process(launch_id()), "unrecorded": None,
              "other job": other_process("group 127.0.0.1:29999")}[holder]
    assert locks.UNRECORDED_S >= 1.0  # the holder below lets go well within it
    t = hold(lock, record, 0.5)
    t0 = time.monotonic()
    with locks.file_lock(lock, timeout_s=30, what="sweep batch cache x"):
        waited = time.monotonic() - t0
        mine = json.loads(lock.read_text())
    t.join()
    assert waited >= 0.3  # it did wait for the holder
    err = capsys.readouterr().err
    if says is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and "sweep batch cache x: waiting for the lock" in err
        assert says.format(pid=record["pid"]) in err and "no holder recorded" not in err
        assert "another rank of this job" not in err
    assert mine["pid"] == os.getpid() and mine["job"] == launch_id()  # its own record names its job


def test_a_peer_that_never_lets_go_still_times_out_naming_it(tmp_path, in_a_job, capsys):
    lock = tmp_path / "cache.lock"
    lock.touch()
    record = other_process(launch_id())
    t = hold(lock, record, 1.0)
    try:
        with pytest.raises(locks.LockTimeout, match=rf"held by pid {record['pid']} on host .*another rank of this "
                                                    r"job\. Raise batch\.lock_timeout_s"):
            with locks.file_lock(lock, timeout_s=0.3, what="x"):
                pass
    finally:
        t.join()
    assert capsys.readouterr().err == ""


def test_the_console_sweep_summary_is_an_aligned_table_without_markdown():
    nan = float("nan")
    rows = [{"job": "0", "status": "ok", "overrides": ["a=1", "optimizer.lr=1e-06"], "deltaH_pred": 2.6228e-05,
             "SE_deltaH_pred": 1.5e-06, "deltaH_true": nan, "SE_deltaH_true": nan, "time_s": 5.048,
             "batch": "sampled", "stage12": "computed", "error": ""},
            {"job": "1-2", "status": "failed", "overrides": ["a=1", "optimizer.lr=-1.0"], "deltaH_pred": nan,
             "SE_deltaH_pred": nan, "deltaH_true": nan, "SE_deltaH_true": nan, "time_s": 0.25, "batch": "",
             "stage12": "", "error": "ConfigError: optimizer.lr: must be > 0"}]
    lines = sweep.console_summary(rows).splitlines()
    assert "|" not in "\n".join(lines) and "---" not in "\n".join(lines)
    assert lines[0].split() == ["job", "status", "overrides", "predicted", "measured", "time_s", "batch", "stage12"]
    assert lines[1].split() == ["0", "ok", "optimizer.lr=1e-06", "+2.623e-05", "±", "1.5e-06", "nan", "5.048",
                                "sampled", "computed"]  # only the override that varies
    assert lines[2].split() == ["1-2", "failed", "optimizer.lr=-1.0", "nan", "nan", "0.25"]
    assert lines[3] == "job 1-2 failed: ConfigError: optimizer.lr: must be > 0" and len(lines) == 4
    # aligned: every column starts where its header does
    for name in ("status", "overrides", "predicted", "measured", "time_s"):
        col = lines[0].index(name)
        assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[1:3]), name
