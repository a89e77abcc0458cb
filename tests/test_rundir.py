"""A run dir holds one run: an earlier run's outputs are moved into ``previous-<time>/``, a failed run
leaves ``FAILED`` (and no results file), and a non-finite headline is flagged and warned about."""
from __future__ import annotations

import json
import math

import pytest

import entprobe.pipeline.in_memory as core
from conftest import compose_cfg
from entprobe.config import ConfigError
from entprobe.cli.probe_job import run
from entprobe.runtime.rundir import set_aside_earlier_run
from entprobe.reporting.verdict import flags

QUICK = ("importance.enabled=false", "probe.variance_enabled=false")


def test_a_rerun_moves_the_earlier_outputs_aside_and_a_failed_rerun_is_marked(tmp_path):
    first = run(compose_cfg(tmp_path, *QUICK))
    old = (tmp_path / "results.json").read_text()
    (tmp_path / "notes.txt").write_text("mine")  # not entprobe's: stays where it is
    with pytest.raises(ConfigError, match="batch.load"):
        run(compose_cfg(tmp_path, f"batch.load='{tmp_path / 'nope'}'", *QUICK))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1
    assert (aside[0] / "results.json").read_text() == old and (aside[0] / "attribution.csv").is_file()
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "attribution.csv").exists()
    failed = (tmp_path / "FAILED").read_text()
    assert "ConfigError: batch.load=" in failed and "Traceback" in failed
    assert (tmp_path / "notes.txt").read_text() == "mine"

    second = run(compose_cfg(tmp_path, *QUICK))  # the failed run's marker goes aside too
    assert second["deltaH1"] == first["deltaH1"]
    assert not (tmp_path / "FAILED").exists() and (tmp_path / "results.json").is_file()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("previous-")]) == 2


def test_nothing_to_move_in_a_fresh_dir(tmp_path):
    assert set_aside_earlier_run(tmp_path / "new", "results.json") is None
    (tmp_path / "other.csv").write_text("x")
    assert set_aside_earlier_run(tmp_path, "results.json") is None


def test_every_non_finite_headline_value_is_flagged():
    ok = {"deltaH_pred": 0.1, "SE_deltaH_pred": 0.01, "deltaH1": 0.2, "SE_deltaH1": 0.02}
    assert "non_finite" not in [c for c, _ in flags(ok)]
    for key in ok:
        fl = dict(flags({**ok, key: math.nan}))
        assert key in fl["non_finite"], key


def test_a_non_finite_headline_is_warned_about_and_flagged_in_the_results(tmp_path, monkeypatch):
    def nan_probe(*args, **kwargs):
        return {"deltaH_pred": math.nan, "SE_deltaH_pred": 0.1, "deltaH1": 0.2, "SE_deltaH1": 0.1}
    monkeypatch.setattr(core, "run_two_batch", nan_probe)
    with pytest.warns(UserWarning, match="deltaH_pred is not finite"):
        res = run(compose_cfg(tmp_path, *QUICK))
    assert "non_finite" in res["flags"].split(",")
    assert "non_finite" in json.loads((tmp_path / "results.json").read_text())["flags"]


# ----------------------------------------------------------------------------- issue 24: nothing lost
import errno  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import entprobe.runtime.atomic_io as aio  # noqa: E402
import entprobe.runtime.rundir as rundir  # noqa: E402
from entprobe.runtime.rundir import FAILED, RUNNING, marks_failure  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _default_sigint() -> None:
    """In the child before it execs: SIGINT at its default, whatever pytest inherited (a test run started
    in the background, ``cmd &`` or nohup, ignores SIGINT, and its children would too)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _script(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with entprobe importable (a tiny script, not a probe), started as from
    an interactive shell (SIGINT not ignored)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC}, preexec_fn=_default_sigint)


# a run that sends itself a signal: after the signal nothing more of it may run
SIGNALLED_RUN = """
import os, signal, sys
from pathlib import Path
from entprobe.runtime.atomic_io import atomic_open
from entprobe.runtime.rundir import marks_failure, RUNNING
run_dir = Path(sys.argv[1])
with marks_failure(run_dir):
    assert (run_dir / RUNNING).is_file()
    with atomic_open(run_dir / "results.json") as f:   # a write under way when the signal comes
        f.write("{")
        f.flush()
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        raise AssertionError("the run went on after " + sys.argv[2])
"""


@pytest.mark.parametrize("sig, code, says", [("SIGTERM", 143, "killed by SIGTERM (exit code 143)"),
                                             ("SIGINT", -signal.SIGINT, "interrupted by SIGINT")])
def test_a_run_stopped_by_sigterm_or_sigint_leaves_failed_naming_the_signal(tmp_path, sig, code, says):
    res = _script(SIGNALLED_RUN, str(tmp_path), sig)
    # SIGTERM: 128 + 15; SIGINT: KeyboardInterrupt, with which Python ends by SIGINT (the shell's 130)
    assert res.returncode in (code, 130 if sig == "SIGINT" else code), res.stderr
    failed = (tmp_path / FAILED).read_text()
    assert says in failed and 'File "<string>", line ' in failed  # where the run was when the signal came
    assert not (tmp_path / RUNNING).exists() and not (tmp_path / "results.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the interrupted write is removed


def test_a_run_killed_by_sigkill_leaves_running_with_its_pid_and_the_next_run_cleans_up(tmp_path, capsys):
    res = _script(SIGNALLED_RUN, str(tmp_path), "SIGKILL")
    assert res.returncode == -signal.SIGKILL
    running = (tmp_path / RUNNING).read_text()
    assert not (tmp_path / FAILED).exists()  # SIGKILL cannot be caught: RUNNING is what is left
    assert f"host: {aio.this_host()}" in running and "pid: " in running and "started: " in running
    pid = int(running.split("pid: ")[1].split()[0])
    left = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert left == [n for n in left if n.startswith(f".results.json.{aio.this_host()}.{pid}.")] and len(left) == 1

    aside = rundir.set_aside_earlier_run(tmp_path, "results.json")  # the next run in this dir
    assert (aside / RUNNING).read_text() == running  # the evidence is kept
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert left[0] in capsys.readouterr().err


def test_only_temp_files_of_dead_or_long_silent_writers_are_removed(tmp_path):
    host, old = aio.this_host(), time.time() - 2 * rundir.STALE_TEMP_S
    names = {
        "live": f".results.json.{host}.{os.getpid()}.0123abcd.tmp",  # this process: alive
        "other_host_recent": ".results.json.elsewhere.4242.0123abcd.tmp",  # maybe alive there
        "other_host_old": ".report.md.elsewhere.4242.0123abcd.tmp",
        "legacy_old": ".results.json.k2_x9abz.tmp",  # mkstemp's name, before the writer was named
        "legacy_not_ours": ".mine.abcdefgh.tmp",
        "user_file": ".notes.tmp",
    }
    for key, name in names.items():
        (tmp_path / name).write_text("x")
        if key.endswith("old") or key in ("legacy_not_ours", "user_file"):
            os.utime(tmp_path / name, (old, old))
    staging = tmp_path / ".checkpoint-5.elsewhere.4242.00000000.tmp"  # a staging folder still being filled
    (staging / "sub").mkdir(parents=True)
    os.utime(staging, (old, old))
    (staging / "sub" / "w.bin").write_bytes(b"1")
    removed = {p.name for p in rundir.remove_stale_temps(tmp_path, "results.json")}
    assert removed == {names["other_host_old"], names["legacy_old"]}
    assert all((tmp_path / n).exists() for k, n in names.items() if n not in removed) and staging.is_dir()
    os.utime(staging / "sub" / "w.bin", (old, old))
    os.utime(staging / "sub", (old, old))
    assert {p.name for p in rundir.remove_stale_temps(tmp_path, "results.json")} == {staging.name}


@pytest.fixture
def interactive_sigint():
    """SIGINT at Python's default handler for the test, as in a foreground run, whatever this pytest
    process inherited (a background launch ignores SIGINT, which ``signals_raise`` rightly keeps)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_marks_failure_restores_the_signal_handlers_and_marks_once_when_nested(tmp_path, interactive_sigint):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with marks_failure(tmp_path):
        assert signal.getsignal(signal.SIGTERM) is rundir._raise_for
        assert signal.getsignal(signal.SIGINT) is rundir._raise_for
        assert f"pid: {os.getpid()}" in (tmp_path / RUNNING).read_text()
        with marks_failure(tmp_path):  # hydra_job around run(): the outer block keeps RUNNING
            pass
        assert (tmp_path / RUNNING).is_file()
    assert {s: signal.getsignal(s) for s in before} == before and not (tmp_path / RUNNING).exists()

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's SIGINT stays ignored
    try:
        with marks_failure(tmp_path):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)

    seen = []  # signal handlers can only be set from the main thread: elsewhere, nothing is set

    def in_a_thread():
        with marks_failure(tmp_path / "t"):
            seen.append(signal.getsignal(signal.SIGTERM))
    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen == [before[signal.SIGTERM]]


def test_rank_other_than_0_marks_nothing(tmp_path):
    with pytest.raises(ValueError):
        with marks_failure(tmp_path, enabled=False):
            assert not (tmp_path / RUNNING).exists()
            raise ValueError("x")
    assert not (tmp_path / FAILED).exists()


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                        (0o002, 0o664, 0o775)])
def test_outputs_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        aio.write_text_atomic(tmp_path / "r.json", "{}")
        with aio.staging_dir(tmp_path / "ck") as tmp:
            (tmp / "w").write_text("1")
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "ck").stat().st_mode & 0o777 == dir_mode


def test_a_full_disk_names_the_file_and_what_to_do_and_leaves_the_target(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(aio.os, "fsync", full)
    with pytest.raises(aio.OutputFileError) as info:
        aio.write_json_atomic({"a": 1}, target)
    msg = str(info.value)
    assert str(target) in msg and "free space" in msg and "run_dir" in msg and "Errno" not in msg
    assert info.value.errno == errno.ENOSPC and "\n" not in msg
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def test_a_full_disk_under_a_library_write_is_recognised(tmp_path, monkeypatch):
    """torch.save re-raises a failed write as its own RuntimeError: the OSError is its context."""
    import torch

    def save(obj, f):
        f.write(b"PK")
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(aio.OutputFileError, match="quota") as info:
        aio.torch_save_atomic({"x": 1}, tmp_path / "E.pt")
    assert "enforce" not in str(info.value) and os.listdir(tmp_path) == []


def test_a_file_size_limit_names_the_file_and_ulimit(tmp_path):
    """``ulimit -f``: CPython ignores SIGXFSZ from start-up, so the write fails with EFBIG."""
    target = tmp_path / "report.md"
    target.write_text("old")
    res = _script("import resource, sys\n"
                  "from entprobe.runtime.atomic_io import write_text_atomic\n"
                  "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
                  "try:\n    write_text_atomic(sys.argv[1], 'x' * 100_000)\n"
                  "except Exception as e:\n    print(type(e).__name__, e.errno, e)\n", str(target))
    assert res.stdout.startswith(f"OutputFileError {errno.EFBIG} cannot write {target}"), res.stdout + res.stderr
    assert "ulimit -f: 4096 bytes" in res.stdout and "raise the limit" in res.stdout
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]


def test_a_failure_on_a_full_disk_still_raises_its_own_error(tmp_path, monkeypatch, capsys):
    real = rundir.write_text_atomic

    def no_room_for_failed(path, text):
        if Path(path).name == FAILED:
            raise aio.no_room_error(Path(path), errno.ENOSPC)
        return real(path, text)
    monkeypatch.setattr(rundir, "write_text_atomic", no_room_for_failed)
    with pytest.raises(ValueError, match="the run's own error"):
        with marks_failure(tmp_path):
            raise ValueError("the run's own error")
    assert f"could not write {tmp_path / FAILED}" in capsys.readouterr().err
    assert not (tmp_path / RUNNING).exists()


# ----------------------------------------------------------------------------- a run refused before it starts
OWN = frozenset({".hydra", "main.log"})  # what Hydra writes into a run dir before the job


def _hydra_made(run_dir):
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run_dir / "main.log").write_text("")
    return run_dir


def _refused(run_dir, made, exc):
    from entprobe.runtime.rundir import Refusal, marks_failure

    with pytest.raises(type(exc)):
        with marks_failure(run_dir, refusal=Refusal((ConfigError,), made, OWN)):
            raise exc


def test_a_refused_run_removes_the_folders_it_made_and_nothing_else(tmp_path):
    """``marks_failure`` with a ``Refusal``: a user error removes the topmost folder this run made
    (outputs/ itself when the run made it) when it holds only the way down and Hydra's files; a
    folder beside it, a file put in, or an error that is no refusal keep everything, with FAILED."""
    run_dir = _hydra_made(tmp_path / "outputs" / "d" / "t")
    _refused(run_dir, tmp_path / "outputs", ConfigError("batch.G: is 1"))
    assert list(tmp_path.iterdir()) == []

    run_dir = _hydra_made(tmp_path / "outputs" / "d" / "t")  # made the run dir alone: its parents stay
    _refused(run_dir, run_dir, ConfigError("batch.G: is 1"))
    assert [p.name for p in (tmp_path / "outputs" / "d").iterdir()] == []

    a, b = _hydra_made(tmp_path / "o2" / "d" / "a"), _hydra_made(tmp_path / "o2" / "d" / "b")  # another run's beside
    _refused(b, tmp_path / "o2", ConfigError("batch.G: is 1"))
    assert a.is_dir() and (b / "FAILED").is_file()

    run_dir = _hydra_made(tmp_path / "o3" / "t")
    (run_dir / "notes.txt").write_text("mine")  # put in while the run started: kept
    _refused(run_dir, run_dir, ConfigError("batch.G: is 1"))
    assert (run_dir / "notes.txt").is_file() and "ConfigError" in (run_dir / "FAILED").read_text()

    run_dir = _hydra_made(tmp_path / "o4" / "t")
    _refused(run_dir, run_dir, RuntimeError("a bug"))  # not a refusal: marked as any failure
    assert "RuntimeError: a bug" in (run_dir / "FAILED").read_text() and not (run_dir / "RUNNING").exists()


def test_new_run_dir_notes_the_topmost_folder_hydra_makes(tmp_path, monkeypatch):
    """The Hydra callback (conf/config.yaml) notes, before Hydra makes the run dir, what that makes:
    outputs/ on a first run, the time's folder on a later one, nothing when the run dir exists."""
    from omegaconf import OmegaConf

    from entprobe.cli.new_run_dir import NewRunDir, made_for

    monkeypatch.chdir(tmp_path)
    start = NewRunDir().on_run_start
    config = OmegaConf.create({"hydra": {"run": {"dir": "outputs/d/t"}}})
    start(config)
    assert made_for(tmp_path / "outputs" / "d" / "t") == tmp_path / "outputs"
    (tmp_path / "outputs" / "d").mkdir(parents=True)
    start(config)
    assert made_for("outputs/d/t") == tmp_path / "outputs" / "d" / "t"
    (tmp_path / "outputs" / "d" / "t").mkdir()
    start(config)
    assert made_for("outputs/d/t") is None
