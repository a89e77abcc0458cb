"""The optimizer state every reader produces: Adam's moments per parameter **name**, whole.

A sharded trainer checkpoint (torch DCP, verl FSDP, DeepSpeed ZeRO) is read into one
``NamedAdamState`` whatever the world size that wrote it: per parameter name the full
``exp_avg``, ``exp_avg_sq`` (fp32, the parameter's shape) and ``step``, and per param group the
names it holds with its lr, betas, eps and weight decay. A probe on any number of ranks takes its
own shard of it (resharding on load). ``match_to_model`` pairs it with a model's trainable
parameters by name and shape, never by position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from entprobe.checkpoints.errors import OptimizerStateError
from entprobe.math.paramvec import trainable

MOMENTS = ("exp_avg", "exp_avg_sq")
# module names wrappers put between a model and its parameters (FSDP1, activation checkpointing,
# torch.compile; DDP / DeepSpeed engines put ``module.`` in front)
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter name as the unwrapped model has it: wrapper components removed."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


@dataclass
class AdamGroup:
    names: list[str]
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass
class NamedAdamState:
    """Adam's full state per parameter name, and where it came from (for messages)."""
    fmt: str  # e.g. "verl FSDP2 checkpoint, world size 4"
    path: Path  # the folder (or file) that was read
    state: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq", "step"}
    groups: list[AdamGroup]
    world_size: int | None = None  # of the run that wrote it (None: not recorded)
    scheduler_lr: float | None = None  # the lr scheduler's next lr, when the checkpoint holds one
    scheduler_source: str = ""


def adam_group(hyper: dict, names: list[str], where: str) -> AdamGroup:
    """An ``AdamGroup`` from a torch param group's hyperparameters (an error names ``where``)."""
    try:
        betas = tuple(float(b) for b in hyper.get("betas", (0.9, 0.999)))
        return AdamGroup(list(names), float(hyper.get("lr", 0.0)), (betas[0], betas[1]),
                         float(hyper.get("eps", 1e-8)), float(hyper.get("weight_decay", 0.0)))
    except (TypeError, ValueError, IndexError):
        raise OptimizerStateError(f"{where}: a param group's lr / betas / eps / weight_decay are not numbers "
                                  "(is this an Adam / AdamW state?)") from None


def step_tensor(value, where: str) -> torch.Tensor:
    """Adam's step counter as torch keeps it (a float scalar tensor)."""
    try:
        return torch.tensor(float(value.item() if torch.is_tensor(value) else value))
    except (TypeError, ValueError, RuntimeError):
        raise OptimizerStateError(f"{where}: Adam's step counter {value!r} is not a number") from None


def check_moments(named: NamedAdamState) -> None:
    """Every moment finite and ``exp_avg_sq >= 0``; an error names the parameter."""
    for name, st in named.state.items():
        bad = [k for k in MOMENTS if not torch.isfinite(st[k]).all()]
        if bad or float(st["exp_avg_sq"].min()) < 0:
            what = f"non-finite {'/'.join(bad)}" if bad else "negative exp_avg_sq"
            raise OptimizerStateError(f"{named.path} ({named.fmt}): {what} for parameter {name!r}: the optimizer "
                                      "state is corrupt; use another checkpoint")


def split_flat(flat: torch.Tensor, shapes: list[tuple[str, tuple]], where: str) -> dict[str, torch.Tensor]:
    """Cut a flat vector into the named shapes laid end to end (what is left is padding)."""
    out, offset = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        if offset + n > flat.numel():
            raise OptimizerStateError(f"{where}: the flat state has {flat.numel()} values, too few for parameter "
                                      f"{name!r} {tuple(shape)} at offset {offset}; are all rank files there?")
        out[name] = flat.narrow(0, offset, n).view(shape).clone()
        offset += n
    return out


def match_to_model(named: NamedAdamState, model) -> tuple[list[dict], dict]:
    """(torch param groups over the model's trainable parameters, an optimizer state_dict for them),
    paired by name and shape. An error names the first parameter without state, the first state
    the model has no parameter for, and the first shape that differs."""
    names, params = trainable(model)
    by_name = dict(zip(names, params))
    where = f"{named.path} ({named.fmt})"
    missing = [n for n in names if n not in named.state]
    if missing:
        raise OptimizerStateError(
            f"{where}: no Adam state for parameter {missing[0]!r} ({len(missing)} of the model's {len(names)} "
            f"trainable parameters have none; the state has {len(named.state)} parameters, e.g. "
            f"{next(iter(named.state), 'none')!r}): is this checkpoint of this model (model.path)?")
    foreign = [n for n in named.state if n not in by_name]
    if foreign:
        raise OptimizerStateError(f"{where}: the state has parameter {foreign[0]!r}, which the model has not (or "
                                  "not as trainable): is this checkpoint of this model (model.path)?")
    for n in names:
        got = tuple(named.state[n]["exp_avg_sq"].shape)
        if got != tuple(by_name[n].shape):
            raise OptimizerStateError(f"{where}: state shape mismatch at parameter {n!r}: checkpoint {got} vs model "
                                      f"{tuple(by_name[n].shape)}; the state does not belong to this model")
    grouped = [n for g in named.groups for n in g.names]
    if sorted(grouped) != sorted(named.state):
        odd = next(n for n in [*named.state, *grouped] if grouped.count(n) != 1)
        raise OptimizerStateError(f"{where}: parameter {odd!r} is in {grouped.count(odd)} param groups (one expected): "
                                  "the checkpoint's param groups do not cover its state")
    groups, sd = [], {"state": {}, "param_groups": []}
    order = {n: i for i, n in enumerate(names)}
    for g in named.groups:
        members = sorted(g.names, key=order.__getitem__)
        idx = list(range(len(sd["state"]), len(sd["state"]) + len(members)))
        for i, n in zip(idx, members):
            sd["state"][i] = {k: named.state[n][k] for k in (*MOMENTS, "step")}
        groups.append({"params": [by_name[n] for n in members], "names": members, "weight_decay": g.weight_decay})
        sd["param_groups"].append({"params": idx, "lr": g.lr, "betas": g.betas, "eps": g.eps,
                                   "weight_decay": g.weight_decay})
    return [g for g in groups if g["params"]], {**sd, "param_groups": [s for s in sd["param_groups"] if s["params"]]}
