"""A run dir holds one run: an earlier run's outputs are moved aside, a running run and a failed run
are marked.

At the start of a run, entprobe's outputs of an earlier run in the same folder (the results file,
``attribution.csv``, ``report.md`` and its plots, ``wandb/``, ``FAILED``, ``RUNNING``, ... : ``OUTPUTS``)
are moved into ``previous-<YYYYmmdd-HHMMSS>/`` in that folder, and temp files an interrupted write
left there (``.<name>.<host>.<pid>.<random>.tmp``, runtime/atomic_io.py) are removed once their
writer is dead or they are ``STALE_TEMP_S`` old (a live writer's are kept). Nothing else in the
folder is touched (Hydra rewrites its own ``.hydra/`` there before the job starts). So the new
outputs never sit beside stale ones, and nothing of a finished run is deleted.

While a run runs, ``RUNNING`` in the run dir says who runs it (pid, host, start time, SLURM job,
command line); it is removed when the run ends, however it ends. A run that raises (any exception)
or is stopped by SIGTERM (SLURM's ``scancel``, a time limit, torchrun) or SIGINT (Ctrl-C) leaves
``FAILED``: the time, the error (``killed by SIGTERM``) and the last frames of its traceback; it
exits with 128 + the signal's number (143 for SIGTERM; SIGINT ends in ``KeyboardInterrupt``). No
results file is written by a failed run. A run refused by its checks before any work, in a run dir
it made, removes that folder instead (``Refusal``). So a run dir holds, at the end:

- the results file: the run finished;
- ``FAILED``: it failed, and says why;
- ``RUNNING`` alone: it is still running, or it was killed without a chance to say so (SIGKILL,
  the out-of-memory killer, a node failure): ``RUNNING`` names the host and pid (and SLURM job) to
  check (``squeue -j``, ``sacct -j``).
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from entprobe.runtime.atomic_io import parse_temp_name, this_host, write_text_atomic

FAILED = "FAILED"
RUNNING = "RUNNING"
STALE_TEMP_S = 600.0  # a temp file not written to for this long is a leftover, whoever wrote it
# what a run writes into its run dir besides the results file (pipeline/modes/, reporting/tables.py, reporting/markdown.py,
# reporting/loggers.py, reporting/planning.py); Hydra's .hydra/ and job log are Hydra's own
OUTPUTS = ("attribution.csv", "ustat_units.csv", "buffers.safetensors", "per_unit.json",
           "report.md", "*.png", "results.csv", "wandb", FAILED, RUNNING)


def earlier_outputs(run_dir: Path, results_file: str) -> list[Path]:
    """The entries of ``run_dir`` an earlier run of entprobe wrote."""
    if not run_dir.is_dir():
        return []
    patterns = (results_file, *OUTPUTS)
    return sorted(p for p in run_dir.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in patterns))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _last_written(path: Path) -> float:
    """The newest modification time of ``path`` and, for a folder, of everything in it."""
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):
            times += [os.lstat(os.path.join(folder, n)).st_mtime for n in dirs + files]
    return max(times)


def stale_temps(run_dir: Path, results_file: str, now: float | None = None) -> list[Path]:
    """The temp files and staging folders in ``run_dir`` (top level) that an interrupted write left:
    written by a process of this host that is gone, or not written to for ``STALE_TEMP_S``. Temp
    files of older entprobes (no writer in the name) count by age, and only for entprobe's outputs."""
    if not run_dir.is_dir():
        return []
    now, host, found = time.time() if now is None else now, this_host(), []
    patterns = (results_file, *OUTPUTS)
    for p in run_dir.iterdir():
        tmp = parse_temp_name(p.name)
        if tmp is None or (tmp.pid is None and not any(fnmatch.fnmatch(tmp.target, pat) for pat in patterns)):
            continue
        try:
            dead = tmp.host == host and not _alive(tmp.pid)
            if dead or now - _last_written(p) > STALE_TEMP_S:
                found.append(p)
        except FileNotFoundError:  # its writer renamed or removed it meanwhile
            continue
    return sorted(found)


def remove_stale_temps(run_dir: str | Path, results_file: str) -> list[Path]:
    """Remove ``stale_temps`` (saying so on stderr); returns what was removed."""
    run_dir = Path(run_dir)
    found = stale_temps(run_dir, results_file)
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if found:
        print(f"[entprobe] {run_dir}: removed {len(found)} temp file(s) an interrupted write left: "
              f"{', '.join(p.name for p in found)}", file=sys.stderr, flush=True)
    return found


def set_aside_earlier_run(run_dir: str | Path, results_file: str) -> Path | None:
    """Remove the temp files an interrupted write left (``remove_stale_temps``), then move an
    earlier run's outputs into ``previous-<timestamp>/``; returns that folder (None when the run dir
    held none)."""
    run_dir = Path(run_dir)
    remove_stale_temps(run_dir, results_file)
    found = earlier_outputs(run_dir, results_file)
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in found)))
    dest, n = run_dir / f"previous-{stamp}", 1
    while dest.exists():
        dest, n = run_dir / f"previous-{stamp}-{n}", n + 1
    dest.mkdir()
    for p in found:
        p.rename(dest / p.name)
    print(f"[entprobe] {run_dir} held an earlier run: moved {', '.join(p.name for p in found)} into {dest.name}/",
          file=sys.stderr, flush=True)
    return dest


class Killed(SystemExit):
    """Raised in the main thread by SIGTERM during a run (``signals_raise``): the run unwinds (its
    ``finally`` blocks run, ``FAILED`` is written) and the process exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"killed by {signal.Signals(self.signum).name} (exit code {self.code})"


def _raise_for(signum: int, frame) -> None:
    """The handler ``signals_raise`` installs: SIGINT raises ``KeyboardInterrupt`` naming it (exactly
    that class: Python then ends by SIGINT, as a shell expects of Ctrl-C), any other ``Killed``."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt("interrupted by SIGINT (Ctrl-C)")
    raise Killed(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Killed`` and SIGINT ``KeyboardInterrupt`` in it. Only from the
    main thread (Python's rule), and only over the default handlers: a signal that is ignored (SIGINT
    of a background job) or handled by the caller keeps its handler. The previous handlers return
    after the block."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(sig) is default:
                previous[sig] = signal.signal(sig, _raise_for)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def failure_text(exc: BaseException, frames: int = 8) -> str:
    """What FAILED holds: when, the error (``killed by SIGTERM`` for a signal) and the last
    ``frames`` frames of its traceback."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames)
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    head = str(exc) if isinstance(exc, Killed) else f"{type(exc).__name__}: {exc}".strip()
    return f"entprobe run failed at {when}\n{head}\n\n" + "".join(tb)


def running_text() -> str:
    """What RUNNING holds: who runs the run (pid, host, start time, SLURM job, command line)."""
    env = os.environ
    job = (f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}" if "SLURM_ARRAY_JOB_ID" in env
           else env.get("SLURM_JOB_ID", "-"))
    return (f"entprobe run in progress (or killed by SIGKILL / the out-of-memory killer if pid {os.getpid()} is "
            f"gone from {this_host()}, or SLURM job {job} has ended)\n"
            f"pid: {os.getpid()}\nhost: {this_host()}\nstarted: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
            f"slurm_job: {job}\ncommand: {' '.join(sys.argv)}\n")


_marking: set[str] = set()  # the run dirs this process marks (an inner marks_failure of one leaves it to the outer)


@dataclass(frozen=True)
class Refusal:
    """How ``marks_failure`` treats a run refused before it starts: an exception of ``errors`` (the
    user errors: a config value, an input file) removes ``made``, the topmost folder this run created
    for its run dir (the run dir or an ancestor), instead of leaving it with ``FAILED``, when it holds
    only this run's own files (``own``: Hydra's ``.hydra/`` and job log; the markers) and the way
    down to the run dir (``remove_made_run_dir``)."""
    errors: tuple[type[BaseException], ...]
    made: Path
    own: frozenset[str] = frozenset()


def remove_made_run_dir(run_dir: str | Path, made: str | Path, own: frozenset[str] | set[str] = frozenset()) -> bool:
    """Remove ``made`` (the topmost folder created for ``run_dir``: ``run_dir`` itself or an ancestor
    of it) when each folder from ``made`` down holds only the next one, and ``run_dir`` only ``own``
    names, ``RUNNING`` and ``FAILED``; returns whether it did. Anything else there (another run's
    folder beside it, a file someone put in) keeps everything."""
    run_dir, made = Path(run_dir).absolute(), Path(made).absolute()
    if made != run_dir and made not in run_dir.parents:
        return False
    down = [p for p in reversed(run_dir.parents) if p == made or made in p.parents] + [run_dir]
    try:
        for folder, nxt in zip(down, down[1:]):
            if [p.name for p in folder.iterdir()] != [nxt.name]:
                return False
        if any(p.name not in {*own, RUNNING, FAILED} for p in run_dir.iterdir()):
            return False
        shutil.rmtree(made)
    except OSError:
        return False
    return True


def _write_marker(path: Path, text: str) -> None:
    """Write a marker; when even that fails (a full disk), say so on stderr instead of hiding the run's error."""
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        print(f"[entprobe] could not write {path}: {exc}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def marks_failure(run_dir: str | Path, enabled: bool = True, refusal: Refusal | None = None) -> Iterator[None]:
    """Mark the block's run in ``run_dir``: ``RUNNING`` while it runs, SIGTERM / SIGINT raising in it
    (``signals_raise``), and ``FAILED`` when it raises (once per exception; then re-raised).
    ``enabled=False`` (a rank other than 0) marks nothing. Nested blocks of one run dir: the
    outermost one writes and removes ``RUNNING`` and handles the signals. ``refusal``: a run
    refused in the block (its checks before any work) leaves no run dir this run made (``Refusal``)."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    outer = enabled and key not in _marking
    if outer:
        _marking.add(key)
    try:
        if outer:
            write_text_atomic(run_dir / RUNNING, running_text())
        with signals_raise() if outer else contextlib.nullcontext():
            yield
    except BaseException as exc:
        if enabled and refusal is not None and isinstance(exc, refusal.errors) and \
                not getattr(exc, "_entprobe_marked", False):
            (run_dir / RUNNING).unlink(missing_ok=True)
            if remove_made_run_dir(run_dir, refusal.made, refusal.own):
                with contextlib.suppress(AttributeError, TypeError):
                    exc._entprobe_marked = True
        if enabled and not getattr(exc, "_entprobe_marked", False):
            _write_marker(run_dir / FAILED, failure_text(exc))
            with contextlib.suppress(AttributeError, TypeError):
                exc._entprobe_marked = True
        raise
    finally:
        if outer:
            _marking.discard(key)
            (run_dir / RUNNING).unlink(missing_ok=True)
