"""A run dir holds one run: an earlier run's outputs are moved aside, a failed run is marked.

At the start of a run, entprobe's outputs of an earlier run in the same folder (the results file,
``attribution.csv``, ``report.md`` and its plots, ``wandb/``, ``FAILED``, ... : ``OUTPUTS``) are moved into ``previous-<YYYYmmdd-HHMMSS>/`` in that folder; nothing else in the
folder is touched (Hydra rewrites its own ``.hydra/`` there before the job starts). So the new
outputs never sit beside stale ones, and nothing is deleted.

A run that raises (any exception, Ctrl-C included) leaves ``FAILED`` in the run dir: the time,
the error and the last frames of its traceback. No results file is written by a failed run.
"""
from __future__ import annotations

import contextlib
import fnmatch
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

from entprobe.runtime.atomic_io import write_text_atomic

FAILED = "FAILED"
# what a run writes into its run dir besides the results file (pipeline/modes/, reporting/tables.py, reporting/markdown.py,
# reporting/loggers.py, reporting/planning.py); Hydra's .hydra/ and job log are Hydra's own
OUTPUTS = ("attribution.csv", "ustat_units.csv", "buffers.safetensors", "per_unit.json",
           "report.md", "*.png", "results.csv", "wandb", FAILED)


def earlier_outputs(run_dir: Path, results_file: str) -> list[Path]:
    """The entries of ``run_dir`` an earlier run of entprobe wrote."""
    if not run_dir.is_dir():
        return []
    patterns = (results_file, *OUTPUTS)
    return sorted(p for p in run_dir.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in patterns))


def set_aside_earlier_run(run_dir: str | Path, results_file: str) -> Path | None:
    """Move an earlier run's outputs into ``previous-<timestamp>/``; returns that folder (None when
    the run dir held none)."""
    run_dir = Path(run_dir)
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


def failure_text(exc: BaseException, frames: int = 8) -> str:
    """What FAILED holds: when, the error, and the last ``frames`` frames of its traceback."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames)
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    head = f"{type(exc).__name__}: {exc}".strip()
    return f"entprobe run failed at {when}\n{head}\n\n" + "".join(tb)


@contextlib.contextmanager
def marks_failure(run_dir: str | Path, enabled: bool = True) -> Iterator[None]:
    """Write ``<run_dir>/FAILED`` when the block raises (once per exception), then re-raise."""
    try:
        yield
    except BaseException as exc:
        if enabled and not getattr(exc, "_entprobe_marked", False):
            write_text_atomic(Path(run_dir) / FAILED, failure_text(exc))
            with contextlib.suppress(AttributeError, TypeError):
                exc._entprobe_marked = True
        raise
