"""Hydra entry point: ``python -m entprobe.main [overrides]``; ``run(cfg)`` is importable.

    python -m entprobe.main                                   # built-in default, ~1 min on 2 CPU cores
    python -m entprobe.main importance.is_mode=clip
    python -m entprobe.main model=hf model.path=/ckpt/checkpoint-500 optimizer.state_path=/ckpt/checkpoint-500
    python -m entprobe.main -m batch.B_E=8,16 optimizer.lr=1e-6,1e-5      # sweep
    torchrun --nproc_per_node 2 -m entprobe.main                             # distributed
"""
from __future__ import annotations

import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from entprobe import distributed as D
from entprobe import paramvec as pv
from entprobe.config import ConfigError, EntprobeConfig, register_configs, validate
from entprobe.models import DTYPES, load_model
from entprobe.optim_state import load_optimizer
from entprobe.probe import Geometry, run_two_batch
from entprobe.report import WandbLogger, console_table, write_json_atomic
from entprobe.rollout import RolloutBatch, draw_prompt_indices, sample_batch
from entprobe.stages.context import ProbeContext
from entprobe.tasks import build_task

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


def build_geometry(cfg: EntprobeConfig, lm, params) -> tuple[Geometry, dict]:
    """The optimizer to step with, the lr, and Adam's preconditioner P (or identity)."""
    o = cfg.optimizer
    path = o.state_path or (lm.checkpoint_dir if cfg.model.source.value == "builtin" else None)
    if path is None and lm.checkpoint_dir and (Path(lm.checkpoint_dir) / "optimizer.pt").is_file():
        path = lm.checkpoint_dir
    buf_dev = pv.resolve_device(cfg.probe_rework.buffers_device, params)
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


def get_batches(cfg: EntprobeConfig, lm, task, ctx: ProbeContext) -> tuple[RolloutBatch, RolloutBatch]:
    """Load saved E/U batches or sample them; each rank keeps its contiguous share of prompts."""
    b, s = cfg.batch, cfg.sampling
    load = Path(b.load) if b.load else None
    if load is not None:
        E, U = RolloutBatch.load(load / "E.pt"), RolloutBatch.load(load / "U.pt")
        if E.G != b.G or U.G != b.G:
            raise ConfigError(f"batch.load={load}: saved batches have G={E.G}, config says batch.G={b.G}")
    else:
        def draw(B, seed, label):
            idx = draw_prompt_indices(len(task.prompts), B, seed)
            with ctx.phase(f"sample_{label}"):
                return sample_batch(lm.model, lm.tokenizer, task, idx, b.G, s, seed, b.advantage.value,
                                    b.adv_eps, cfg.task.chat_template.value, cfg.task.system_prompt)
        E = draw(b.B_E, b.seed_E, "E") if cfg.probe_rework.mode.value == "two_batch" else None
        U = draw(b.B_U, b.seed_U, "U")
        if E is None:
            E = U
        if b.save and D.is_main():
            Path(b.save).mkdir(parents=True, exist_ok=True)
            E.save(Path(b.save) / "E.pt")
            U.save(Path(b.save) / "U.pt")
    return shard(E), shard(U)


def shard(batch: RolloutBatch) -> RolloutBatch:
    """This rank's contiguous slice of prompts (identity at world size 1)."""
    if D.world() == 1:
        return batch
    if batch.B < D.world():
        raise ConfigError(f"{batch.B} prompts cannot be split over {D.world()} ranks")
    chunks = torch.arange(batch.B).tensor_split(D.world())
    return batch.select(chunks[D.rank()])


def run(cfg) -> dict:
    """The whole job: load -> sample -> probe -> write results. Returns flat results."""
    t0 = time.perf_counter()
    cfg = to_typed(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    D.init_from_env(cfg.ddp.backend, cfg.ddp.timeout_s)
    torch.manual_seed(cfg.seed)
    lm = load_model(cfg.model)
    task = build_task(OmegaConf.structured(cfg.task))
    names, params = pv.trainable(lm.model)
    geo, meta = build_geometry(cfg, lm, params)
    model = lm.model
    if D.is_dist():
        model = torch.nn.parallel.DistributedDataParallel(
            lm.model, find_unused_parameters=cfg.ddp.find_unused_parameters,
            device_ids=[lm.device.index] if lm.device.type == "cuda" else None)
    pcfg = cfg.probe_rework
    ctx = ProbeContext(model, names, params, lm.device, lm.autocast_dtype, cfg.sampling.temperature,
                       pcfg.weighting_mode.value, pcfg.mb_size_prompts,
                       pv.resolve_device(pcfg.buffers_device, params), DTYPES[pcfg.buffers_dtype.value],
                       progress=cfg.logging.progress and D.is_main())
    E, U = get_batches(cfg, lm, task, ctx)

    def resample() -> RolloutBatch:
        return shard_resample(cfg, lm, task, E)

    if pcfg.mode.value == "single_batch":
        from entprobe.stages.ustat import run_single_batch
        results = run_single_batch(ctx, U, geo, pcfg, cfg.importance, run_dir, resample=resample)
    else:
        results = run_two_batch(ctx, E, U, geo, pcfg, cfg.importance, run_dir, resample=resample)
    for label, batch in (("E", E), ("U", U)):
        results.update(batch.stats(f"batch_{label}"))
    results.update(meta)
    results.update(ctx.stats.flat())
    results.update({"model_source": lm.source, "world_size": D.world(), "weighting_mode": ctx.weighting_mode,
                    "preconditioner": cfg.optimizer.preconditioner.value, "is_mode": cfg.importance.is_mode.value,
                    "time/total_s": time.perf_counter() - t0})
    if D.is_main():
        write_json_atomic(results, run_dir / cfg.logging.results_file)
        if cfg.logging.console_table:
            console_table(results)
    return results


def shard_resample(cfg: EntprobeConfig, lm, task, E: RolloutBatch) -> RolloutBatch:
    """Fresh responses for this rank's E prompts at the current (updated) parameters."""
    b = cfg.batch
    return sample_batch(lm.model, lm.tokenizer, task, E.prompt_index, b.G, cfg.sampling,
                        b.seed_E + 1_000_003, b.advantage.value, b.adv_eps, cfg.task.chat_template.value,
                        cfg.task.system_prompt)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    with_dir = OmegaConf.to_container(cfg, resolve=True)
    with_dir["run_dir"] = HydraConfig.get().runtime.output_dir
    typed = to_typed(OmegaConf.create(with_dir))
    w = typed.logging.wandb
    logger = WandbLogger(w.mode, w.project, Path(typed.run_dir), with_dir, D.is_main(), w.entity, w.name, w.tags)
    code = 1
    try:
        results = run(typed)
        logger.log(results)
        code = 0
        return results.get("deltaH1")
    finally:
        logger.finish(code)
        D.shutdown()


if __name__ == "__main__":
    main()
