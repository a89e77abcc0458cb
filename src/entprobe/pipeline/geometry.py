"""Where the step goes: the optimizer to step with, the lr of the simulated step, and Adam's
preconditioner P, from a checkpoint's optimizer state (or plain SGD when the user asks for it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from entprobe.math import paramvec as pv
from entprobe.runtime import sharding
from entprobe.config import ConfigError, EntprobeConfig
from entprobe.checkpoints.models import DTYPES
from entprobe.checkpoints.optim_state import StoredOptimizerState, load_optimizer, positive_lr


@dataclass
class Geometry:
    optimizer: torch.optim.Optimizer
    lr: float
    P: pv.Buffer | pv.LiveAdamPreconditioner | None  # Adam's, read per tensor; None = identity
    # coordinates Adam never updated (exp_avg_sq = 0, so P = 1/eps), per parameter index: found
    # once with the state (``no_history_index``), read by the deltaH1_no_history diagnostic
    no_history: list[tuple[int, torch.Tensor]] | None = field(default=None, repr=False)

    def __post_init__(self):
        eps = self.optimizer.param_groups[0].get("eps") if self.optimizer.param_groups else None
        if self.P is not None and eps and self.no_history is None:
            self.no_history = pv.where_at_least(self.P, 0.5 / float(eps))


def build_geometry(cfg: EntprobeConfig, lm, params, buf_dev: torch.device,
                   stored: StoredOptimizerState | None) -> tuple[Geometry, dict]:
    """The optimizer to step with, the lr, and Adam's preconditioner P (or identity) on ``buf_dev``.
    ``stored``: the optimizer state ``preflight.check_inputs`` read and checked (None: plain SGD at
    ``optimizer.lr``; the preflight has refused that combination with the adam preconditioner)."""
    o = cfg.optimizer
    buf_dtype = DTYPES[cfg.probe.buffers_dtype.value]
    if stored is None:
        if o.lr is None or o.preconditioner.value == "adam":
            raise ConfigError("no optimizer state: set optimizer.state_path, or optimizer.preconditioner=identity "
                              "optimizer.lr=<lr> for plain SGD geometry")
        return Geometry(torch.optim.SGD(params, lr=o.lr), o.lr, None), {"lr_source": "optimizer.lr (config)"}
    lo = load_optimizer(lm.model, stored, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, step=o.step)
    # FSDP2: the full state was matched by name and shape; each rank keeps its shard of it
    sharding.shard_optimizer_state_(lo.optimizer)
    P = None
    if o.preconditioner.value == "adam":
        P = pv.LiveAdamPreconditioner(lo.optimizer, params, lo.step, lo.betas[1], lo.eps, buf_dev, buf_dtype)
    meta = {"lr_source": lo.lr_source, "adam_step": lo.step, "adam_beta1": lo.betas[0],
            "adam_beta2": lo.betas[1], "adam_eps": lo.eps, "optimizer_path": lo.path,
            "optimizer_format": stored.named.fmt if stored.named is not None else "optimizer.pt"}
    if stored.last_step_lr is not None:
        meta["lr_last_step"] = stored.last_step_lr  # trainer_state.json: the lr of the step already taken
    return Geometry(lo.optimizer, lo.lr, P), meta


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself: accelerate's ``AcceleratedOptimizer`` (what HF Trainer and TRL
    hold as ``trainer.optimizer``) keeps it as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):  # the wrapper subclasses Optimizer: unwrap it whatever it is
        return inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer is a {type(optimizer).__name__}; pass the torch.optim optimizer that "
                        "trains the model (e.g. torch.optim.AdamW, or a Trainer's trainer.optimizer)")
    return optimizer


def _one_value(optimizer: torch.optim.Optimizer, key: str, fix: str):
    values = [g[key] for g in optimizer.param_groups if key in g]
    if any(v != values[0] for v in values):
        raise ConfigError(f"the optimizer's param groups have different {key} ({values}); entprobe's "
                          f"geometry needs one: {fix}")
    return values[0] if values else None


def live_lr(cfg: EntprobeConfig, optimizer, fix: str | None = None) -> tuple[float, str]:
    """The lr of the step to probe on an optimizer in memory, and where it came from:
    ``optimizer.lr``, else the param groups' one lr, which must be positive: groups at lr 0 (what
    a schedule leaves at its end) raise the command line's ``OptimizerStateError``
    (``optim_state.positive_lr``; ``fix`` says what to do instead)."""
    if cfg.optimizer.lr is not None:
        return float(cfg.optimizer.lr), "optimizer.lr (config)"
    lr = _one_value(unwrap_optimizer(optimizer), "lr", "set optimizer.lr (the lr of the step to probe)")
    return positive_lr(float(lr), "the optimizer's param groups", fix=fix), "optimizer param_groups (in memory)"


def _not_trained(opt: torch.optim.Optimizer, params, model) -> str | None:
    """The message for tensors in the optimizer that are not the model's trainable parameters (None:
    there are none): the first one by name (or shape) and param group, and what to change."""
    trainable = {id(p) for p in params}
    extra = [(gi, p) for gi, g in enumerate(opt.param_groups) for p in g["params"] if id(p) not in trainable]
    if not extra:
        return None
    gi, p = extra[0]
    named = {id(q): n for n, q in model.named_parameters()} if model is not None else {}
    what = f"{named[id(p)]!r} (shape {list(p.shape)})" if id(p) in named else f"a tensor of shape {list(p.shape)}"
    n = f" ({len(extra)} such tensor(s))" if len(extra) > 1 else ""
    if not p.requires_grad:
        return (f"optimizer param group {gi} holds {what}{n}, which has requires_grad=False: drop it from the "
                "optimizer, or unfreeze it (requires_grad=True)")
    return (f"optimizer param group {gi} holds {what}{n}, which is not a parameter of the model given: pass the "
            "model this optimizer trains")


def check_trains(opt: torch.optim.Optimizer, names: list[str], params, model: torch.nn.Module | None = None) -> None:
    """A ConfigError unless the optimizer trains exactly the model's trainable parameters ``params``
    (``names`` theirs): the first one missing, or the first tensor it holds besides them, named."""
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    missing = [n for n, p in zip(names, params) if id(p) not in in_opt]
    if missing:
        raise ConfigError(f"the model's trainable parameter {missing[0]!r} ({len(missing)} in all) is not in the "
                          "optimizer: pass the optimizer that trains this model, or set requires_grad=False "
                          "on what it does not train")
    extra = _not_trained(opt, params, model)
    if extra:
        raise ConfigError(extra)


def live_geometry(cfg: EntprobeConfig, optimizer, names: list[str], params, buf_dev: torch.device,
                  model: torch.nn.Module | None = None) -> tuple[Geometry, dict]:
    """``build_geometry`` for an optimizer in memory: its own param groups, lr and Adam state are the
    geometry (nothing is read from a file or copied). Every trainable parameter of the model must be
    in the optimizer and the optimizer must train nothing else; the lr is the groups' (one lr, or
    ``optimizer.lr``, which the caller applies to the groups for the probe's duration; ``model``:
    names a frozen parameter left in the optimizer); Adam's
    preconditioner needs the state of a first step (``exp_avg_sq`` for every parameter)."""
    opt = unwrap_optimizer(optimizer)
    o = cfg.optimizer
    check_trains(opt, names, params, model)
    lr, lr_source = live_lr(cfg, opt)
    meta = {"lr_source": lr_source, "optimizer_format": f"in memory ({type(opt).__name__})"}
    if o.preconditioner.value != "adam":
        return Geometry(opt, float(lr), None), meta
    if not isinstance(opt, torch.optim.Adam):
        raise ConfigError(f"the optimizer is {type(opt).__name__}: Adam's preconditioner needs torch.optim.AdamW "
                          "(or Adam); use optimizer.preconditioner=identity for plain SGD geometry")
    betas = _one_value(opt, "betas", "use one (beta1, beta2) for every group")
    eps = float(_one_value(opt, "eps", "use one eps for every group"))
    state = [opt.state.get(p, {}) for p in params]
    fresh = [n for n, st in zip(names, state) if "exp_avg_sq" not in st]
    if fresh:
        raise ConfigError(f"the optimizer has no Adam state for {fresh[0]!r} ({len(fresh)} parameter(s)): it has "
                          "not taken a step yet; probe after its first step, or use "
                          "optimizer.preconditioner=identity")
    steps = {int(float(st["step"])) for st in state}
    step = max(steps)
    P = pv.LiveAdamPreconditioner(opt, params, step, float(betas[1]), eps, buf_dev,
                                  DTYPES[cfg.probe.buffers_dtype.value])
    meta.update({"adam_step": step, "adam_beta1": float(betas[0]), "adam_beta2": float(betas[1]), "adam_eps": eps})
    return Geometry(opt, float(lr), P), meta
