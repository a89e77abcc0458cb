"""Where the step goes: the optimizer to step with, the lr of the simulated step, and Adam's
preconditioner P, from a checkpoint's optimizer state (or plain SGD when the user asks for it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from entprobe import paramvec as pv
from entprobe.config import ConfigError, EntprobeConfig
from entprobe.models import DTYPES
from entprobe.optim_state import StoredOptimizerState, load_optimizer


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
    P = None
    if o.preconditioner.value == "adam":
        P = pv.LiveAdamPreconditioner(lo.optimizer, params, lo.step, lo.betas[1], lo.eps, buf_dev, buf_dtype)
    meta = {"lr_source": lo.lr_source, "adam_step": lo.step, "adam_beta1": lo.betas[0],
            "adam_beta2": lo.betas[1], "adam_eps": lo.eps, "optimizer_path": lo.path}
    if stored.last_step_lr is not None:
        meta["lr_last_step"] = stored.last_step_lr  # trainer_state.json: the lr of the step already taken
    return Geometry(lo.optimizer, lo.lr, P), meta
