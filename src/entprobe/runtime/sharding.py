"""FSDP2 (``ddp.strategy=fsdp2``): the model's parameters, their gradients, the optimizer state and
every parameter-sized probe buffer are sharded over the ranks along dim 0, like
``torch.distributed.fsdp.fully_shard`` shards the parameters (DTensor ``Shard(0)``).

The probe's buffers hold each rank's *local shard* as a plain tensor (``local``), so elementwise
math (P, Delta theta, J x) needs no communication; a dot product is the local dot plus one
all-reduce of its scalar(s) (``reduce_shards``). Outside FSDP2 every function here is the identity.

Collective passes: under FSDP2 every forward and backward is collective (parameters are
all-gathered per layer, gradients reduce-scattered), so all ranks run the same number of passes.
A rank with fewer microbatches runs filler passes (``FILLER``) whose sequence log-probs are
multiplied by 0: their gradient is exactly zero and their outputs are dropped. The reduce-scatter
sums (divide factor 1): after a backward each rank's ``.grad`` shard is its shard of the gradient
summed over all ranks' prompts. ``torch.nn.utils.clip_grad_norm_`` (``importance.max_grad_norm``)
on these DTensor gradients takes the norm of the whole gradient, over every rank's shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

_MESH = None  # the 1-D device mesh of the sharded model; None: not sharded


def sharded() -> bool:
    """True once ``shard_model`` has sharded the probe's model over more than one rank."""
    return _MESH is not None


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``fully_shard`` every decoder layer (HF ``model.model.layers``) and then the root (which
    holds the embeddings, the final norm and a tied or untied LM head), gradients reduced by sum.
    Returns the same module, now an FSDP module whose parameters are DTensors."""
    global _MESH
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad][:3]
    if frozen:
        raise ValueError(f"ddp.strategy=fsdp2 shards fully trainable models; {frozen} are frozen (a PEFT "
                         "adapter?): use ddp.strategy=ddp")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # .grad = the sum over ranks, not the mean
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    _MESH = mesh
    return model


def unshard_state() -> None:
    """Forget the sharded model (the next run in this process starts unsharded)."""
    global _MESH
    _MESH = None


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like_param(p: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    """``local_value`` (this rank's shard) as a tensor laid out like parameter ``p``: a DTensor with
    p's mesh and placements when p is one, else ``local_value`` itself."""
    if not is_dtensor(p):
        return local_value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local_value, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def reduce_shards(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` (per-shard partial dots) over the shards' ranks in place; identity unsharded."""
    if _MESH is None:
        return t
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        tmp = t.cuda()
        dist.all_reduce(tmp)
        return t.copy_(tmp)
    dist.all_reduce(t)
    return t


def shard_optimizer_state_(optimizer: torch.optim.Optimizer) -> None:
    """Keep each rank's shard of every parameter-shaped optimizer state tensor (a full-size state,
    read name-keyed from a checkpoint, becomes a DTensor laid out like its parameter; no
    communication: every rank holds the full tensor and keeps its own chunk)."""
    if _MESH is None:
        return
    from torch.distributed.tensor import distribute_tensor

    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            for k, v in list(st.items()):
                if is_dtensor(p) and isinstance(v, torch.Tensor) and not is_dtensor(v) and v.shape == p.shape:
                    st[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def max_over_ranks(n: int) -> int:
    """The largest ``n`` of any rank (the number of collective passes everyone runs)."""
    if _MESH is None:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# on in the default config, not possible under FSDP2: (key, the value that turns it off, why)
OFF_UNDER_FSDP2 = (("importance.resample_on_low_ess", False,
                    "resampling E at the updated parameters is not sharded"),)


def defaults_to_turn_off(cfg, explicit: set[str]) -> list[tuple[str, object, str]]:
    """The ``OFF_UNDER_FSDP2`` settings that are on under ``ddp.strategy=fsdp2`` without the user
    having set them (``explicit``: the keys they gave): turned off with a notice, where a setting
    the user asked for is refused (``config_errors``)."""
    if str(getattr(cfg.ddp.strategy, "value", cfg.ddp.strategy)) != "fsdp2":
        return []
    return [(key, off, why) for key, off, why in OFF_UNDER_FSDP2
            if key not in explicit and OmegaConf.select(cfg, key) != off]


def config_errors(cfg) -> list[tuple[str, str]]:
    """(key, message) for each setting that cannot run under ``ddp.strategy=fsdp2``, each naming
    what to use instead; checked with the config, before anything loads."""
    if getattr(cfg.ddp.strategy, "value", cfg.ddp.strategy) != "fsdp2":
        return []
    p, i = cfg.probe, cfg.importance
    out = []
    if getattr(p.mode, "value", p.mode) != "two_batch":
        out.append(("probe.mode", "single_batch keeps two per-unit gradients at once, which ddp.strategy=fsdp2 "
                                  "does not shard: use probe.mode=two_batch, or ddp.strategy=ddp"))
    proj = getattr(p.projection, "value", p.projection)
    if proj not in ("auto", "backward"):
        out.append(("probe.projection", f"{proj} keeps or forward-differentiates per-unit gradients, which "
                                        "ddp.strategy=fsdp2 does not shard: use probe.projection=backward "
                                        "(auto resolves to it under fsdp2), or ddp.strategy=ddp"))
    if i.enabled and i.resample_on_low_ess:
        out.append(("importance.resample_on_low_ess", "resampling generates, which ddp.strategy=fsdp2 does "
                                                      "not shard: set importance.resample_on_low_ess=false"))
    if p.save_buffers:
        out.append(("probe.save_buffers", "each rank holds only its shard of the buffers under "
                                          "ddp.strategy=fsdp2: set probe.save_buffers=false, or use ddp.strategy=ddp"))
    return out
