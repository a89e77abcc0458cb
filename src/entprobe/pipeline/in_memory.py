"""Probe what is already in memory: a model, its optimizer's geometry and sampled batches -> results.

Shared by the command line (``main.run``: load from disk, sample, then this) and the Python API
(``api.probe``: the caller's model, optimizer and task or batches, then this). Nothing here reads a
file; ``finish`` writes the run dir's outputs.

    results = probe_batches(cfg, held, E_all, U_all, "sampled", run_dir)
    results["time/total_s"] = ...
    finish(cfg, results, run_dir)
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from entprobe.runtime import distributed as D
from entprobe.math import paramvec as pv
from entprobe.runtime.atomic_io import write_json_atomic
from entprobe.pipeline.run_batches import shard, shard_resample
from entprobe.config import EntprobeConfig, check_offline
from entprobe.reporting.trainer_metrics import trainer_metrics
from entprobe.pipeline.geometry import Geometry
from entprobe.checkpoints.models import DTYPES, LoadedModel
from entprobe.pipeline.modes.single_batch import run_single_batch
from entprobe.pipeline.modes.two_batch import run_two_batch
from entprobe.rollouts.objectives import prepare as prepare_objective
from entprobe.reporting.tables import console_table
from entprobe.reporting.markdown import write_report
from entprobe.rollouts.coupled_uniforms import check_batch
from entprobe.rollouts.sampling import RolloutBatch
from entprobe.pipeline.lr_share import ShareSource, stage12_share
from entprobe.pipeline.stages.x_spec import x_spec
from entprobe.pipeline.stages.context import ProbeContext, resolve_buffers_device
from entprobe.tasks import Task
from entprobe.tasks.build import describe_task
from entprobe.math.estimators import functional_name
from entprobe.reporting.verdict import flags, print_verdict


@dataclass
class InMemory:
    """What a probe needs in memory: the model (with its tokenizer, device, autocast), the task
    (None: no resampling at theta_plus), the probe's context and the optimizer's geometry."""
    lm: LoadedModel
    task: Task | None
    ctx: ProbeContext
    geo: Geometry
    geo_meta: dict = field(default_factory=dict)  # lr source, Adam's step / betas / eps, ...
    sweep_share: ShareSource | None = None  # a sweep's Stage 1-2 cache for the jobs that differ only in lr
    task_meta: dict | None = None  # results' task and task_reward (None: cfg.task's, which the task was built from)


def probe_context(cfg: EntprobeConfig, model: torch.nn.Module, device: torch.device,
                  autocast_dtype: torch.dtype | None, run_model: torch.nn.Module | None = None) -> ProbeContext:
    """The probe's context over ``model``'s trainable parameters: microbatching, the weighting, where
    the parameter-sized buffers live (``probe.buffers_device``, ``auto``: ``resolve_buffers_device``).
    ``run_model``: what the forward passes call when it is not ``model`` itself (its DDP wrapper)."""
    names, params = pv.trainable(model)
    pcfg = cfg.probe
    dtype = DTYPES[pcfg.buffers_dtype.value]
    buf_dev = resolve_buffers_device(pcfg.buffers_device, params, dtype)
    return ProbeContext(run_model or model, names, params, device, autocast_dtype, cfg.sampling.temperature,
                        pcfg.weighting_mode.value, pcfg.mb_size_prompts, buf_dev, dtype,
                        progress=cfg.logging.progress and D.is_main(), nograd_memory_mb=pcfg.nograd_memory_mb,
                        x=x_spec(pcfg.weighting_mode, pcfg.x_estimator, cfg.importance.is_mode))


def probe_batches(cfg: EntprobeConfig, held: InMemory, E_all: RolloutBatch, U_all: RolloutBatch,
                  batch_source: str, run_dir: Path) -> dict:
    """The probe of the global batches E and U (``E_all is U_all``: single_batch without a ground
    truth, one batch): the objective bound to U, this rank's shards, the mode's stages, batch and
    trainer-style statistics. Returns flat results (identical on every rank), without ``flags``."""
    check_offline(cfg)
    lm, ctx, geo, pcfg = held.lm, held.ctx, held.geo, cfg.probe
    check_batch(cfg, E_all)  # coupled responses (sampling.coupling) only where nothing they bias runs
    same = E_all is U_all
    U_all, ctx.objective = prepare_objective(cfg.objective, U_all, cfg.sampling.max_new_tokens)
    E_all = U_all if same else E_all
    E, U = shard(E_all), shard(U_all)
    resample = (lambda: shard_resample(cfg, lm, held.task, E)) if held.task is not None else None

    if pcfg.mode.value == "single_batch":
        results = run_single_batch(ctx, U, geo, pcfg, cfg.importance, run_dir, resample=resample,
                                   E=E if cfg.importance.enabled else None)
    else:
        share, why_not = stage12_share(cfg, held.sweep_share, ctx, geo, E, U)
        results = run_two_batch(ctx, E, U, geo, pcfg, cfg.importance, run_dir, resample=resample, share=share)
        if why_not:
            results["stage12_share"] = f"off: {why_not}"
    for label, batch in (("E", E_all), ("U", U_all)):
        results.update(batch.stats(f"batch_{label}"))
    results.update(trainer_metrics(U_all, cfg.sampling.max_new_tokens, results.get("token_entropy_orig")))
    results.update(held.geo_meta)
    results.update(lm.meta)  # a PEFT adapter's path, base and size
    results.update(global_pass_counts(ctx.stats.flat()))  # times and memory stay this rank's
    results.update(held.task_meta or describe_task(cfg.task))  # what was probed: task, reward, objective, functional
    results.update({"model_source": lm.source, "world_size": D.world(), "batch_source": batch_source,
                    "weighting_mode": ctx.weighting_mode, "x_estimator": ctx.x.estimator,
                    "objective": ctx.objective.name, "entropy_functional": functional_name(ctx.weighting_mode),
                    "buffers_device": str(ctx.buffers_device),
                    "autocast": str(ctx.autocast_dtype).removeprefix("torch.") if ctx.autocast_dtype else "off",
                    "preconditioner": cfg.optimizer.preconditioner.value, "is_mode": cfg.importance.is_mode.value})
    return results


def global_pass_counts(stats: dict) -> dict:
    """``passes/*`` summed over ranks (then equal to a one-process run's counts)."""
    keys = sorted(set().union(*D.gather_objects({k for k in stats if k.startswith("passes/")})))
    totals = D.reduce_scalars(*[stats.get(k, 0) for k in keys])
    return {**stats, **{k: int(v) for k, v in zip(keys, totals)}}


def finish(cfg: EntprobeConfig, results: dict, run_dir: Path | None) -> None:
    """``flags`` into the results, then on the main rank: a warning for non-finite headline values,
    results.json (``logging.results_file``) and report.md (``logging.report``) in ``run_dir`` (none
    when it is None), the table (``logging.console_table``) and the verdict (``logging.verdict``)."""
    s = cfg.sampling
    fl = flags(results, cfg.importance.ess_threshold, truncated_sampling=s.top_k > 0 or s.top_p < 1)
    results["flags"] = ",".join(code for code, _ in fl)
    if not D.is_main():
        return
    for code, msg in fl:
        if code == "non_finite":  # printed whatever logging.verdict says
            warnings.warn(f"entprobe: {msg} results.json has it as NaN, flagged non_finite", stacklevel=3)
    if run_dir is not None:
        write_json_atomic(results, run_dir / cfg.logging.results_file)
    if cfg.logging.console_table:
        per_token = ("H_orig_per_token", "deltaH_true_per_token") if cfg.importance.report_per_token else ()
        console_table(results, extra_headline=per_token)
    if cfg.logging.verdict:
        print_verdict(results, fl, {k[5:-2]: v for k, v in results.items()
                                    if k.startswith("time/") and k != "time/total_s"})
    if cfg.logging.report and run_dir is not None:  # after results.json: a plot never costs the results
        write_report(results, fl, run_dir)
