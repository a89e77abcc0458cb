"""``python -m entprobe.probe_run RUN_DIR [--out DIR] [--steps 10,20 | --every K] [overrides...]``
(``entprobe-run``): probe every checkpoint of a training run, in one process.

The run's checkpoints (``find_checkpoints``): HF / TRL ``checkpoint-<N>/`` folders and verl
``global_step_<N>/`` ones (weights from ``actor/huggingface``, optimizer state from ``actor/``), by
step. The config is composed once from the package's conf/ with the Hydra overrides given (as
``python -m entprobe.main`` composes it; ``model=hf`` unless a model is chosen); each checkpoint is then
probed by the probe job itself (``cli.probe_job.run``) with ``model.path`` and
``optimizer.state_path`` set to it, into ``<out>/step-<N>/`` (its report.md, results.json). A
checkpoint whose schedule has ended (next lr 0) is skipped, one that fails otherwise is recorded as
failed with its one-line reason; the others go on. A value the probe job's config checks refuse
whatever the checkpoint (``check_overrides``: ``batch.G=1``, ``optimizer.lr=-1``) is refused once,
before any checkpoint, as any user error. With ``logging.logger=wandb`` each checkpoint is a wandb
run named ``step-<N>``, all of one probe_run in one group (``job_config``, ``wandb_group``).
``<out>`` gets ``over_steps.csv``, ``over_steps.png`` and ``report.md`` (reporting/over_steps.py).
Exit status: 0 when at least one checkpoint was probed, 1 when none was, 2 for a user error (no
checkpoint in RUN_DIR, a bad override, ...).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.trainer_args import set_in_config_files
from entprobe.checkpoints.trainer_task import TaskNotGiven
from entprobe.checkpoints.trainer_checkpoint import checkpoint_step, existing_checkpoints
from entprobe.checkpoints.trainer_states.verl import find_verl_folder
from entprobe.cli.probe_job import renamed_overrides, run, where_outputs
from entprobe.cli.user_errors import ArgumentParser, exits_on_user_error, is_user_error, one_line
from entprobe.config import ConfigError
from entprobe.pipeline.api import compose_config
from entprobe.pipeline.config_checks import to_typed
from entprobe.reporting import over_steps as OS
from entprobe.reporting.loggers import make_logger
from entprobe.reporting.markdown import REPORT_FILE
from entprobe.runtime.atomic_io import write_text_atomic
from entprobe.runtime.rundir import set_aside_earlier_run

VERL_RE = re.compile(r"^global_step_(\d+)$")
PATTERNS = "checkpoint-<N>/ (HF / TRL Trainer) or global_step_<N>/ (verl, with actor/)"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run: its step, the weights folder (``model.path``) and the optimizer
    state's (``optimizer.state_path``)."""
    step: int
    model_path: Path
    state_path: Path


def find_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's ``checkpoint-<N>`` and verl ``global_step_<N>`` folders, by step; a ConfigError naming
    the folder and the patterns when there is none."""
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is not a folder: give the training run's output folder, "
                          f"the one holding its {PATTERNS}")
    found = [Checkpoint(checkpoint_step(p), p, p) for p in existing_checkpoints(run_dir)]
    for p in run_dir.iterdir():
        m = VERL_RE.match(p.name)
        if m and p.is_dir():
            actor = find_verl_folder(p) or (p / "actor")
            found.append(Checkpoint(int(m.group(1)), actor / "huggingface", actor))
    if not found:
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} holds no checkpoint folder: looked for {PATTERNS}; give "
                          "the training run's output folder (e.g. the trainer's --out / output_dir)")
    return sorted(found, key=lambda c: c.step)


def select(found: list[Checkpoint], steps: list[int] | None, every: int | None) -> list[Checkpoint]:
    """``--steps`` (those steps; one not in the run is an error naming the ones it has) or ``--every K``
    (the steps divisible by K), else all."""
    have = [c.step for c in found]
    if steps:
        missing = sorted(set(steps) - set(have))
        if missing:
            raise ConfigError(f"--steps: the run has no checkpoint at step {', '.join(map(str, missing))}; "
                              f"its checkpoints are at steps {', '.join(map(str, have))}")
        return [c for c in found if c.step in set(steps)]
    if every:
        chosen = [c for c in found if c.step % every == 0]
        if not chosen:
            raise ConfigError(f"--every={every}: none of the run's steps ({', '.join(map(str, have))}) is a multiple")
        return chosen
    return found


def compose_run(overrides: list[str]):
    """The config the probe job would compose from ``overrides`` (``model=hf`` unless a model is
    chosen), with Hydra's node (its run dir and choices) kept."""
    if not any(o.lstrip("+~").startswith("model=") for o in overrides):
        overrides = ["model=hf", *overrides]
    return compose_config(overrides, return_hydra_config=True)  # a mistake: one line naming the override


def job_config(cfg, ck: Checkpoint, job_dir: Path, group: str | None = None):
    """The composed config of one checkpoint's job: ``model.path`` and ``optimizer.state_path`` set to
    the checkpoint, ``run_dir`` to ``job_dir``; its wandb run in ``group`` unless
    ``logging.wandb.group`` is given, named ``step-<N>`` (``<logging.wandb.name>-step-<N>`` when given)."""
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    job.model.path, job.optimizer.state_path, job.run_dir = str(ck.model_path), str(ck.state_path), str(job_dir)
    w = job.logging.wandb
    w.group = w.group or group
    w.name = f"{w.name}-step-{ck.step}" if w.name else f"step-{ck.step}"
    return job


def with_paths(explicit: list[str], ck: Checkpoint) -> list[str]:
    """The user's overrides and the checkpoint's paths: what the job treats as given on the command line."""
    return [*explicit, f"model.path={ck.model_path}", f"optimizer.state_path={ck.state_path}"]


def wandb_group(run_dir: Path) -> str:
    """The wandb group of one probe_run's runs: RUN_DIR's name and 6 random hex digits (a second
    probe_run of the same training run is a group of its own)."""
    return f"{Path(run_dir).resolve().name[:100]}-{uuid.uuid4().hex[:6]}"


def check_overrides(cfg, explicit: list[str], first: Checkpoint, out: Path) -> None:
    """The probe job's config checks (``to_typed``), once, before any checkpoint is probed: a
    ConfigError the config gives on its own (no training_args.bin read) and, word for word, with
    the first checkpoint's training_args.bin as its job reads it, is the overrides' (or the
    defaults'), and is raised; so is a trainer run probed without a task (``TaskNotGiven``: the
    overrides choose none, and the first checkpoint's training_args.bin shows a trainer run).
    Anything else is left to each checkpoint's job: an error a checkpoint's settings cure (a TRL
    key with ``objective=trl`` from its training_args.bin) or cause, or a checkpoint's damaged
    file, stays that checkpoint's."""
    job, given = job_config(cfg, first, out / f"step-{first.step}"), with_paths(explicit, first)
    alone = job.copy()
    alone.model.trainer_args = "ignore"
    refused = None
    with contextlib.redirect_stdout(io.StringIO()):  # the notes to_typed prints: each job prints its own
        try:
            to_typed(alone, explicit=given)
        except ConfigError as exc:
            refused = exc
        try:
            to_typed(job, explicit=given)
        except TaskNotGiven:
            raise
        except ConfigError as exc:
            if refused is not None and str(exc) == str(refused):
                raise refused from None
        except Exception:  # noqa: BLE001 -- the checkpoint's own problem: its job records it
            pass


def probe_one(cfg, explicit: list[str], ck: Checkpoint, job_dir: Path, group: str | None = None) -> dict:
    """The probe job on one checkpoint into ``job_dir`` (``probe_job.run``, with the logger the job
    would make; a wandb run in ``group``, ``job_config``); returns its results. An earlier run's
    outputs in ``job_dir`` are moved aside before the logger starts (as ``probe_job.hydra_job``
    does): the job's own wandb run, which the logger starts in ``job_dir/wandb/``, stays there."""
    job = job_config(cfg, ck, job_dir, group)
    explicit = with_paths(explicit, ck)
    typed = to_typed(job, explicit=explicit)
    config = OmegaConf.to_container(OmegaConf.structured(typed), enum_to_str=True)
    job_dir.mkdir(parents=True, exist_ok=True)
    set_aside_earlier_run(job_dir, str(typed.logging.results_file))
    logger = make_logger(typed.logging, job_dir, config, True, explicit, None, typed)
    ok = False
    try:
        results = run(typed, set_aside=False)
        logger.log(results, {})
        ok = True
        return results
    finally:
        logger.finish(0 if ok else 1)


def reason_of(exc: BaseException) -> str:
    """Why a checkpoint was not probed, on one line: a user error's own message, else the exception's
    type and first line."""
    if is_user_error(exc):
        return one_line(exc).removeprefix("entprobe: error: ")
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def probe_run(run_dir: Path, overrides: list[str], out: Path | None = None, steps: list[int] | None = None,
              every: int | None = None, progress: bool = True, log=print) -> tuple[list[dict], Path]:
    """Probe the run's chosen checkpoints (module docstring); returns the rows and the output folder."""
    chosen = select(find_checkpoints(run_dir), steps, every)
    cfg = compose_run(renamed_overrides(overrides))
    explicit = list(cfg.hydra.overrides.task) + set_in_config_files(cfg.hydra.runtime)
    out = Path(out) if out is not None else Path(str(cfg.hydra.run.dir))
    with open_dict(cfg):
        del cfg["hydra"]
    check_overrides(cfg, explicit, chosen[0], out)  # a bad value: refused before any checkpoint, nothing written
    group, w = wandb_group(run_dir), cfg.logging.wandb
    if getattr(cfg.logging.logger, "value", cfg.logging.logger) == "wandb" and w.mode != "disabled":
        log(f"entprobe: wandb: a run per checkpoint, {w.name + '-' if w.name else ''}step-<N>, in the group "
            f"{w.group or group} (project {w.project})")
    out.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(chosen, desc="checkpoints", unit="ckpt", disable=not progress, dynamic_ncols=True)
    for ck in bar:
        bar.set_postfix(step=ck.step, refresh=True)
        job_dir = out / f"step-{ck.step}"
        t0 = time.perf_counter()
        try:
            res = probe_one(cfg, explicit, ck, job_dir, group)
            row = OS.over_steps_row(ck.step, "ok", res, job_dir.name, time_s=time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 -- recorded with its reason, the run goes on
            ended = isinstance(exc, OptimizerStateError) and exc.schedule_ended  # next lr 0: nothing to probe
            row = OS.over_steps_row(ck.step, "skipped" if ended else "failed", None, job_dir.name, reason_of(exc),
                                    time.perf_counter() - t0)
        rows.append(row)
        what = row["status"] + (f": {row['reason']}" if row["reason"] else "")
        (bar.write if progress else log)(f"entprobe: step {ck.step} {what} ({row['time_s']:.1f} s)")
    bar.close()
    write_outputs(rows, out, run_dir)
    return rows, out


def write_outputs(rows: list[dict], out: Path, run_dir: Path) -> None:
    """``over_steps.csv``, ``over_steps.png`` and ``report.md`` in ``out`` (each atomically)."""
    OS.write_csv(rows, out / OS.CSV_FILE)
    OS.plot(rows, out / OS.PLOT_FILE, title=f"entropy over the training run {run_dir.name}: H and the "
            "predicted / measured change of the next step")
    write_text_atomic(out / REPORT_FILE, OS.report(rows, str(run_dir)))


HELP = """Probe every checkpoint of a training run, each as python -m entprobe.main would, in one process.

  python -m entprobe.probe_run runs/grpo --out runs/grpo-over-steps batch.B_E=16

finds RUN_DIR's checkpoint-<N>/ (HF / TRL) and global_step_<N>/ (verl) folders, probes each into
OUT/step-<N>/ and writes OUT/over_steps.csv, over_steps.png and report.md. A checkpoint whose
schedule has ended (next lr 0) is skipped, one that fails is recorded with its reason; the others
go on. Exit status 0 when one was probed, 1 when none was, 2 for a usage error (docs/over_steps.md)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: RUN_DIR, the options, the Hydra overrides (before or after the options)."""
    ap = ArgumentParser(prog="python -m entprobe.probe_run", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the training run's folder (its checkpoint folders inside)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every probe job, as python -m entprobe.main "
                    "takes them (e.g. batch.B_E=16 logging.logger=none)")
    ap.add_argument("--out", default=None, help="output folder (default: a new run folder, outputs/<date>/<time>/)")
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--steps", default=None, help="comma-separated steps to probe, e.g. 10,20")
    pick.add_argument("--every", type=int, default=None, help="probe the checkpoints whose step is a multiple of K")
    return ap.parse_intermixed_args(argv)  # overrides before or after the options


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0: some checkpoint probed, 1: none, 2: user error)."""
    a = parse_args(sys.argv[1:] if argv is None else list(argv))
    with exits_on_user_error():
        try:
            steps = [int(s) for s in a.steps.split(",") if s.strip()] if a.steps else None
        except ValueError:
            raise ConfigError(f"--steps={a.steps!r}: comma-separated step numbers, e.g. --steps 10,20") from None
        if a.every is not None and a.every < 1:
            raise ConfigError(f"--every={a.every}: must be >= 1")
        rows, out = probe_run(Path(a.run_dir), a.overrides, Path(a.out) if a.out else None, steps, a.every)
    print("\n".join(where_outputs(out, OS.CSV_FILE, Path.cwd())), flush=True)
    return 0 if any(r["status"] == "ok" for r in rows) else 1
