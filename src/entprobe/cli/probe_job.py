"""Hydra entry point: ``python -m entprobe.main [overrides]``; ``run(cfg)`` is importable. The job
wiring only: load from disk (``load_from_disk``: checkpoints/models.py, pipeline/geometry.py, pipeline/run_batches.py) -> the probe of
what is in memory (pipeline/in_memory.py: one of the two modes, pipeline/modes/two_batch.py, pipeline/modes/single_batch.py) ->
results.json, verdict, report.md (core.finish) -> logger (reporting/loggers.py). The Python API (pipeline/api.py)
shares everything after the loading.

    python -m entprobe.main                                   # built-in default, ~1 min on 2 CPU cores
    python -m entprobe.main importance.is_mode=clip
    python -m entprobe.main model=hf model.path=/ckpt/checkpoint-500 optimizer.state_path=/ckpt/checkpoint-500
    python -m entprobe.main -m batch.B_E=8,16 optimizer.lr=1e-6,1e-5      # sweep (see reporting/sweep.py)
    launchers/torchrun.sh 2 batch.B_E=64 batch.B_U=64                        # DDP, one run dir
    python -m entprobe.main -m hydra/launcher=slurm hydra.launcher.nodes=2   # SLURM (docs/scaling.md)
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from entprobe.runtime import distributed as D
from entprobe.reporting import sweep
from entprobe.pipeline.run_batches import get_batches
from entprobe.config import EntprobeConfig, register_configs
from entprobe.pipeline.config_checks import to_typed
from entprobe.pipeline.in_memory import InMemory, finish, probe_batches, probe_context
from entprobe.pipeline.geometry import build_geometry
from entprobe.reporting.loggers import make_logger
from entprobe.checkpoints.models import LoadedModel, load_model
from entprobe.checkpoints.preflight import CheckedInputs, check_inputs
from entprobe.checkpoints.trainer_args import set_in_config_files
from entprobe.tasks.prompt_ids import check_template, style_of
from entprobe.reporting.markdown import PLOT_FILES, REPORT_FILE
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.runtime.rundir import Refusal, marks_failure, set_aside_earlier_run
from entprobe.cli import new_run_dir
from entprobe.cli.user_errors import USER_ERRORS
from entprobe.pipeline.lr_share import ShareSource
from entprobe.pipeline.stages.context import ProbeContext
from entprobe.tasks import Task, build_task
from entprobe.tasks.base import check_encodable
from entprobe.tasks.lengths import check_prompt_lengths

register_configs()
# hydra.sweep.subdir (conf/config.yaml): a job folder no concurrent multirun shares (reporting/sweep.py)
OmegaConf.register_new_resolver("entprobe_job_subdir", sweep.job_subdir, replace=True)




def load_probe(cfg: EntprobeConfig) -> tuple[LoadedModel, Task, ProbeContext]:
    """The task, the model (DDP-wrapped in the context when a process group exists; the task's
    prompts are checked against the tokenizer before the weights load), and the probe's context
    (``core.probe_context``)."""
    task = build_task(OmegaConf.structured(cfg.task))
    where = f"task.path={cfg.task.path}" if cfg.task.path else f"task._target_={cfg.task._target_}"
    style = style_of(cfg)

    def check_tokenizer(tok) -> None:
        check_encodable(task, tok, where)
        check_template(tok, [p.source for p in task.prompts[:1]], style, where)
        check_prompt_lengths(task, tok, cfg, where)

    lm = load_model(cfg.model, check_tokenizer=check_tokenizer)
    # DDP (or FSDP2 sharding in place, ddp.strategy) under torchrun / SLURM
    model = D.wrap(lm.model, lm.device, cfg.ddp.find_unused_parameters, cfg.ddp.strategy.value)
    return lm, task, probe_context(cfg, lm.model, lm.device, lm.autocast_dtype, run_model=model)


def run(cfg, batch_cache: str | Path | None = None, set_aside: bool = True,
        inputs: CheckedInputs | None = None) -> dict:
    """The whole job: check inputs -> load -> sample -> probe -> write results. Returns flat results
    (identical on every rank; only rank 0 writes). ``batch_cache``: a folder shared by the jobs of
    a sweep. The run dir holds this run only (``rundir``: an earlier run's outputs are moved aside
    unless ``set_aside=False``, the caller having done it); a failure leaves ``FAILED`` there.
    ``inputs``: ``check_inputs(cfg)`` when the caller ran it already."""
    run_dir, main_rank = Path(str(cfg.run_dir)), D.env_rank() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if set_aside and main_rank:
        set_aside_earlier_run(run_dir, str(cfg.logging.results_file))
    with marks_failure(run_dir, enabled=main_rank):
        cfg = to_typed(cfg)
        D.init_from_env(cfg.ddp.backend, cfg.ddp.timeout_s, str(cfg.model.device))
        return _run(cfg, run_dir, Path(batch_cache) if batch_cache else None, inputs)


def _run(cfg: EntprobeConfig, run_dir: Path, batch_cache: Path | None, inputs: CheckedInputs | None = None) -> dict:
    """Load from disk (``load_from_disk``), probe what was loaded (``core.probe_batches``), write."""
    t0 = time.perf_counter()
    held, E_all, U_all, batch_source = load_from_disk(cfg, batch_cache, inputs)
    results = probe_batches(cfg, held, E_all, U_all, batch_source, run_dir)
    results["time/total_s"] = time.perf_counter() - t0
    finish(cfg, results, run_dir)
    return results


def load_from_disk(cfg: EntprobeConfig, batch_cache: Path | None = None, inputs: CheckedInputs | None = None
                   ) -> tuple[InMemory, RolloutBatch, RolloutBatch, str]:
    """Everything the probe reads from files: the inputs checked before the model loads (``inputs``,
    or ``check_inputs`` now), the model and task (``load_probe``), the geometry from the checkpoint's
    optimizer state, and the global batches E and U (loaded, from the sweep's cache, or sampled) with
    where they came from."""
    if inputs is None:
        inputs = check_inputs(cfg)  # everything that needs no model, before it loads
    torch.manual_seed(cfg.seed)
    lm, task, ctx = load_probe(cfg)
    geo, meta = build_geometry(cfg, lm, ctx.params, ctx.buffers_device, inputs.optimizer_state)
    E_all, U_all, batch_source = get_batches(cfg, lm, task, ctx, inputs, batch_cache)
    sweep_share = ShareSource(batch_cache, inputs) if batch_cache is not None else None  # Stages 1-2 over lrs
    return InMemory(lm, task, ctx, geo, meta, sweep_share), E_all, U_all, batch_source


def _shown(p: Path, cwd: Path) -> str:
    """``p`` relative to ``cwd`` when under it, absolute otherwise."""
    p = Path(p).absolute()
    try:
        return str(p.relative_to(cwd.absolute()))
    except ValueError:
        return str(p)


def logger_lines(logger, cwd: Path) -> list[str]:
    """The line that names the run's wandb run (wandb itself is quiet: ``reporting.loggers``): its
    page when online, else its folder and the command that uploads it."""
    url, folder = getattr(logger, "url", None), getattr(logger, "folder", None)
    if url:
        return [f"entprobe: {'wandb':<8} {url}"]
    if folder is not None:
        return [f"entprobe: {'wandb':<8} {_shown(folder, cwd)} (offline: 'wandb sync' it to upload)"]
    return []


def where_outputs(run_dir: Path, results_file: str, cwd: Path) -> list[str]:
    """The lines that end a successful run: where its report.md, results file and plots are (paths
    relative to ``cwd``, the folder the command ran in, when under it; absolute otherwise); a file
    that was not written (``logging.report=false``) is not named."""
    shown = lambda p: _shown(p, cwd)  # noqa: E731
    lines = [f"entprobe: {what:<8} {shown(run_dir / name)}" for what, name in
             (("report", REPORT_FILE), ("results", results_file)) if (run_dir / name).is_file()]
    plots = sorted(run_dir.glob("*.png"))
    if plots:
        lines.append(f"entprobe: {'plots':<8} " + ", ".join(shown(p) for p in plots))
    return lines


LEGACY_GROUPS = {"probe_rework": "probe"}  # former group names the command line still accepts


def renamed_overrides(argv: list[str]) -> list[str]:
    """Command-line overrides with former group names replaced (``probe_rework.x=1`` ->
    ``probe.x=1``, also with ``+``/``~``/``++`` prefixes and as a group choice), each with a warning."""
    out = []
    for arg in argv:
        head = arg[:len(arg) - len(arg.lstrip("+~"))]
        for old, new in LEGACY_GROUPS.items():
            rest = arg[len(head):]
            if rest == old or rest.startswith((old + ".", old + "=")):
                warnings.warn(f"entprobe: the config group '{old}' is now '{new}'; read {arg!r} as "
                              f"{head + new + rest[len(old):]!r}", FutureWarning, stacklevel=2)
                arg = head + new + rest[len(old):]
        out.append(arg)
    return out


def hydra_job(cfg: DictConfig) -> float | None:
    """The job Hydra runs (``entprobe.main.hydra_main``, beside the package's conf/). Process group first (rank decides who logs), then one run dir for all ranks (rank 0's),
    the sweep's batch cache in multirun mode, the logger on rank 0 (``logging.logger``), ``run``, teardown
    (the group outlives the jobs of a multirun: ``D.shutdown``'s ``keep_group``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    D.init_from_env(cfg.ddp.backend, cfg.ddp.timeout_s, str(cfg.model.device))
    logger, ok = None, False
    try:
        hydra_files = {hc.output_subdir or ".hydra", f"{hc.job.name}.log"}
        run_dir = D.shared_run_dir(hc.runtime.output_dir, hydra_files)
        if D.is_main():  # before the logger starts writing into run_dir (wandb/, csv)
            set_aside_earlier_run(run_dir, str(cfg.logging.results_file))
        made = new_run_dir.made_for(run_dir) if D.is_main() and hc.mode == RunMode.RUN else None
        refusal = Refusal(USER_ERRORS, made, frozenset(hydra_files)) if made is not None else None
        with marks_failure(run_dir, enabled=D.is_main(), refusal=refusal):  # refused here: no run dir left
            with_dir = OmegaConf.to_container(cfg, resolve=True)
            with_dir["run_dir"] = str(run_dir)
            given = list(hc.overrides.task) + set_in_config_files(hc.runtime)  # win over training_args.bin
            typed = to_typed(OmegaConf.create(with_dir), explicit=given)
            inputs = check_inputs(typed)  # every input file, before the logger (wandb) starts and the model loads
        with marks_failure(run_dir, enabled=D.is_main()):
            cache = None
            multirun = hc.mode == RunMode.MULTIRUN
            if multirun:  # batches (unless batch.load) and lr-independent Stages 1-2 (pipeline/lr_share.py)
                sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir  # absolute, also with hydra.job.chdir
                cache = D.broadcast_object(str(sweep.batch_cache_dir(sweep_dir, typed, D.world())))
            config = OmegaConf.to_container(OmegaConf.structured(typed), enum_to_str=True)  # with training_args.bin's
            logger = make_logger(typed.logging, run_dir, config, D.is_main(), list(hc.overrides.task),
                                 str(hc.sweep.dir) if multirun else None, typed)
            results = run(typed, batch_cache=cache, set_aside=False, inputs=inputs)
            logger.log(results, {n: run_dir / f for n, f in PLOT_FILES.items() if (run_dir / f).is_file()})
            ok = True
            return results.get("deltaH1")
    finally:
        if logger is not None:
            logger.finish(0 if ok else 1)
        if ok and D.is_main():  # the last lines, after the logger's own
            lines = where_outputs(run_dir, str(cfg.logging.results_file), Path(hc.runtime.cwd))
            print("\n".join(lines + logger_lines(logger, Path(hc.runtime.cwd))), flush=True)
        # a multirun's next job reuses the group: re-initialising it on torchrun's store hangs
        D.shutdown(ok, keep_group=hc.mode == RunMode.MULTIRUN)

