"""Load an AdamW state (``optimizer.pt`` or an HF Trainer / TRL ``checkpoint-N/`` folder).

HF Trainer builds two param groups: parameters with weight decay, then those without (biases
and norm weights), each in ``model.named_parameters()`` order. ``optimizer.pt`` indexes state by
position in those groups, so the grouping is rebuilt here, the group sizes are checked against
``param_groups[i]["params"]`` and every state shape against its parameter. A file with one group
is matched in model order. Nothing is unpickled: ``torch.load(weights_only=True)``.

A folder a sharded trainer wrote (torch.distributed.checkpoint / accelerate FSDP, verl FSDP2,
DeepSpeed ZeRO) is read by ``entprobe.checkpoints.trainer_states`` into Adam's whole state per parameter name,
and matched to the model by name and shape.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from entprobe.checkpoints.errors import OptimizerStateError  # noqa: F401 (re-exported)
from entprobe.runtime.input_files import load_json_file, load_torch_file
from entprobe.math.paramvec import trainable
from entprobe.checkpoints.trainer_states import FORMATS
from entprobe.checkpoints.trainer_states import read_trainer_state
from entprobe.checkpoints.trainer_states.named import match_to_model

if TYPE_CHECKING:
    from entprobe.checkpoints.trainer_states import NamedAdamState




@dataclass
class LoadedOptimizer:
    optimizer: torch.optim.AdamW  # live optimizer over the trainable parameters, state loaded
    lr: float  # the lr of the step the probe simulates
    lr_source: str
    betas: tuple[float, float]
    eps: float
    step: int
    exp_avg_sq: list[torch.Tensor]  # aligned with paramvec.trainable(model)
    path: str


def decay_parameter_names(model) -> set[str]:
    """Names HF Trainer puts in its weight-decay group (all but biases and norm weights), from
    transformers' own ``Trainer.get_decay_parameter_names``, called unbound: it reads nothing
    but ``model`` (importing the Trainer costs a few seconds, once per process)."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


def trainer_groups(model, weight_decay: float = 0.0) -> list[dict]:
    """Param groups exactly as HF Trainer.create_optimizer builds them (decay first)."""
    names, params = trainable(model)
    decay = decay_parameter_names(model)
    return [
        {"params": [p for n, p in zip(names, params) if n in decay], "weight_decay": weight_decay,
         "names": [n for n in names if n in decay]},
        {"params": [p for n, p in zip(names, params) if n not in decay], "weight_decay": 0.0,
         "names": [n for n in names if n not in decay]},
    ]


def _resolve_files(path: str) -> tuple[Path, Path | None]:
    p = Path(path).expanduser()
    if p.is_dir():
        opt = p / "optimizer.pt"
        if not opt.is_file():
            raise OptimizerStateError(f"optimizer.state_path={path!r}: {p} holds no optimizer state entprobe reads; "
                                      f"point optimizer.state_path at {FORMATS}, or use "
                                      "optimizer.preconditioner=identity optimizer.lr=<lr> for plain SGD geometry")
        return opt, p
    if not p.is_file():
        raise OptimizerStateError(f"optimizer.state_path={path!r} does not exist")
    return p, p.parent


_SET_LR = "set optimizer.lr to the lr of the step you want to simulate"


def _last_step_lr(folder: Path | None) -> float | None:
    """The lr of the step already taken: trainer_state.json's last logged ``learning_rate`` (HF
    Trainer logs the lr before its scheduler steps). Informative only: the next step's lr is the
    scheduler's. A file that is there must be readable (the error names it)."""
    ts = folder / "trainer_state.json" if folder is not None else None
    if ts is None or not ts.is_file():
        return None
    state = load_json_file(ts, "the Trainer state", f"fix or remove it, or {_SET_LR}")
    hist = [h for h in state.get("log_history", []) if isinstance(h, dict) and "learning_rate" in h] \
        if isinstance(state, dict) else []
    return float(hist[-1]["learning_rate"]) if hist else None


def next_step_lr(opt_file: Path, folder: Path | None, stored_groups: list[dict],
                 last_step_lr: float | None = None) -> tuple[float, str]:
    """The lr of the step the probe simulates when ``optimizer.lr`` is not set: the scheduler's next
    lr (``scheduler.pt``'s ``_last_lr``), else the lr the scheduler left in ``optimizer.pt``'s param
    groups (torch schedulers write it there before the checkpoint is saved)."""
    sched = folder / "scheduler.pt" if folder is not None else None
    if sched is not None and sched.is_file():
        st = load_torch_file(sched, "the lr scheduler state", f"fix or remove it, or {_SET_LR}")
        last = st.get("_last_lr") if isinstance(st, dict) else None
        if last:
            return positive_lr(float(last[0]), str(sched), last_step_lr), "scheduler.pt"
    lr = float(stored_groups[0].get("lr", 0.0))
    return positive_lr(lr, f"{opt_file} param_groups", last_step_lr), "optimizer.pt param_groups"


def positive_lr(lr: float, src: str, last_step_lr: float | None = None, fix: str | None = None) -> float:
    """``lr`` when it is a positive finite number. A next lr of 0 is the end of the schedule: an
    error that says so and asks for ``optimizer.lr`` (``fix``: what to do instead, e.g. how the
    Python API takes it)."""
    if not (lr > 0 and lr == lr and lr != float("inf")):
        taken = last_step_lr
        before = f"; the last step was taken at lr {taken:g} (trainer_state.json)" if taken else ""
        err = OptimizerStateError(
            f"the schedule has ended: the next step's lr is {lr:g} ({src}){before}. A step at lr 0 "
            f"changes nothing: {fix or f'{_SET_LR}, e.g. optimizer.lr={taken or 1e-6:g}'}")
        err.schedule_ended = True
        raise err
    return lr


@dataclass
class StoredOptimizerState:
    """An optimizer state_dict read and checked without the model, and the lr of the next step."""
    state_dict: dict | None  # optimizer.pt's (None: a sharded trainer's state, in ``named``)
    file: Path
    lr: float
    lr_source: str
    last_step_lr: float | None  # trainer_state.json's, when the folder has one
    named: NamedAdamState | None = None  # Adam's whole state per parameter name (trainer_states)


def read_optimizer_state(path: str, lr: float | None = None) -> StoredOptimizerState:
    """Read ``optimizer.pt`` (a file or a Trainer checkpoint folder) or a sharded trainer's folder
    (``trainer_states``) and check what needs no model: every Adam moment is finite and
    ``exp_avg_sq >= 0``, an optimizer.pt has 1 or 2 param groups, and the next step has a positive lr
    (``lr`` from the config, else the checkpoint's scheduler, else its param groups' lr)."""
    p = Path(path).expanduser()
    if p.is_dir() and not (p / "optimizer.pt").is_file():
        named = read_trainer_state(p)
        if named is not None:
            taken = _last_step_lr(p)  # an HF Trainer FSDP checkpoint-N/ logs it beside optimizer_0/
            if lr is not None:
                return StoredOptimizerState(None, named.path, float(lr), "optimizer.lr (config)", taken, named)
            src = named.scheduler_source or f"{named.path} param groups ({named.fmt})"
            value = named.scheduler_lr if named.scheduler_lr is not None else named.groups[0].lr
            return StoredOptimizerState(None, named.path, positive_lr(value, src, taken), src, taken, named)
    opt_file, folder = _resolve_files(path)
    todo = ("point optimizer.state_path at an intact optimizer.pt, or use optimizer.preconditioner=identity "
            "optimizer.lr=<lr> for plain SGD geometry")
    sd = load_torch_file(opt_file, "the optimizer state", todo)
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise OptimizerStateError(f"{opt_file} is not an optimizer state_dict (no 'state'/'param_groups'); {todo}")
    if len(sd["param_groups"]) not in (1, 2):
        raise OptimizerStateError(f"{opt_file} has {len(sd['param_groups'])} param groups; entprobe matches "
                                  "1 (model order) or 2 (HF Trainer decay / no-decay)")
    for gi, g in enumerate(sd["param_groups"]):
        for idx in g["params"]:
            st = sd["state"].get(idx, {})
            bad = [k for k in ("exp_avg", "exp_avg_sq") if k in st and not torch.isfinite(st[k]).all()]
            if bad or ("exp_avg_sq" in st and float(st["exp_avg_sq"].min()) < 0):
                what = f"non-finite {'/'.join(bad)}" if bad else "negative exp_avg_sq"
                raise OptimizerStateError(f"{opt_file}: {what} for the parameter at index {idx} (param group "
                                          f"{gi}): the optimizer state is corrupt; use another checkpoint")
    taken = _last_step_lr(folder)
    if lr is not None:
        lr_val, lr_src = float(lr), "optimizer.lr (config)"
    else:
        lr_val, lr_src = next_step_lr(opt_file, folder, sd["param_groups"], taken)
    return StoredOptimizerState(sd, opt_file, lr_val, lr_src, taken)


def _first_disagreement(group: dict, stored: dict, state: dict) -> str:
    """Where a group of the model and of the checkpoint first differ in shape (or run out)."""
    for pos, (name, p, idx) in enumerate(zip(group["names"], group["params"], stored["params"])):
        v = state.get(idx, {}).get("exp_avg_sq")
        if v is None or tuple(v.shape) != tuple(p.shape):
            got = None if v is None else tuple(v.shape)
            return f"; first bad parameter {name!r} (position {pos}): checkpoint {got} vs model {tuple(p.shape)}"
    n = len(stored["params"])
    if n < len(group["names"]):
        return f"; first bad parameter {group['names'][n]!r} (position {n}): no state in the checkpoint"
    return ""


def match_by_position(model, stored: StoredOptimizerState) -> tuple[list[dict], dict]:
    """(param groups over the model's trainable parameters, optimizer.pt's state_dict), paired by
    position in HF Trainer's grouping (or model order for one group), every size and shape checked."""
    opt_file, sd = stored.file, stored.state_dict
    stored_groups = sd["param_groups"]
    names, params = trainable(model)
    wd_stored = max((g.get("weight_decay", 0.0) for g in stored_groups), default=0.0)
    if len(stored_groups) == 1:
        groups = [{"params": params, "names": names, "weight_decay": stored_groups[0].get("weight_decay", 0.0)}]
    else:
        groups = trainer_groups(model, wd_stored)
    for gi, (g, sg) in enumerate(zip(groups, stored_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise OptimizerStateError(
                f"{opt_file}: param group {gi}: the checkpoint has {len(sg['params'])} parameters, the model's "
                f"{('decay', 'no-decay')[gi] if len(groups) == 2 else 'trainable'} group has "
                f"{len(g['params'])}{_first_disagreement(g, sg, sd['state'])}; is this optimizer.pt "
                "from this model?")
    # Check every state shape before touching anything.
    for g, sg in zip(groups, stored_groups):
        for name, p, idx in zip(g["names"], g["params"], sg["params"]):
            st = sd["state"].get(idx)
            if st is None or "exp_avg_sq" not in st:
                raise OptimizerStateError(f"{opt_file}: no Adam state for parameter {name!r} (index {idx}); "
                                          "use optimizer.preconditioner=identity for SGD geometry")
            if tuple(st["exp_avg_sq"].shape) != tuple(p.shape):
                raise OptimizerStateError(
                    f"{opt_file}: state shape mismatch at parameter {name!r}: checkpoint "
                    f"{tuple(st['exp_avg_sq'].shape)} vs model {tuple(p.shape)}; the optimizer.pt does not "
                    "belong to this model")
    return groups, sd


def load_optimizer(model, path: "str | StoredOptimizerState", lr=None, betas=None, eps=None, weight_decay=None,
                   step=None) -> LoadedOptimizer:
    """Match the stored AdamW state to the model's trainable parameters and build a live AdamW.
    ``path``: a file / folder (read here) or what ``read_optimizer_state`` returned. optimizer.pt
    is matched by position (``match_by_position``), a sharded trainer's state by name and shape
    (``trainer_states.named.match_to_model``)."""
    stored = path if isinstance(path, StoredOptimizerState) else read_optimizer_state(path, lr)
    if stored.named is not None:
        groups, sd = match_to_model(stored.named, model)
    else:
        groups, sd = match_by_position(model, stored)
    opt_file, stored_groups = stored.file, sd["param_groups"]
    _, params = trainable(model)
    g0 = stored_groups[0]
    betas = tuple(betas) if betas is not None else tuple(g0.get("betas", (0.9, 0.999)))
    eps = float(eps if eps is not None else g0.get("eps", 1e-8))
    lr_val, lr_src = stored.lr, stored.lr_source
    torch_groups = [{"params": g["params"],
                     "weight_decay": float(weight_decay) if weight_decay is not None and g["weight_decay"] > 0
                     else g["weight_decay"]} for g in groups]
    # foreach: one multi-tensor kernel per op instead of a Python loop over tensors (torch only
    # defaults to it on CUDA); the same update up to rounding
    opt = torch.optim.AdamW(torch_groups, lr=lr_val, betas=betas, eps=eps, foreach=True)
    new_sd = opt.state_dict()
    state = {}
    for new_g, sg in zip(new_sd["param_groups"], stored_groups):
        for new_idx, idx in zip(new_g["params"], sg["params"]):
            st = dict(sd["state"][idx])
            if step is not None:
                st["step"] = torch.tensor(float(step))
            state[new_idx] = st
    new_sd["state"] = state
    opt.load_state_dict(new_sd)
    for g in opt.param_groups:  # load_state_dict restores the stored lr/betas/eps: use ours
        g["lr"], g["betas"], g["eps"] = lr_val, betas, eps
    by_param = {id(p): opt.state[p] for g in groups for p in g["params"]}
    steps = {int(float(by_param[id(p)]["step"])) for p in params}
    if len(steps) != 1:
        warnings.warn(f"Adam step counters differ across parameters: {sorted(steps)[:5]}")
    step_val = max(steps)
    return LoadedOptimizer(opt, lr_val, lr_src, betas, eps, step_val,
                           [by_param[id(p)]["exp_avg_sq"] for p in params], str(opt_file))
