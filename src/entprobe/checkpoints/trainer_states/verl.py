"""verl FSDP checkpoints: ``global_step_N/actor/`` as verl's ``FSDPCheckpointManager`` writes it.

Per rank R of a world of W, each file a plain ``torch.save``:

- ``model_world_size_W_rank_R.pt``: ``model.state_dict()`` -- the parameter names, each value the
  rank's shard (FSDP2: a ``DTensor`` sharded on dim 0);
- ``optim_world_size_W_rank_R.pt``: ``optimizer.state_dict()`` -- state indexed by position in
  ``module.parameters()`` (verl builds one param group over all of them), each moment the rank's
  ``DTensor`` shard of the parameter;
- ``extra_state_world_size_W_rank_R.pt``: ``{"lr_scheduler": state_dict, "rng": ...}``;
- ``fsdp_config.json`` (``FSDP_version``, ``world_size``) and ``huggingface/`` (config, tokenizer
  and, when ``hf_model`` is among the saved contents, the full weights).

Positions are turned into names through the model file (its keys in order, tied duplicates once:
the order ``parameters()`` yields) and every moment's global shape is checked against the
parameter's there, so the state is name-keyed before it meets the model. The rank shards are
concatenated on dim 0 (``torch.chunk`` layout) into whole tensors. DTensors load with
``weights_only=True`` once ``torch.distributed.tensor`` is imported; no process group is needed.
FSDP1 checkpoints (``FSDP_version`` 1) hold flattened ``FlatParameter`` shards whose layout the
files do not record; they are refused with what to do.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from entprobe.runtime.input_files import load_json_file, load_torch_file
from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.trainer_states.named import MOMENTS, NamedAdamState, adam_group, step_tensor

_OPTIM = re.compile(r"^optim_world_size_(\d+)_rank_(\d+)\.pt$")
MERGE = "python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir {actor}/huggingface"


def find_verl_folder(path: Path) -> Path | None:
    """The folder with verl's ``optim_world_size_*`` files: ``path`` or its ``actor/``."""
    for folder in (path, path / "actor"):
        if folder.is_dir() and any(_OPTIM.match(p.name) for p in folder.iterdir()):
            return folder
    return None


def rank_files(folder: Path) -> int:
    """The world size the files were written with; every rank's optimizer file and rank 0's model
    file (the names) there."""
    sizes = sorted({int(m.group(1)) for p in folder.iterdir() if (m := _OPTIM.match(p.name))})
    if len(sizes) > 1:
        raise OptimizerStateError(f"{folder}: optimizer files of world sizes {sizes} (optim_world_size_W_rank_R.pt); "
                                  "one save's files only: remove those of the other run")
    world = sizes[0]
    cfg_file = folder / "fsdp_config.json"
    if cfg_file.is_file():
        cfg = load_json_file(cfg_file, "verl's FSDP config", "copy the checkpoint again (every file of one save)")
        if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k, 0), int) for k in ("world_size", "FSDP_version")):
            raise OptimizerStateError(f"{cfg_file}: not verl's fsdp_config.json (a JSON object whose FSDP_version and "
                                      "world_size are integers); copy the checkpoint again")
        if int(cfg.get("world_size", world)) != world:
            raise OptimizerStateError(f"{cfg_file} records world_size {cfg['world_size']} but the optimizer files are "
                                      f"optim_world_size_{world}_rank_*.pt: the folder mixes two saves")
        if int(cfg.get("FSDP_version", 2)) == 1:
            raise OptimizerStateError(
                f"{folder}: a verl FSDP1 checkpoint (fsdp_config.json FSDP_version 1): its optimizer files hold "
                "flattened FlatParameter shards whose layout the files do not record. Train with "
                "actor_rollout_ref.actor.strategy=fsdp2 (per-parameter DTensor shards), which entprobe reads")
    gone = [r for r in range(world) if not (folder / f"optim_world_size_{world}_rank_{r}.pt").is_file()]
    if gone:
        raise OptimizerStateError(f"{folder}: optim_world_size_{world}_rank_{gone[0]}.pt is missing ({len(gone)} of "
                                  f"{world} ranks' optimizer files); copy every rank's files")
    if not (folder / f"model_world_size_{world}_rank_0.pt").is_file():
        raise OptimizerStateError(f"{folder}: model_world_size_{world}_rank_0.pt is missing: its parameter names name "
                                  "the optimizer's positions; copy it too")
    return world


def _load(path: Path, what: str):
    """A rank's file; its DTensors come back as local shards with their global shape."""
    import logging

    import torch.distributed.tensor  # noqa: F401  (registers DTensor with the weights-only unpickler)

    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)  # "unpickling of the DeviceMesh before the PGs were created": by design
    try:
        return load_torch_file(path, what, "copy the checkpoint again")
    finally:
        mesh_log.setLevel(level)


def _local(value, where: str) -> tuple[torch.Tensor, tuple]:
    """(the rank's shard, the global shape) of a DTensor sharded on dim 0 of a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        raise OptimizerStateError(f"{where}: a plain {tuple(value.shape)} tensor where verl's FSDP2 saves a DTensor "
                                  "shard; a verl FSDP1 checkpoint? Train with strategy=fsdp2, which entprobe reads")
    place = tuple(value.placements)
    if len(place) != 1 or not isinstance(place[0], (Shard, Replicate)) or (
            isinstance(place[0], Shard) and place[0].dim != 0):
        raise OptimizerStateError(f"{where}: DTensor placements {place}; entprobe reads FSDP2's dim-0 sharding on a "
                                  "1-D mesh (HSDP / 2-D meshes: save with torch.distributed.checkpoint instead)")
    return value.to_local(), tuple(value.shape)


def _whole(shards: list, files: list[Path], where: str) -> torch.Tensor:
    """The whole tensor from every rank's DTensor shard (concatenated on dim 0, or one replica).
    Every rank's shard must be of the same global shape and hold its ``torch.chunk`` share of it
    (an error names the first rank file that disagrees with rank 0's)."""
    from torch.distributed.tensor import Replicate

    local, shape = zip(*(_local(s, f"{f} ({where})") for f, s in zip(files, shards)))
    chunks = [c.shape[0] for c in torch.empty(shape[0][0] if shape[0] else 1, 0).chunk(len(shards))]
    chunks += [0] * (len(shards) - len(chunks))
    replicated = isinstance(shards[0].placements[0], Replicate)
    for r, (t, s, f) in enumerate(zip(local, shape, files)):
        want = tuple(shape[0]) if replicated else (chunks[r], *shape[0][1:])
        if s != shape[0] or tuple(t.shape) != want or isinstance(shards[r].placements[0], Replicate) != replicated:
            raise OptimizerStateError(f"{f}: {where} is a {tuple(t.shape)} shard of {s}, where rank 0's file "
                                      f"({files[0].name}) makes rank {r}'s share {want} of {shape[0]}: the rank files "
                                      "come from different saves or world sizes; copy every rank's files of one save")
    if replicated:
        return local[0].float().clone()
    return torch.cat([t.float() for t in local], 0)


def _same_step(steps: list, files: list[Path], where: str) -> torch.Tensor:
    """The Adam step every rank's file records for a parameter (they must agree)."""
    values = [step_tensor(s, f"{f}: {where}") for s, f in zip(steps, files)]
    for v, f in zip(values, files):
        if float(v) != float(values[0]):
            raise OptimizerStateError(f"{f}: Adam step {float(v):g} for {where}, where {files[0].name} has "
                                      f"{float(values[0]):g}: the rank files come from different saves; copy every "
                                      "rank's files of one save")
    return values[0]


def parameter_names(model_sd: dict) -> list[tuple[str, tuple]]:
    """(name, global shape) in ``parameters()`` order: the state_dict's keys, tied ones once."""
    seen, out = set(), []
    for name, value in model_sd.items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append((name, tuple(value.shape)))
    return out


def _numpy_arrays() -> list:
    """What the weights-only unpickler needs to build the numpy RNG state verl saves (a uint32
    array): the array and dtype types and numpy's array reconstructor, nothing that runs code."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _scheduler_lr(folder: Path, world: int) -> tuple[float | None, str]:
    """The lr scheduler's next lr (``_last_lr``) from rank 0's extra_state file; a file that cannot
    be read leaves the param groups' lr (which torch's schedulers set to the same value)."""
    f = folder / f"extra_state_world_size_{world}_rank_0.pt"
    if not f.is_file():
        return None, ""
    try:
        extra = load_torch_file(f, "verl's extra state", "", allow=_numpy_arrays())
    except ValueError:
        return None, ""
    sched = extra.get("lr_scheduler") if isinstance(extra, dict) else None
    last = sched.get("_last_lr") if isinstance(sched, dict) else None
    return (float(last[0]), str(f)) if last else (None, "")


def read_verl(folder: Path) -> NamedAdamState:
    """A verl FSDP2 actor checkpoint as whole tensors per parameter name, whatever its world size."""
    world = rank_files(folder)
    params = parameter_names(_load(folder / f"model_world_size_{world}_rank_0.pt", "verl's model shard"))
    files = [folder / f"optim_world_size_{world}_rank_{r}.pt" for r in range(world)]
    optims = [_load(f, "verl's optimizer shard") for f in files]
    for r, sd in enumerate(optims):
        if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
            raise OptimizerStateError(f"{folder}/optim_world_size_{world}_rank_{r}.pt is not an optimizer state_dict")
        if [g["params"] for g in sd["param_groups"]] != [g["params"] for g in optims[0]["param_groups"]]:
            raise OptimizerStateError(f"{folder}: rank {r}'s optimizer has other param groups than rank 0's: "
                                      "the files come from different runs")
    if len(optims[0]["param_groups"]) != 1:
        raise OptimizerStateError(f"{folder}: {len(optims[0]['param_groups'])} param groups; verl builds one over "
                                  "module.parameters(), whose positions are the model file's parameters in order. "
                                  "Positions in several groups cannot be named: save with "
                                  "torch.distributed.checkpoint (get_optimizer_state_dict) instead")
    n_idx = sum(len(g["params"]) for g in optims[0]["param_groups"])
    if n_idx != len(params):
        raise OptimizerStateError(f"{folder}: the optimizer has {n_idx} parameters, the model file {len(params)} "
                                  "tensors; entprobe names optimizer positions by the model file's parameters")
    state, groups, position = {}, [], 0
    for gi, g in enumerate(optims[0]["param_groups"]):
        names = []
        for idx in g["params"]:
            name, shape = params[position]
            position += 1
            sts = [sd["state"].get(idx) for sd in optims]
            if all(s is None for s in sts):
                continue  # a frozen parameter (verl's optimizer spans all of them) has no state
            if any(s is None for s in sts):
                raise OptimizerStateError(f"{folder}: parameter {name!r} has Adam state on some ranks only")
            where = f"{folder}: {name}"
            if not all(isinstance(s, dict) and all(k in s for k in MOMENTS) for s in sts):
                raise OptimizerStateError(f"{where}: no exp_avg / exp_avg_sq in a rank's optimizer file: an Adam / "
                                          "AdamW run's checkpoint is needed")
            st = {k: _whole([s[k] for s in sts], files, f"{name} {k}") for k in MOMENTS}
            if tuple(st["exp_avg_sq"].shape) != shape:
                raise OptimizerStateError(f"{where}: exp_avg_sq {tuple(st['exp_avg_sq'].shape)} vs the parameter's "
                                          f"{shape} in the model file: positions and names disagree")
            st["step"] = _same_step([s.get("step", 0) for s in sts], files, f"parameter {name!r}")
            state[name] = st
            names.append(name)
        groups.append(adam_group(g, names, f"{folder} param group {gi}"))
    lr, src = _scheduler_lr(folder, world)
    return NamedAdamState(f"verl FSDP2 checkpoint, world size {world}", folder, state, groups, world, lr, src)
