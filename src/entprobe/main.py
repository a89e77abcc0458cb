"""Hydra entry point: ``python -m entprobe.main [overrides]``; ``run(cfg)`` is importable.

    python -m entprobe.main                                   # built-in default, ~1 min on 2 CPU cores
    python -m entprobe.main importance.is_mode=clip
    python -m entprobe.main model=hf model.path=/ckpt/checkpoint-500 optimizer.state_path=/ckpt/checkpoint-500
    python -m entprobe.main -m batch.B_E=8,16 optimizer.lr=1e-6,1e-5      # sweep (see sweep.py)
    launchers/torchrun.sh 2 batch.B_E=64 batch.B_U=64                        # DDP, one run dir
    python -m entprobe.main -m hydra/launcher=slurm hydra.launcher.nodes=2   # SLURM (docs/scaling.md)
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from entprobe import distributed as D
from entprobe import paramvec as pv
from entprobe import sweep
from entprobe.config import ConfigError, EntprobeConfig, register_configs, validate
from entprobe.models import DTYPES, LoadedModel, load_model
from entprobe.optim_state import load_optimizer
from entprobe.probe import Geometry, run_two_batch
from entprobe.report import WandbLogger, console_table, write_json_atomic
from entprobe.rollout import RolloutBatch, draw_prompt_indices, sample_batch
from entprobe.stages.context import ProbeContext, resolve_buffers_device
from entprobe.tasks import Task, build_task
from entprobe.verdict import flags, print_verdict

register_configs()


def to_typed(cfg: DictConfig) -> EntprobeConfig:
    """Merge onto the schema (rejects unknown keys / bad choices) and return the typed object."""
    if not isinstance(cfg, DictConfig):
        validate(cfg)
        return cfg
    schema = OmegaConf.structured(EntprobeConfig)
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    merged = OmegaConf.merge(schema, plain)
    obj = OmegaConf.to_object(merged)
    validate(obj)
    return obj


def build_geometry(cfg: EntprobeConfig, lm, params, buf_dev: torch.device) -> tuple[Geometry, dict]:
    """The optimizer to step with, the lr, and Adam's preconditioner P (or identity) on ``buf_dev``."""
    o = cfg.optimizer
    path = o.state_path or (lm.checkpoint_dir if cfg.model.source.value == "builtin" else None)
    if path is None and lm.checkpoint_dir and (Path(lm.checkpoint_dir) / "optimizer.pt").is_file():
        path = lm.checkpoint_dir
    buf_dtype = DTYPES[cfg.probe_rework.buffers_dtype.value]
    if path is None:
        if o.preconditioner.value == "adam":
            raise ConfigError(
                "no optimizer state: set optimizer.state_path=<optimizer.pt or a Trainer checkpoint "
                "folder> for Adam geometry, or optimizer.preconditioner=identity optimizer.lr=<lr> "
                "to probe in plain SGD geometry")
        if o.lr is None:
            raise ConfigError("optimizer.lr is required with optimizer.preconditioner=identity and no state")
        return Geometry(torch.optim.SGD(params, lr=o.lr), o.lr, None), {"lr_source": "optimizer.lr (config)"}
    lo = load_optimizer(lm.model, path, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                        step=o.step)
    P = None
    if o.preconditioner.value == "adam":
        P = pv.adam_preconditioner(lo.exp_avg_sq, lo.step, lo.betas[1], lo.eps, buf_dev, buf_dtype)
    meta = {"lr_source": lo.lr_source, "adam_step": lo.step, "adam_beta1": lo.betas[0],
            "adam_beta2": lo.betas[1], "adam_eps": lo.eps, "optimizer_path": lo.path}
    return Geometry(lo.optimizer, lo.lr, P), meta


def get_batches(cfg: EntprobeConfig, lm, task, ctx: ProbeContext, cache: Path | None = None
                ) -> tuple[RolloutBatch, RolloutBatch, str]:
    """The global E and U, and where they came from: ``batch.load``, else the sweep's batch cache
    (``cache``, a folder), else fresh samples (written to ``batch.save`` and the cache by rank 0).

    Under DDP each rank samples only its own prompts (seeds offset by rank, see ``rank_seed``);
    the shares are gathered and padded into the global batch, so what is saved is the global
    batch and a run on saved batches gives the same numbers at any world size. Each rank then
    computes on ``shard(batch)``; the token batches are small, every rank holds them whole."""
    b = cfg.batch
    lock = sweep.locked(cache) if cache is not None and D.is_main() else contextlib.nullcontext()
    with lock:  # parallel sweep jobs: one samples, the others wait here and load
        hit = D.broadcast_object(cache is not None and sweep.cache_complete(cache))
        src = Path(b.load) if b.load else (cache if hit else None)
        if src is not None:
            E, U = RolloutBatch.load(src / "E.pt"), RolloutBatch.load(src / "U.pt")
            if E.G != b.G or U.G != b.G:
                raise ConfigError(f"batch.load={src}: saved batches have G={E.G}, config says batch.G={b.G}")
            source = "load" if b.load else "cache"
        else:
            E, U = sample_global(cfg, lm, task, ctx)
            if D.is_main():
                for folder in (b.save, cache):
                    if folder:
                        E.save(Path(folder) / "E.pt")
                        U.save(Path(folder) / "U.pt")
            source = "sampled"
    return E, U, source


def rank_seed(seed: int) -> int:
    """Sampling seed of this rank's share of a batch (rank 0 and single-process runs: ``seed``)."""
    return int(seed) + 1_000_003 * D.rank()


def sample_global(cfg: EntprobeConfig, lm, task, ctx: ProbeContext) -> tuple[RolloutBatch, RolloutBatch]:
    """E and U as global batches; each rank samples the contiguous share ``shard`` will give it."""
    b, s = cfg.batch, cfg.sampling

    def draw(B, seed, label):
        if B < D.world():
            raise ConfigError(f"batch.B_{label}={B} prompts cannot be split over {D.world()} ranks")
        idx = draw_prompt_indices(len(task.prompts), B, seed).tensor_split(D.world())[D.rank()]
        with ctx.phase(f"sample_{label}"):
            mine = sample_batch(lm.model, lm.tokenizer, task, idx, b.G, s, rank_seed(seed), b.advantage.value,
                                b.adv_eps, cfg.task.chat_template.value, cfg.task.system_prompt)
        return concat_batches(D.gather_objects(mine), lm.tokenizer.pad_token_id) if D.is_dist() else mine

    # single_batch measures its step on a fresh E too (responses the step was not fit to)
    need_E = cfg.probe_rework.mode.value == "two_batch" or cfg.importance.enabled
    E = draw(b.B_E, b.seed_E, "E") if need_E else None
    U = draw(b.B_U, b.seed_U, "U")
    return (E if E is not None else U), U


def concat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from shares of different widths, in the layout ``sample_batch`` writes: prompts
    left-padded to the widest prompt block, responses right-padded to the longest response."""
    def prompt_width(x: RolloutBatch) -> int:
        cols = x.response_mask.flatten(0, 1).any(0).nonzero()
        return int(cols[0]) if cols.numel() else x.input_ids.shape[-1] - 1
    Ps = [prompt_width(x) for x in parts]
    Rs = [x.input_ids.shape[-1] - p for x, p in zip(parts, Ps)]
    P, R = max(Ps), max(Rs)
    kw = {}
    for f in dataclasses.fields(RolloutBatch):
        vals = [getattr(x, f.name) for x in parts]
        if not isinstance(vals[0], torch.Tensor):
            kw[f.name] = vals[0]
        elif vals[0].dim() == 3:  # [B, G, T]: pad columns (ids with the pad token, masks/log-probs 0)
            fill = pad_id if f.name == "input_ids" else 0
            kw[f.name] = torch.cat([torch.nn.functional.pad(v, (P - p, R - r), value=fill)
                                    for v, p, r in zip(vals, Ps, Rs)])
        else:
            kw[f.name] = torch.cat(vals)
    return RolloutBatch(**kw)


def shard(batch: RolloutBatch) -> RolloutBatch:
    """This rank's contiguous slice of prompts (identity at world size 1)."""
    if D.world() == 1:
        return batch
    if batch.B < D.world():
        raise ConfigError(f"{batch.B} prompts cannot be split over {D.world()} ranks")
    chunks = torch.arange(batch.B).tensor_split(D.world())
    return batch.select(chunks[D.rank()])


def load_probe(cfg: EntprobeConfig) -> tuple[LoadedModel, Task, ProbeContext]:
    """The model (DDP-wrapped in the context when a process group exists), the task, and the
    probe's context: trainable parameters, microbatching, where the buffers live (``auto``:
    ``resolve_buffers_device``)."""
    lm = load_model(cfg.model)
    task = build_task(OmegaConf.structured(cfg.task))
    names, params = pv.trainable(lm.model)
    pcfg = cfg.probe_rework
    dtype = DTYPES[pcfg.buffers_dtype.value]
    buf_dev = resolve_buffers_device(pcfg.buffers_device, params, dtype)
    model = D.wrap(lm.model, lm.device, cfg.ddp.find_unused_parameters)  # DDP under torchrun / SLURM
    ctx = ProbeContext(model, names, params, lm.device, lm.autocast_dtype, cfg.sampling.temperature,
                       pcfg.weighting_mode.value, pcfg.mb_size_prompts, buf_dev, dtype,
                       progress=cfg.logging.progress and D.is_main(), nograd_memory_mb=pcfg.nograd_memory_mb)
    return lm, task, ctx


def run(cfg, batch_cache: str | Path | None = None) -> dict:
    """The whole job: load -> sample -> probe -> write results. Returns flat results (identical on
    every rank; only rank 0 writes). ``batch_cache``: a folder shared by the jobs of a sweep."""
    t0 = time.perf_counter()
    cfg = to_typed(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    D.init_from_env(cfg.ddp.backend, cfg.ddp.timeout_s, str(cfg.model.device))
    torch.manual_seed(cfg.seed)
    lm, task, ctx = load_probe(cfg)
    pcfg = cfg.probe_rework
    geo, meta = build_geometry(cfg, lm, ctx.params, ctx.buffers_device)
    E_all, U_all, batch_source = get_batches(cfg, lm, task, ctx, Path(batch_cache) if batch_cache else None)
    E, U = shard(E_all), shard(U_all)

    def resample() -> RolloutBatch:
        return shard_resample(cfg, lm, task, E)

    if pcfg.mode.value == "single_batch":
        from entprobe.stages.ustat import run_single_batch
        results = run_single_batch(ctx, U, geo, pcfg, cfg.importance, run_dir, resample=resample,
                                   E=E if cfg.importance.enabled else None)
    else:
        results = run_two_batch(ctx, E, U, geo, pcfg, cfg.importance, run_dir, resample=resample)
    for label, batch in (("E", E_all), ("U", U_all)):
        results.update(batch.stats(f"batch_{label}"))
    results.update(meta)
    results.update(global_pass_counts(ctx.stats.flat()))  # times and memory stay this rank's
    results.update({"model_source": lm.source, "world_size": D.world(), "batch_source": batch_source,
                    "weighting_mode": ctx.weighting_mode, "buffers_device": str(ctx.buffers_device),
                    "preconditioner": cfg.optimizer.preconditioner.value, "is_mode": cfg.importance.is_mode.value,
                    "time/total_s": time.perf_counter() - t0})
    s = cfg.sampling
    fl = flags(results, cfg.importance.ess_threshold, truncated_sampling=s.top_k > 0 or s.top_p < 1)
    results["flags"] = ",".join(code for code, _ in fl)
    if D.is_main():
        write_json_atomic(results, run_dir / cfg.logging.results_file)
        if cfg.logging.console_table:
            per_token = ("H_orig_per_token", "deltaH_true_per_token") if cfg.importance.report_per_token else ()
            console_table(results, extra_headline=per_token)
        if cfg.logging.verdict:
            print_verdict(results, fl, {k[5:-2]: v for k, v in results.items()
                                        if k.startswith("time/") and k != "time/total_s"})
    return results


def global_pass_counts(stats: dict) -> dict:
    """``passes/*`` summed over ranks (then equal to a one-process run's counts)."""
    keys = sorted(set().union(*D.gather_objects({k for k in stats if k.startswith("passes/")})))
    totals = D.reduce_scalars(*[stats.get(k, 0) for k in keys])
    return {**stats, **{k: int(v) for k, v in zip(keys, totals)}}


def shard_resample(cfg: EntprobeConfig, lm, task, E: RolloutBatch) -> RolloutBatch:
    """Fresh responses for this rank's E prompts at the current (updated) parameters."""
    b = cfg.batch
    return sample_batch(lm.model, lm.tokenizer, task, E.prompt_index, b.G, cfg.sampling,
                        rank_seed(b.seed_E + 1_000_003), b.advantage.value, b.adv_eps,
                        cfg.task.chat_template.value, cfg.task.system_prompt)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Process group first (rank decides who logs), then one run dir for all ranks (rank 0's),
    the sweep's batch cache in multirun mode, wandb on rank 0, ``run``, teardown."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    D.init_from_env(cfg.ddp.backend, cfg.ddp.timeout_s, str(cfg.model.device))
    logger, ok = None, False
    try:
        hydra_files = {hc.output_subdir or ".hydra", f"{hc.job.name}.log"}
        run_dir = D.shared_run_dir(hc.runtime.output_dir, hydra_files)
        with_dir = OmegaConf.to_container(cfg, resolve=True)
        with_dir["run_dir"] = str(run_dir)
        typed = to_typed(OmegaConf.create(with_dir))
        cache = None
        if hc.mode == RunMode.MULTIRUN and not typed.batch.load:
            sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir  # absolute, also with hydra.job.chdir
            cache = D.broadcast_object(str(sweep.batch_cache_dir(sweep_dir, typed, D.world())))
        w = typed.logging.wandb
        logger = WandbLogger(w.mode, w.project, run_dir, with_dir, D.is_main(), w.entity, w.name, w.tags)
        results = run(typed, batch_cache=cache)
        logger.log(results)
        ok = True
        return results.get("deltaH1")
    finally:
        if logger is not None:
            logger.finish(0 if ok else 1)
        D.shutdown(ok)


if __name__ == "__main__":
    main()
