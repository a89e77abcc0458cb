"""Concurrent runs: unique temp names, a lock per saved-batch folder and per sweep cache entry
whose waiters say who holds it and give up after ``batch.lock_timeout_s``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import compose_cfg, recording_units
from entprobe.runtime.atomic_io import atomic_open
from entprobe.runtime.locks import LockTimeout, file_lock
from entprobe.cli.probe_job import run
from entprobe.rollouts.sampling import RolloutBatch
from two_batch_bounds import bounds

# the per-unit backward: its passes record the magnitudes the comparison below is bounded by
QUICK = ("importance.enabled=false", "probe.projection=backward")


class Holder:
    """Holds a lock from another thread (its own open file: flock treats it as another holder)
    until ``release()``."""

    def __init__(self, path: Path):
        self._go, self._held = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._hold, args=(path,))
        self._t.start()
        assert self._held.wait(10)

    def _hold(self, path):
        with file_lock(path, timeout_s=10, what="test holder"):
            self._held.set()
            self._go.wait(600)  # released by the test (a run may first build the default checkpoint)

    def release(self):
        self._go.set()
        self._t.join()


def test_a_waiter_names_the_holder_and_gets_the_lock_when_it_is_released(tmp_path, capsys):
    lock = tmp_path / "f" / ".lock"
    holder = Holder(lock)
    threading.Timer(0.5, holder.release).start()
    t0 = time.monotonic()
    with file_lock(lock, timeout_s=20, what="saving batches"):
        waited = time.monotonic() - t0
        rec = json.loads(lock.read_text())
    assert waited >= 0.4
    err = capsys.readouterr().err
    assert f"saving batches: waiting for the lock {lock}, held by pid" in err and " on host " in err and " since " in err
    assert "batch.lock_timeout_s" in err
    assert rec["pid"] > 0 and rec["host"] and rec["since"]  # this process's record while it holds the lock


def test_a_stuck_lock_times_out_with_the_holder_and_the_key(tmp_path):
    lock = tmp_path / ".lock"
    holder = Holder(lock)
    try:
        with pytest.raises(LockTimeout, match=r"gave up after \d+ s waiting for the lock .*held by pid \d+ on host "
                                              r".*Raise batch\.lock_timeout_s"):
            with file_lock(lock, timeout_s=0.3, what="loading batches"):
                pass
    finally:
        holder.release()


def test_a_lock_file_left_by_a_dead_process_is_free(tmp_path):
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": 999_999_999, "host": "gone", "since": "2020-01-01T00:00:00+00:00"}))
    t0 = time.monotonic()
    with file_lock(lock, timeout_s=0, what="x"):
        assert json.loads(lock.read_text())["host"] != "gone"
    assert time.monotonic() - t0 < 1


def test_two_writers_of_one_path_use_their_own_temp_files(tmp_path):
    target = tmp_path / "E.pt"
    with atomic_open(target, "wb") as a, atomic_open(target, "wb") as b:
        temps = sorted(p.name for p in tmp_path.iterdir())
        assert len(temps) == 2 and all(t.startswith(".E.pt.") and t.endswith(".tmp") for t in temps)
        a.write(b"A" * 1000)
        b.write(b"B" * 10)
    assert target.read_bytes() == b"A" * 1000  # the last rename wins, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["E.pt"]  # no temp file left


RUN_ONE = """
import json, sys
from conftest import compose_cfg
from entprobe.cli.probe_job import run
run_dir, folder, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = run(compose_cfg(run_dir, f"batch.save='{folder}'", f"batch.seed_E={seed}", f"batch.seed_U={seed + 100}",
                      *sys.argv[4:]))
print(json.dumps({"deltaH1": res["deltaH1"]}))
"""


def test_two_runs_saving_to_one_folder_leave_one_runs_complete_pair(tmp_path):
    """Two processes with different seeds, so they sample different batches, save to one folder at
    once; it ends with E, U and batches.json all from one of them (the lock serialises the writes)."""
    folder = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = {seed: subprocess.Popen([sys.executable, "-c", RUN_ONE, str(tmp_path / f"run{seed}"), str(folder),
                                     str(seed), *QUICK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for seed in (11, 12)}
    results = {}
    for seed, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results[seed] = json.loads(out.strip().splitlines()[-1])
    meta = json.loads((folder / "batches.json").read_text())
    seed = meta["seed_E"]
    assert meta["seed_U"] == seed + 100
    # the pair in the folder is that run's: rerun it on the saved batches and get its numbers back
    with recording_units() as rec:
        again = run(compose_cfg(tmp_path / "again", f"batch.load='{folder}'", f"batch.seed_E={seed}",
                                f"batch.seed_U={seed + 100}", *QUICK))
    # equal up to the rounding of the per-unit sums (the runs above use one thread, this process may
    # not, and another thread count blocks the sums otherwise: two_batch_bounds.py)
    tol = bounds(again, rec.split(again["B_E"]))["deltaH1"]
    assert abs(again["deltaH1"] - results[seed]["deltaH1"]) <= tol and again["batch_source"] == "load"
    other = results[23 - seed]["deltaH1"]  # the other run's batches give another number
    assert abs(other - results[seed]["deltaH1"]) > 1e-3 * abs(results[seed]["deltaH1"])
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "E.pt", "U.pt", "batches.json"]


def test_a_run_waits_for_a_held_save_folder_then_writes(tmp_path, capsys, monkeypatch):
    """The holder lets go once the run is waiting (its first poll), however long the run took to
    get there (building the default checkpoint, a loaded machine): no race on a timer."""
    import types

    import entprobe.runtime.locks as locks
    folder = tmp_path / "b"
    holder = Holder(folder / ".lock")
    cfg = compose_cfg(tmp_path / "run", f"batch.save='{folder}'", *QUICK)

    def release_then_sleep(s):
        holder.release()
        time.sleep(s)
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.sleep = release_then_sleep
    monkeypatch.setattr(locks, "time", clock)
    run(cfg)
    assert "waiting for the lock" in capsys.readouterr().err
    assert RolloutBatch.load(folder / "U.pt").B == 4


def test_a_sweep_job_behind_a_stuck_cache_lock_fails_with_the_key(tmp_path):
    cache = tmp_path / "batch_cache" / "k"
    cfg = compose_cfg(tmp_path / "run", "batch.lock_timeout_s=0.5", *QUICK)
    holder = Holder(Path(str(cache) + ".lock"))
    try:
        with pytest.raises(LockTimeout, match=r"sweep batch cache .*Raise batch\.lock_timeout_s"):
            run(cfg, batch_cache=cache)
    finally:
        holder.release()
    assert (tmp_path / "run" / "FAILED").read_text().count("LockTimeout") >= 1
    assert not (tmp_path / "run" / "results.json").exists()


def test_file_lock_is_filelock_s_lock(tmp_path):
    """runtime/locks.py takes the ``filelock`` package's lock: one held through filelock itself
    keeps ``file_lock`` out (and the other way round), and waiting ends when it is released."""
    from filelock import FileLock, Timeout

    lock = tmp_path / ".lock"
    other = FileLock(str(lock), thread_local=False)
    other.acquire()
    try:
        with pytest.raises(LockTimeout, match="no holder recorded"):
            with file_lock(lock, timeout_s=0.2, what="x"):
                pass
    finally:
        other.release()
    with file_lock(lock, timeout_s=0, what="x"):
        with pytest.raises(Timeout):
            FileLock(str(lock), thread_local=False).acquire(timeout=0)


def test_processes_that_need_the_default_checkpoint_at_once_build_it_once(tmp_path, monkeypatch):
    """The ranks of a torchrun job on a fresh cache: one builds, the others wait on the lock and use
    what it published (two ranks building at once read each other's half-written folder)."""
    import entprobe.checkpoints.default_checkpoint as dc

    builds = []

    def slow_build(folder, seed=0):
        builds.append(folder)
        time.sleep(0.5)
        (Path(folder) / "optimizer.pt").write_bytes(b"x")

    monkeypatch.setattr(dc, "build_default_checkpoint", slow_build)
    out = []
    threads = [threading.Thread(target=lambda: out.append(dc.ensure_default_checkpoint(str(tmp_path))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(set(out)) == 1 and (out[0] / "optimizer.pt").is_file()
