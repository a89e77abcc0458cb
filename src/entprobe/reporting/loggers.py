"""Where a run's results go besides ``results.json`` and ``report.md``: ``logging.logger``.

- ``wandb`` (default): a wandb run on rank 0, ``logging.wandb.mode`` offline (files under the run
  dir, ``wandb sync`` later) or online. Every file wandb writes for the run lands in the run dir's
  ``wandb/``: its staging, cache and artifact folders too (``wandb_dirs_env``; they would default
  to ``~/.local/share/wandb``, ``~/.cache/wandb`` and ``./artifacts``), unless the user's
  environment names them. Every result of the probe is a one-shot value, so all go
  to the run's **summary**, none to the history; the headline table (``results``) and the
  report's PNGs (``plots/<name>``) are logged once. The run is named from the command line's
  overrides (``lr=1e-05,B_E=8``), grouped by the sweep (its multirun directory), tagged with the
  probe mode, model source and weighting mode, and its job type is the probe mode. wandb's own
  banner and summary are not printed (the run ends by naming the wandb run's folder or page);
  ``WANDB_SILENT=false`` (or ``WANDB_QUIET``) in the environment gives wandb's lines back.
  ``logging.wandb.mode=disabled`` turns it off (then no logger runs).
- ``csv``: ``results.csv`` in the run dir, a header and one row of every scalar result.
- ``none``: nothing beyond results.json / report.md.

``logging.logger=csv`` or ``none`` with ``logging.wandb.mode=online`` is refused by
``config_checks.validate`` (it asks for a wandb run that would not happen).
"""
from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

from entprobe.reporting.tables import headline_rows
from entprobe.runtime.atomic_io import write_text_atomic

CSV_FILE = "results.csv"
# overrides that do not say what a run computes: left out of its name
_NOT_IN_NAME = ("logging.", "hydra.", "hydra/", "run_dir", "ddp.", "model.device", "model.cache_dir")


def scalars(results: dict) -> dict:
    """The results a logger records: numbers, booleans and strings (no nested values)."""
    return {k: v for k, v in results.items() if isinstance(v, (bool, int, float, str))}


def run_name(overrides: list[str], max_len: int = 120) -> str:
    """``lr=1e-05,B_E=8`` from ``["optimizer.lr=1e-05", "batch.B_E=8"]``: each override's last key
    component and its value, in command-line order; ``default`` when nothing is overridden."""
    parts = []
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if not sep or key.startswith(_NOT_IN_NAME):
            continue
        parts.append(f"{key.rsplit('.', 1)[-1]}={value}")
    name = ",".join(parts) or "default"
    return name if len(name) <= max_len else name[:max_len - 3] + "..."


def offline_env(mode: str) -> None:
    """Put wandb's mode in the environment before wandb reads it: ``mode=`` given to ``wandb.init``
    alone leaves wandb's process-wide telemetry online (0.31 resolves its server's host name from
    a background thread). Offline also turns off its error reporting and git probing."""
    os.environ["WANDB_MODE"] = mode
    if mode != "online":
        os.environ["WANDB_ERROR_REPORTING"] = "false"
        os.environ["WANDB_DISABLE_GIT"] = "true"


# wandb's folders outside its run folder, set for a run to these folders of <run_dir>/wandb/ (WANDB_CONFIG_DIR is
# not one: it holds the user's settings, which a run reads and does not write)
WANDB_DIRS = {"WANDB_DATA_DIR": "data", "WANDB_CACHE_DIR": "cache", "WANDB_ARTIFACT_DIR": "artifacts"}


def wandb_dirs_env(run_dir: Path) -> list[str]:
    """Point wandb's staging (``WANDB_DATA_DIR``: the results table is staged there), cache
    (``WANDB_CACHE_DIR``: its service's logs too) and artifact folders into ``<run_dir>/wandb/``,
    leaving any the environment already sets; returns the variables it set (``finish`` removes them)."""
    added = []
    for var, sub in WANDB_DIRS.items():
        if var not in os.environ:
            os.environ[var] = str(Path(run_dir).resolve() / "wandb" / sub)
            added.append(var)
    return added


# wandb's own variables for its console output: when the environment sets one, wandb follows it
QUIET_ENV = ("WANDB_SILENT", "WANDB_QUIET")


class WandbLogger:
    """A wandb run (rank 0 only; a no-op elsewhere). ``log`` writes the summary, the table and the
    images; ``finish`` closes the run with the job's exit code. wandb prints nothing of its own
    (``silent``, unless the environment sets ``QUIET_ENV``): the run's last lines name the wandb run
    (``folder``, ``url``: ``probe_job.logger_lines``)."""

    def __init__(self, wcfg, run_dir: Path, config: dict, name: str, group: str | None, tags: list[str],
                 job_type: str):
        offline_env(wcfg.mode)
        import wandb

        self.wandb = wandb
        self.env_added = wandb_dirs_env(run_dir)
        settings = getattr(wandb, "Settings", None)
        quiet = {} if settings is None or set(QUIET_ENV) & set(os.environ) else {"settings": settings(silent=True)}
        try:
            self.run = wandb.init(mode=wcfg.mode, project=wcfg.project, entity=wcfg.entity, name=wcfg.name or name,
                                  group=wcfg.group or group, tags=list(dict.fromkeys([*wcfg.tags, *tags])),
                                  job_type=wcfg.job_type or job_type, dir=str(run_dir), config=config,
                                  reinit="finish_previous", **quiet)
        except BaseException:
            self.run = None
            self.finish()
            raise
        files = getattr(self.run, "dir", None)  # wandb/<offline-run-...>/files
        self.folder = Path(files).parent if files else None
        self.url = getattr(self.run, "url", None) if wcfg.mode == "online" else None

    def log(self, results: dict, images: dict[str, Path]) -> None:
        if self.run is None:
            return
        self.run.summary.update(scalars(results))
        rows = [[k, float(v)] for k, v in headline_rows(results)
                if isinstance(v, (int, float)) and not isinstance(v, bool)]
        media = {"results": self.wandb.Table(columns=["result", "value"], data=rows)}
        media.update({f"plots/{name}": self.wandb.Image(str(path)) for name, path in images.items()})
        self.run.log(media)  # tables and images are media: wandb keeps them with the run's files

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
        for var in self.env_added:  # the next run in this process gets its own folders
            os.environ.pop(var, None)
        self.env_added = []


class CsvLogger:
    """``results.csv`` in the run dir: one header line (the keys, sorted) and one row."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / CSV_FILE

    def log(self, results: dict, images: dict[str, Path]) -> None:
        row = scalars(results)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=sorted(row))
        w.writeheader()
        w.writerow({k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
        write_text_atomic(self.path, buf.getvalue())

    def finish(self, exit_code: int = 0) -> None:
        pass


class NullLogger:
    def log(self, results: dict, images: dict[str, Path]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def make_logger(lcfg, run_dir: Path, config: dict, is_main: bool, overrides: list[str],
                sweep_dir: str | None, cfg) -> WandbLogger | CsvLogger | NullLogger:
    """The logger ``logging.logger`` names, on rank 0 (``NullLogger`` on the others). ``sweep_dir``:
    the multirun directory (the wandb group), None for a single run. ``cfg``: the typed config
    (probe mode, model source and weighting mode become tags)."""
    kind = getattr(lcfg.logger, "value", lcfg.logger)
    if not is_main or kind == "none" or (kind == "wandb" and lcfg.wandb.mode == "disabled"):
        return NullLogger()
    if kind == "csv":
        return CsvLogger(run_dir)
    mode = cfg.probe.mode.value
    tags = [mode, cfg.model.source.value, cfg.probe.weighting_mode.value] + (["sweep"] if sweep_dir else [])
    return WandbLogger(lcfg.wandb, run_dir, config, run_name(overrides), sweep_dir, tags, mode)
