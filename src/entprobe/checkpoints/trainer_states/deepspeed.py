"""DeepSpeed ZeRO-1/2/3 checkpoints: ``global_stepN/`` as ``engine.save_checkpoint`` writes it.

- ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R:
  ``{"optimizer_state_dict": {...}}`` whose base optimizer state holds, per param group, Adam's
  moments of the rank's partition of the group's flat fp32 vector;
- ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  (ZeRO-3): ``param_shapes``, per param group the parameter names and shapes in flat order.

ZeRO-1/2 lay a group's parameters end to end in one flat vector, padded at its end, and give each
rank one contiguous slice (the moments keep the rank's padding, ``group_paddings``). ZeRO-3
partitions every parameter on its own into ``ceil(numel / W)`` values per rank (the last padded);
a rank's flat vector is its partitions in order. This is DeepSpeed's own ``zero_to_fp32.py``
consolidation, applied to the moments; names come from ``param_shapes``, and the shapes are
checked against the model when the state meets it.

Read with ``torch.load(weights_only=True)``: the few DeepSpeed records in the files (the loss
scaler, ``ZeroStageEnum``, ``fragment_address``) are built as inert stand-ins, so DeepSpeed need not
be installed and nothing from the files runs. A file holding anything else is refused with the
conversion to run where DeepSpeed is installed: ``ds_to_universal``, whose per-parameter
``zero/<name>/`` files (a universal checkpoint) are read here too.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from entprobe.runtime.input_files import InputFileError, load_torch_file
from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.checkpoints.trainer_states.named import MOMENTS, NamedAdamState, adam_group, split_flat, step_tensor

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
UNIVERSAL = ("python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder "
             "{folder}_universal")


class _Record:
    """An inert stand-in for a DeepSpeed object in a checkpoint: its attributes, no behaviour."""


class _ZeroStage(int):
    """A stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage number."""


SAFE = [(_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
        (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
        (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def find_deepspeed_folder(path: Path) -> Path | None:
    """The ``global_stepN`` folder (or its universal conversion, with ``zero/<name>/``): ``path``
    itself, or the one its ``latest`` (``latest_universal``) file names."""
    if path.is_dir() and (any(_OPTIM.match(p.name) for p in path.iterdir()) or is_universal(path)):
        return path
    for name in ("latest_universal", "latest"):
        latest = path / name
        if latest.is_file():
            tag = path / latest.read_text(errors="replace").strip()
            if not tag.is_dir():
                raise OptimizerStateError(f"{latest} names {tag.name!r}, which is not a folder in {path}: copy that "
                                          "save's folder too, or point optimizer.state_path at a global_stepN folder")
            if not (any(_OPTIM.match(p.name) for p in tag.iterdir()) or is_universal(tag)):
                raise OptimizerStateError(f"{latest} names {tag.name!r}, which holds no optimizer files "
                                          "(zero_pp_rank_R_mp_rank_00_optim_states.pt): an interrupted save or copy? "
                                          "Point optimizer.state_path at a complete global_stepN folder")
            return tag
    return None


def is_universal(folder: Path) -> bool:
    """A DeepSpeed universal checkpoint: ``zero/<parameter name>/exp_avg_sq.pt`` per parameter."""
    return (folder / "zero" / "optimizer_state.pt").is_file()


def _load(path: Path, what: str, folder: Path):
    try:
        return load_torch_file(path, what, "copy the checkpoint again", allow=SAFE)
    except InputFileError as exc:
        if "never unpickles" not in str(exc):
            raise
        raise OptimizerStateError(
            f"{path}: holds DeepSpeed objects beyond the loss scaler and ZeRO records, which entprobe does not "
            "unpickle (nothing from a checkpoint is executed). Convert it to per-parameter files with DeepSpeed, "
            f"where it is installed: `{UNIVERSAL.format(folder=folder)}`, or save the run's optimizer from a "
            "trainer that writes torch.distributed.checkpoint (accelerate FSDP)") from None


def rank_files(folder: Path) -> list[Path]:
    """Every data-parallel rank's optimizer file, in rank order (an error names a missing one)."""
    found = {}
    for p in folder.iterdir():
        if (m := _OPTIM.match(p.name)):
            if int(m.group(2)) != 0:
                raise OptimizerStateError(f"{p}: a tensor-parallel (mp_rank {m.group(2)}) DeepSpeed checkpoint; "
                                          "entprobe reads data-parallel ZeRO checkpoints (mp_rank_00 only)")
            found[int(m.group(1))] = p
    world = max(found) + 1
    gone = [r for r in range(world) if r not in found]
    if gone:
        raise OptimizerStateError(f"{folder}: zero_pp_rank_{gone[0]}_mp_rank_00_optim_states.pt is missing ({len(gone)} "
                                  f"of {world} ranks); copy every rank's file")
    return [found[r] for r in range(world)]


def _agree(values: list, files: list[Path], what: str):
    """The value every rank's file has (rank 0's); an error names the first file that differs."""
    for v, f in zip(values, files):
        if v != values[0]:
            raise OptimizerStateError(f"{f}: {what} {v:g}, where {files[0].name} has {values[0]:g}: the rank files "
                                      "come from different saves; copy every rank's file of one save")
    return values[0]


def _partition_count(osd: dict) -> int:
    pc = osd.get("partition_count")
    counts = set(pc) if isinstance(pc, (list, tuple)) else {pc}
    return int(next(iter(counts))) if len(counts) == 1 and None not in counts else -1


def _base_states(osd: dict, stage: int, where: Path, ds_config: dict) -> tuple[list[dict], list[dict]]:
    """(Adam's state per flat group in order, the param groups' hyperparameters)."""
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    if isinstance(base, list):  # ZeRO-1/2 elastic checkpoints: one padding-free state per group and
        # no param groups; the hyperparameters are the DeepSpeed config's
        params = dict((ds_config.get("optimizer") or {}).get("params") or {})
        return base, [params] * len(base)
    if not isinstance(base, dict) or "state" not in base:
        raise OptimizerStateError(f"{where}: no base optimizer state in the DeepSpeed optimizer file")
    return [base["state"][k] for k in sorted(base["state"])], base.get("param_groups", [])


def un_partition(flats: list[torch.Tensor], shapes: list[tuple[str, tuple]], stage: int, where: str,
                 paddings: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Whole named tensors from every rank's flat partition (rank order): ZeRO-1/2 concatenate the
    slices (each less its ``paddings``) and cut the group's parameters end to end; ZeRO-3 takes
    each parameter's ``ceil(numel / W)`` values from every rank in turn."""
    world = len(flats)
    if stage in (1, 2):
        pads = paddings or [0] * world
        flat = torch.cat([f[:f.numel() - p] for f, p in zip(flats, pads)])
        out = split_flat(flat, shapes, where)
        left = flat.numel() - sum(math.prod(s) for _, s in shapes)
        if left >= 2 * world:  # ZeRO-2 aligns a group to 2 x world size; more left means a layout mismatch
            raise OptimizerStateError(f"{where}: {left} values left after the group's parameters: the partitions "
                                      "do not match the parameter shapes (mixed checkpoints?)")
        return out
    out, offset = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        part = math.ceil(n / world)
        if any(offset + part > f.numel() for f in flats):
            raise OptimizerStateError(f"{where}: the ranks' flat state ends before parameter {name!r}")
        out[name] = torch.cat([f.narrow(0, offset, part) for f in flats])[:n].view(shape).clone()
        offset += part
    return out


def read_universal(folder: Path) -> NamedAdamState:
    """DeepSpeed's universal checkpoint (``ds_to_universal``): ``zero/<name>/{exp_avg, exp_avg_sq}.pt``
    hold ``{"param": whole tensor}``, ``step.pt`` the counter, ``zero/optimizer_state.pt`` the param
    groups; which parameter is in which group comes from the model states' ``param_shapes``."""
    zero = folder / "zero"
    common = _load(zero / "optimizer_state.pt", "DeepSpeed's common optimizer state", folder)
    hyper = common.get("param_groups") or []
    state = {}
    for sub in sorted(p for p in zero.iterdir() if (p / "exp_avg_sq.pt").is_file()):
        st = {k: _load(sub / f"{k}.pt", f"the {k} of {sub.name}", folder) for k in MOMENTS}
        if not all(isinstance(v, dict) and torch.is_tensor(v.get("param")) for v in st.values()):
            raise OptimizerStateError(f"{sub}: not a universal checkpoint's {{'param': tensor}} files")
        step = _load(sub / "step.pt", f"the step of {sub.name}", folder) if (sub / "step.pt").is_file() else 0
        state[sub.name] = {k: v["param"].float() for k, v in st.items()} | {"step": step_tensor(step, str(sub))}
    model_files = sorted(folder.glob("*model_states.pt"))
    shapes = _load(model_files[0], "DeepSpeed's model states", folder).get("param_shapes") if model_files else None
    if shapes and len(shapes) == len(hyper):
        groups = [adam_group(h, [n for n in g if n in state], f"{folder} param group {i}")
                  for i, (h, g) in enumerate(zip(hyper, shapes))]
    elif len(hyper) == 1:
        groups = [adam_group(hyper[0], list(state), f"{folder} param group 0")]
    else:
        raise OptimizerStateError(f"{folder}: {len(hyper)} param groups and no model states file with the "
                                  "param_shapes that say which parameter is in which")
    return NamedAdamState("DeepSpeed universal checkpoint", folder, state, groups)


def read_deepspeed(folder: Path) -> NamedAdamState:
    """A DeepSpeed ZeRO checkpoint as whole tensors per parameter name, whatever its world size."""
    if is_universal(folder):
        return read_universal(folder)
    files = rank_files(folder)
    world = len(files)
    loaded = [_load(f, "DeepSpeed's optimizer partition", folder) for f in files]
    optims = [sd.get("optimizer_state_dict", {}) for sd in loaded]
    stage = int(optims[0].get("zero_stage", -1))
    if stage not in (1, 2, 3):
        raise OptimizerStateError(f"{files[0]}: zero_stage {stage}; entprobe reads ZeRO stages 1, 2 and 3")
    for f, osd in zip(files, optims):
        if _partition_count(osd) != world:
            raise OptimizerStateError(f"{f}: partitioned over {osd.get('partition_count')} ranks, but {world} rank files "
                                      f"are in {folder}: the folder mixes saves of different world sizes")
    model_file = folder / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    model_states = _load(model_file, "DeepSpeed's model states", folder)
    shapes = model_states.get("param_shapes")
    if not shapes:
        raise OptimizerStateError(f"{model_file}: no param_shapes (the parameter names of each ZeRO group)")
    groups_shapes = [[(n, tuple(s)) for n, s in g.items()] for g in shapes]
    per_rank = [_base_states(osd, stage, f, loaded[0].get("ds_config") or {}) for f, osd in zip(files, optims)]
    hyper = per_rank[0][1]
    if stage == 3:  # one flat vector per rank over every group (and sub-group)
        flat_groups = [[n for g in groups_shapes for n in g]]
    else:
        flat_groups = groups_shapes
        if len(per_rank[0][0]) != len(groups_shapes):
            raise OptimizerStateError(f"{folder}: {len(per_rank[0][0])} flat groups in the optimizer files, "
                                      f"{len(groups_shapes)} in {model_file.name}: mixed checkpoints?")
    state = {}
    for gi, shapes_i in enumerate(flat_groups):
        moments = {}
        for key in MOMENTS:
            flats = [torch.cat([s[key].float().reshape(-1) for s in st]) if stage == 3 else st[gi][key].float()
                     for st, _ in per_rank]
            _agree([f.numel() for f in flats], files, f"{key} partition size (flat group {gi})")
            pads = None if stage == 3 or isinstance(optims[0].get("base_optimizer_state"), list) else \
                [int(osd.get("group_paddings", [0] * len(flat_groups))[gi]) for osd in optims]
            moments[key] = un_partition(flats, shapes_i, stage, f"{folder} ({key})", pads)
        steps = [float(step_tensor(st[0 if stage == 3 else gi].get("step", osd.get("base_optimizer_state_step", 0)),
                                   str(f))) for (st, _), osd, f in zip(per_rank, optims, files)]
        step = _agree(steps, files, f"Adam step (flat group {gi})")
        for name, _ in shapes_i:
            state[name] = {k: moments[k][name] for k in MOMENTS} | {"step": step_tensor(step, f"{folder}: {name}")}
    if len(hyper) == len(groups_shapes):
        groups = [adam_group(h, [n for n, _ in g], f"{folder} param group {i}")
                  for i, (h, g) in enumerate(zip(hyper, groups_shapes))]
    elif hyper and all({k: v for k, v in h.items() if k != "params"} ==
                       {k: v for k, v in hyper[0].items() if k != "params"} for h in hyper):
        groups = [adam_group(hyper[0], [n for g in groups_shapes for n, _ in g], f"{folder} param groups")]
    else:
        raise OptimizerStateError(f"{folder}: {len(hyper)} optimizer param groups with different hyperparameters "
                                  f"for {len(groups_shapes)} ZeRO groups; entprobe cannot tell which is whose")
    sched = model_states.get("lr_scheduler")
    last = sched.get("_last_lr") if isinstance(sched, dict) else None
    lr, src = (float(last[0]), str(model_file)) if last else (None, "")
    return NamedAdamState(f"DeepSpeed ZeRO-{stage} checkpoint, world size {world}", folder, state, groups, world,
                          lr, src)
