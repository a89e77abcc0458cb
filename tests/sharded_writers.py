"""FSDP2 training on gloo CPU ranks whose optimizer is saved the way each trainer saves it.

``write_checkpoints(rank, world, port, out)`` (started by ``ddp_launch.launch_fresh``) shards the
built-in tiny Llama with ``fully_shard`` (each decoder layer, then the root), takes 3 AdamW steps
in HF Trainer's decay / no-decay groups with a decaying LambdaLR, and writes, from the same state:

- ``dcp/``: ``torch.distributed.checkpoint.save`` of ``get_optimizer_state_dict`` (torch itself);
- ``accelerate/``: accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (what
  ``Accelerator.save_state`` calls under FSDP2: ``pytorch_model_fsdp_0/``, ``optimizer_0/``) and the
  scheduler as ``scheduler.bin``. accelerate turns FSDP on only for accelerator devices (on CPU
  ``Accelerator`` falls back to DDP), so its save functions are called directly on the
  ``fully_shard``-ed model;
- ``verl/global_step_3/actor/`` (a second run with verl's single param group over
  ``module.parameters()``; ``verl/reference_optimizer.pt`` its plain state): verl's ``FSDPCheckpointManager.save_checkpoint`` layout, written
  here by transcribing its save code (verl does not import here): per rank ``torch.save`` of
  ``model.state_dict()``, ``optimizer.state_dict()`` and ``{"lr_scheduler", "rng"}``, then on rank 0
  ``fsdp_config.json`` and ``huggingface/`` (config, tokenizer and the full weights);
- ``reference/``: the plain HF Trainer checkpoint of the first run's state (full weights, an
  ``optimizer.pt`` indexed in the Trainer's group order, ``scheduler.pt``): what every sharded
  format must read back to.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

BETAS, EPS, WD, STEPS = (0.9, 0.95), 1e-6, 0.1, 3


def lr_at(step: int) -> float:
    return 1.0 - step / 10  # LambdaLR factor: 1e-3, 9e-4, 8e-4, then 7e-4 for the next step


def write_checkpoints(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from accelerate import PartialState

    state = PartialState(cpu=True)  # initialises the gloo group (accelerate's logging needs its state)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Trainer

    from entprobe.checkpoints.builtin import build_char_tokenizer, build_tiny_llama

    out = Path(out)
    tok = build_char_tokenizer()
    mesh = init_device_mesh("cpu", (world,))

    def train(trainer_groups: bool):
        """3 steps of the sharded model: HF Trainer's two groups, or verl's one over parameters()."""
        model = build_tiny_llama(len(tok), seed=0)
        names = [n for n, _ in model.named_parameters()]
        decay = set(Trainer.get_decay_parameter_names(None, model))
        groups = [[n for n in names if n in decay], [n for n in names if n not in decay]] if trainer_groups \
            else [names]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        by = dict(model.named_parameters())
        opt = torch.optim.AdamW([{"params": [by[n] for n in g], "weight_decay": wd} for g, wd in zip(groups, (WD, 0.0))],
                                lr=1e-3, betas=BETAS, eps=EPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            ids = torch.randint(3, len(tok), (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        return model, opt, sched, groups

    def write_reference(folder: Path, model, opt, sched, groups) -> None:
        """Full weights, optimizer.pt indexed by position in the groups (HF Trainer's layout), scheduler.pt."""
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=full)
        optim_full = get_optimizer_state_dict(model, opt, options=full)
        if rank == 0:
            plain = build_tiny_llama(len(tok), seed=0)
            plain.load_state_dict(weights)
            plain.save_pretrained(folder)
            tok.save_pretrained(folder)
            order = [n for g in groups for n in g]
            ref = {"state": {i: optim_full["state"][n] for i, n in enumerate(order)},
                   "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [order.index(n) for n in g["params"]]}
                                    for g in optim_full["param_groups"]]}
            torch.save(ref, folder / "optimizer.pt")
            torch.save(sched.state_dict(), folder / "scheduler.pt")

    model, opt, sched, groups = train(trainer_groups=True)
    write_reference(out / "reference", model, opt, sched, groups)
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=str(out / "dcp"))

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, state, model, str(out / "accelerate"))
    save_fsdp_optimizer(plugin, state, opt, model, str(out / "accelerate"))

    if rank == 0:
        (out / "accelerate" / "scheduler.bin").write_bytes(_saved(sched.state_dict()))

    model, opt, sched, groups = train(trainer_groups=False)  # verl: build_optimizer(module.parameters())
    actor = out / "verl" / "global_step_3" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), actor / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), actor / f"optim_world_size_{world}_rank_{rank}.pt")
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    torch.save({"lr_scheduler": sched.state_dict(), "rng": rng}, actor / f"extra_state_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
    write_reference(actor / "huggingface", model, opt, sched, groups)  # verl's hf_model save: config, tokenizer,
    if rank == 0:  # full weights; the optimizer.pt beside them is the reference for this run
        (actor / "huggingface" / "optimizer.pt").rename(out / "verl" / "reference_optimizer.pt")
        (actor / "huggingface" / "scheduler.pt").unlink()
    dist.barrier()
    dist.destroy_process_group()


def _saved(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
