"""Sweeps: one sampled batch per batch configuration, and a summary row per job.

    python -m entprobe.main -m batch.B_E=8,16 batch.B_U=8,16 optimizer.lr=1e-6,1e-5
    # multirun/<date>/<time>/
    #   0/ .. 7/                 one run directory per job (results.json, attribution.csv, ...);
    #                            <num>-2/ .. while another running multirun holds <num>/ (job_subdir)
    #   .jobs/<folder>.lock      a job folder's claim, held by its multirun's process until it exits
    #   batch_cache/<key>/       E.pt, U.pt, batches.json: sampled by the first job that needs them, loaded by
    #                            every other job with the same key (here: once per (B_E, B_U))
    #     stage12/<key>/         Stages 1-2, computed by the first of the jobs that differ only in
    #                            the lr, rescaled by the others (pipeline/lr_share.py)
    #   sweep_summary.csv / .md  one row per job folder (``job``), from what that job wrote,
    #                            rewritten as each job ends (``stage12``: reused / computed / off)
    #   sweep_summary.png        predicted vs measured (95% intervals) over lr, one colour per B

Cache key: everything the sampled batches depend on (batch minus save/load, sampling, model,
task, probe mode, seed, world size, and where they are not the default whether E is drawn on its
own and the prompt tokenization the objective resolves), hashed; never the optimizer, so lr sweeps
share batches.
Jobs running in parallel (submitit) take a file lock per key (``<key>.lock``, ``entprobe.runtime.locks``): one
samples, the others wait (printing who holds the lock, up to ``batch.lock_timeout_s``) and load.

Failures: a job that raises is marked FAILED by Hydra and recorded here with its error; the
other jobs of the batch still run (Hydra raises the first failure only after the whole batch,
so the command exits non-zero). The summary is written at every job end, so it is complete
even though Hydra skips ``on_multirun_end`` after a failure.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import time
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from entprobe.runtime.atomic_io import write_text_atomic
from entprobe.runtime.distributed import env_rank
from entprobe.runtime.locks import try_lock
from entprobe.rollouts.saved_batches import e_drawn, is_complete
from entprobe.tasks.prompt_ids import style_of

log = logging.getLogger(__name__)

CACHE_DIR = "batch_cache"
ROWS_DIR = ".summary_rows"
SUMMARY = "sweep_summary"
METRICS = ("deltaH_pred", "SE_deltaH_pred", "deltaH_true", "SE_deltaH_true", "deltaH_true_minus_pred",
           "SE_deltaH_true_minus_pred", "ESS_frac", "deltaH1", "SE_deltaH1")
SETTINGS = ("lr", "B_E", "B_U")  # read from results.json: the plot's x axes
COLUMNS = ("job", "status", "overrides", *SETTINGS, *METRICS, "time_s", "batch", "stage12", "error")


# ----------------------------------------------------------------------------- batch cache
def batch_cache_key(cfg, world: int) -> str:
    """Hash of what determines the sampled E and U (``cfg`` is a typed EntprobeConfig)."""
    skip = ("save", "load", "lock_timeout_s", "share_across_lr")
    batch = {k: v for k, v in dataclasses.asdict(cfg.batch).items() if k not in skip}
    parts = {"batch": batch, "sampling": dataclasses.asdict(cfg.sampling),
             "model": dataclasses.asdict(cfg.model), "task": dataclasses.asdict(cfg.task),
             "mode": cfg.probe.mode, "seed": cfg.seed, "world": world}
    if not e_drawn(cfg) or style_of(cfg) != "entprobe":  # E is U / prompts tokenized as the objective's trainer
        parts.update(E_drawn=e_drawn(cfg), tokenize=style_of(cfg))
    blob = json.dumps(parts, sort_keys=True, default=lambda v: getattr(v, "value", str(v)))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def batch_cache_dir(sweep_dir: str | Path, cfg, world: int) -> Path:
    return Path(sweep_dir) / CACHE_DIR / batch_cache_key(cfg, world)


def cache_complete(folder: str | Path) -> bool:
    """A pair of batches was committed there (``saved_batches.is_complete``: saved as one unit)."""
    return is_complete(folder)


# ----------------------------------------------------------------------------- job dirs
CLAIMS_DIR = ".jobs"
_CLAIMED: dict[tuple[str, str], tuple[object, str]] = {}  # (sweep dir, job num) -> (lock, subdir)


def job_subdir(sweep_dir, num) -> str:
    """``hydra.sweep.subdir`` (the ``entprobe_job_subdir`` resolver, conf/config.yaml): the job's
    folder in the sweep dir, never one another running multirun uses.

    Rank 0 claims ``<num>`` by locking ``.jobs/<num>.lock`` until its process exits; while another
    live multirun holds it (two ``-m`` runs into one ``hydra.sweep.dir``), ``<num>-2``, ``<num>-3``
    ... A later multirun into the same dir takes ``<num>`` again (the earlier results are moved to
    ``previous-*``: ``runtime.rundir``). Other ranks get a folder of their own, ``.rank<r>/<num>``:
    the job uses rank 0's (``distributed.shared_run_dir``), which removes theirs."""
    num, rank = str(num), env_rank()
    if rank != 0:
        return f".rank{rank}/{num}"
    key = (str(sweep_dir), num)
    if key not in _CLAIMED:  # the same answer each time this process resolves it
        claims = Path(str(sweep_dir)) / CLAIMS_DIR
        for k in range(1, 10_000):
            name = num if k == 1 else f"{num}-{k}"
            lock = try_lock(claims / f"{name}.lock")
            if lock is not None:
                _CLAIMED[key] = (lock, name)
                break
        else:
            raise RuntimeError(f"{sweep_dir}: no free job folder for job {num} (are 10,000 multiruns "
                               f"running into it?); give this one its own hydra.sweep.dir")
    return _CLAIMED[key][1]


# ----------------------------------------------------------------------------- summary
def job_row(config: DictConfig, job_return: JobReturn, seconds: float) -> dict:
    """One summary row from a finished job: its results.json when it completed, its error if not."""
    out = Path(config.hydra.runtime.output_dir)
    ok = job_return.status == JobStatus.COMPLETED
    row = {"job": out.name, "status": "ok" if ok else "failed",
           "overrides": list(job_return.overrides or []), "time_s": round(seconds, 3),
           "output_dir": str(out), "batch": "", "stage12": "", "error": ""}
    row.update({k: float("nan") for k in (*SETTINGS, *METRICS)})
    results = out / str(config.get("logging", {}).get("results_file", "results.json"))
    if ok and results.is_file():
        res = json.loads(results.read_text())
        row.update({k: res.get(k, float("nan")) for k in METRICS})
        # single_batch: its one batch B is the update batch, gt/B_E the fresh batch it is measured on
        row.update(lr=res.get("lr", float("nan")), B_E=res.get("B_E", res.get("gt/B_E", float("nan"))),
                   B_U=res.get("B_U", res.get("B", float("nan"))))
        row["batch"] = res.get("batch_source", "")
        row["stage12"] = stage12_column(res)
    elif ok:
        row.update(status="failed", error=f"no {results.name} in {out}")
    else:
        err = job_return._return_value  # the exception (``return_value`` would re-raise it)
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return row


def stage12_column(res: dict) -> str:
    """``reused`` (Stages 1-2 read from another lr's job), ``computed`` (here, stored for the
    others), ``off`` (not shared: ``stage12_share`` says why) or empty (single_batch)."""
    if res.get("reused_stage12"):
        return "reused"
    return str(res.get("stage12_share", "")).split(" ", 1)[0].rstrip(":")


def read_rows(sweep_dir: str | Path) -> list[dict]:
    folder = Path(sweep_dir) / ROWS_DIR
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted(rows, key=_order)


def _order(row: dict) -> tuple[int, str]:
    """Rows by job number, then folder (``3`` before ``3-2``, the concurrent multirun's)."""
    num, _, rest = str(row["job"]).partition("-")
    return (int(num) if num.isdigit() else -1, rest.zfill(8))


def _varying(rows: list[dict]) -> list[list[str]]:
    """Each row's overrides without those every job shares (they say nothing about the row)."""
    if len(rows) < 2:
        return [r["overrides"] for r in rows]
    common = set(rows[0]["overrides"]).intersection(*(set(r["overrides"]) for r in rows[1:]))
    return [[o for o in r["overrides"] if o not in common] for r in rows]


def _cell(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_summary(rows: list[dict], path: str | Path) -> Path | None:
    """sweep_summary.png: predicted and measured change with 95% intervals against lr, as they
    are and per unit lr, one colour per setting of B_E / B_U when they vary (plots.sweep: lines
    only along lr). None when no job has a prediction yet."""
    ok = [r for r in rows if r["status"] == "ok" and all(_finite(r.get(k)) for k in SETTINGS)
          and _finite(r.get("deltaH_pred"))]
    if not ok:
        return None
    varying = [k for k in SETTINGS if k != "lr" and len({r[k] for r in ok}) > 1]

    def series(row: dict) -> str:
        return ",".join(f"{k}={row[k]:g}" for k in varying)

    from entprobe.reporting import plots  # here: a missing matplotlib costs the plot, not the summary
    return plots.sweep(ok, path, series)


def write_summary(sweep_dir: str | Path) -> tuple[Path, Path]:
    """sweep_summary.csv (full precision), sweep_summary.md (a table) and sweep_summary.png (a
    plot: a failure is a warning) from the rows so far."""
    sweep_dir = Path(sweep_dir)
    rows = read_rows(sweep_dir)
    table = [{**r, "overrides": " ".join(o)} for r, o in zip(rows, _varying(rows))]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[*COLUMNS, "output_dir"], extrasaction="ignore")
    w.writeheader()
    w.writerows(table)
    csv_path, md_path = sweep_dir / f"{SUMMARY}.csv", sweep_dir / f"{SUMMARY}.md"
    write_text_atomic(csv_path, buf.getvalue())
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]).replace("|", "\\|") for c in COLUMNS) + " |" for r in table]
    n_bad = sum(r["status"] != "ok" for r in rows)
    try:
        png = plot_summary(rows, sweep_dir / f"{SUMMARY}.png")
    except Exception as exc:  # a plot is never worth the summary
        log.warning("sweep summary: plot failed (%s: %s)", type(exc).__name__, exc)
        png = None
    figure = f"\n![predicted vs measured]({png.name})\n" if png else ""
    write_text_atomic(md_path, f"# Sweep {sweep_dir}\n\n{len(rows)} jobs, {n_bad} failed.\n\n"
                  + "\n".join(lines) + "\n" + figure)
    return csv_path, md_path


CONSOLE = (("job", "job"), ("status", "status"), ("overrides", "overrides"), ("predicted", "deltaH_pred"),
           ("measured", "deltaH_true"), ("time_s", "time_s"), ("batch", "batch"), ("stage12", "stage12"))


def _pm(row: dict, key: str) -> str:
    """``value ± SE`` of ``key`` (``nan`` when it has no value; the SE left out when it has none)."""
    v, se = row.get(key, math.nan), row.get(f"SE_{key}", math.nan)
    if not _finite(v):
        return "nan"
    return f"{v:+.4g} ± {se:.2g}" if _finite(se) else f"{v:+.4g}"


def console_summary(rows: list[dict]) -> str:
    """The sweep summary for the console: one aligned line per job (job, status, the overrides that
    vary, the predicted and measured change ± SE, time, batch, stage12), then each failed job's
    error; the full table stays in sweep_summary.md / .csv."""
    table = [{**r, "overrides": " ".join(o)} for r, o in zip(rows, _varying(rows))]
    cells = [[h for h, _ in CONSOLE]]
    cells += [[_pm(r, k) if h in ("predicted", "measured") else _cell(r.get(k, "")) for h, k in CONSOLE]
              for r in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(CONSOLE))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines += [f"job {r['job']} failed: {r['error']}" for r in table if r["status"] != "ok" and r.get("error")]
    return "\n".join(lines)


def quiet_other_ranks() -> None:
    """On a rank other than 0 of a distributed job (each torchrun rank runs Hydra's launcher),
    Hydra's own INFO lines (``Launching 2 jobs locally``, ``#0 : ...``) are not shown: rank 0's are
    the sweep's; its warnings and errors still are."""
    if env_rank() != 0:
        logging.getLogger("hydra").setLevel(logging.WARNING)


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.sweep_summary`` in config.yaml): a row per multirun job.

    Runs where the job runs (the local process, or the submitit job); rank 0 of a distributed
    job writes. Single runs are left alone. Ranks other than 0 keep Hydra's launcher lines to
    themselves (``quiet_other_ranks``): each job's are printed once."""

    def __init__(self) -> None:
        self._start: dict[int, float] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        quiet_other_ranks()  # before the launcher's "Launching N jobs"

    @staticmethod
    def _sweep_dir(config: DictConfig) -> Path:
        return Path(config.hydra.runtime.cwd) / config.hydra.sweep.dir  # also with hydra.job.chdir

    @staticmethod
    def _active(config: DictConfig) -> bool:
        return config.hydra.mode == RunMode.MULTIRUN and env_rank() == 0

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        quiet_other_ranks()  # the job's logging config was just applied
        self._start[int(config.hydra.job.get("num", 0) or 0)] = time.perf_counter()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        quiet_other_ranks()  # before the launcher's "#<next> : ..." line
        if not self._active(config):
            return
        num = int(config.hydra.job.num)
        row = job_row(config, job_return, time.perf_counter() - self._start.pop(num, time.perf_counter()))
        sweep = self._sweep_dir(config)  # a row per job folder: a concurrent multirun's are others
        write_text_atomic(sweep / ROWS_DIR / f"{row['job']}.json", json.dumps(row))
        write_summary(sweep)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep = self._sweep_dir(config)
        if env_rank() != 0 or not (sweep / ROWS_DIR).is_dir():
            return
        _, md = write_summary(sweep)
        log.info("sweep summary: %s\n%s", md, console_summary(read_rows(sweep)))
