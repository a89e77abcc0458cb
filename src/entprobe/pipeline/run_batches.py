"""E and U as global batches: loaded, taken from a sweep's cache, or sampled (each rank its own
prompts under DDP, gathered and padded into the global batch); each rank's shard of them."""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from entprobe.runtime import distributed as D
from entprobe.runtime import sharding
from entprobe.reporting import sweep
from entprobe.rollouts.saved_batches import check_saved, check_tokens, fingerprint, load_batches, save_batches
from entprobe.config import ConfigError, EntprobeConfig
from entprobe.runtime.locks import file_lock
from entprobe.checkpoints.preflight import CheckedInputs
from entprobe.tasks.prompt_ids import prompt_kwargs
from entprobe.rollouts.coupled_uniforms import coupling_spec
from entprobe.rollouts.sampling import RolloutBatch, draw_prompt_indices, sample_batch
from entprobe.pipeline.stages.context import ProbeContext


def get_batches(cfg: EntprobeConfig, lm, task, ctx: ProbeContext, inputs: CheckedInputs,
                cache: Path | None = None) -> tuple[RolloutBatch, RolloutBatch, str]:
    """The global E and U, and where they came from: ``batch.load`` (read and checked by the
    preflight, ``inputs.loaded``), else the sweep's batch cache (``cache``, a folder), else fresh
    samples (written with their fingerprint to ``batch.save`` and the cache by rank 0).

    Under DDP each rank samples only its own prompts (seeds offset by rank, see ``rank_seed``);
    the shares are gathered and padded into the global batch, so what is saved is the global
    batch and a run on saved batches gives the same numbers at any world size. Each rank then
    computes on ``shard(batch)``; the token batches are small, every rank holds them whole."""
    b = cfg.batch
    if inputs.loaded is not None:
        E, U, _ = inputs.loaded
        check_tokens(Path(b.load), E, U, vocab_size(lm.model))
        return E, U, "load"
    meta = fingerprint(cfg, inputs.identity)
    lock = (file_lock(Path(str(cache) + ".lock"), b.lock_timeout_s, f"sweep batch cache {cache}")
            if cache is not None and D.is_main() else contextlib.nullcontext())
    with lock:  # parallel sweep jobs: one samples, the others wait here and load
        hit = D.broadcast_object(cache is not None and sweep.cache_complete(cache))
        if hit:
            E, U, saved = load_batches(cache, b.lock_timeout_s, key="the sweep's batch cache")
            check_saved(cache, E, U, saved, cfg, inputs.identity)
            check_tokens(cache, E, U, vocab_size(lm.model))
            return E, U, "cache"
        E, U = sample_global(cfg, lm, task, ctx)
        if D.is_main():
            for folder, key in ((b.save, "batch.save"), (cache, "the sweep's batch cache")):
                if folder:
                    save_batches(folder, E, U, meta, b.lock_timeout_s, key)
    return E, U, "sampled"


def vocab_size(model) -> int | None:
    """How many token ids the model embeds (its input embeddings' rows; else ``config.vocab_size``)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    return int(n) if n is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def rank_seed(seed: int) -> int:
    """Sampling seed of this rank's share of a batch (rank 0 and single-process runs: ``seed``)."""
    return int(seed) + 1_000_003 * D.rank()


def sample_global(cfg: EntprobeConfig, lm, task, ctx: ProbeContext) -> tuple[RolloutBatch, RolloutBatch]:
    """E and U as global batches; each rank samples the contiguous share ``shard`` will give it.
    Under FSDP2 (``sharding.sharded``) every rank samples the whole batch with the run's own seeds
    (the draws of a one-process run), stopping together, and takes rank 0's."""
    b, s = cfg.batch, cfg.sampling

    def bar(label: str) -> str | None:  # one bar, on the main rank: tokens per second while sampling
        return f"sample {label}" if cfg.logging.progress and D.is_main() else None

    def draw(B, seed, label):
        if B < D.world():
            raise ConfigError(f"batch.B_{label}={B} prompts cannot be split over {D.world()} ranks")
        if sharding.sharded():  # every forward all-gathers: all ranks sample the whole batch in step
            idx = draw_prompt_indices(len(task.prompts), B, seed)
            with ctx.phase(f"sample_{label}"):
                whole = sample_batch(lm.model, lm.tokenizer, task, idx, b.G, s, seed, b.advantage.value, b.adv_eps,
                                     stop_together=True, progress=bar(label), coupling=coupling_spec(s, b.G, label),
                                     **prompt_kwargs(cfg, lm.source))
            return D.broadcast_object(whole)  # rank 0's draws on every rank, whatever the rounding
        idx = draw_prompt_indices(len(task.prompts), B, seed).tensor_split(D.world())[D.rank()]
        with ctx.phase(f"sample_{label}"):
            mine = sample_batch(lm.model, lm.tokenizer, task, idx, b.G, s, rank_seed(seed), b.advantage.value,
                                b.adv_eps, progress=bar(label), coupling=coupling_spec(s, b.G, label),
                                **prompt_kwargs(cfg, lm.source))
        return concat_batches(D.gather_objects(mine), lm.tokenizer.pad_token_id) if D.is_dist() else mine

    # single_batch measures its step on a fresh E too (responses the step was not fit to)
    need_E = cfg.probe.mode.value == "two_batch" or cfg.importance.enabled
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


def shard_resample(cfg: EntprobeConfig, lm, task, E: RolloutBatch) -> RolloutBatch:
    """Fresh responses for this rank's E prompts at the current (updated) parameters."""
    b = cfg.batch
    return sample_batch(lm.model, lm.tokenizer, task, E.prompt_index, b.G, cfg.sampling,
                        rank_seed(b.seed_E + 1_000_003), b.advantage.value, b.adv_eps,
                        progress="resample E" if cfg.logging.progress and D.is_main() else None,
                        **prompt_kwargs(cfg, lm.source))
