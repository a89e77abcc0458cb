"""What the online probe reads from the config, and the checks of its optimizer's lr, shared by
``OnlineProbe`` and the TRL callbacks (integrations/trl.py)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from entprobe.config import ConfigError, EntprobeConfig
from entprobe.pipeline.api import api_config, flatten_overrides

SOURCES = ("held_out", "rollouts")  # where the prediction's X comes from: a fresh E, or the step's own batch

# what the online probe reads from the config; every other key describes the command line's own
# step (objective, optimizer file, ...), which the online probe takes from the training loop
ONLINE_KEYS = ("batch.B_E", "batch.G", "batch.seed_E", "sampling", "probe.mb_size_prompts", "probe.weighting_mode",
               "probe.x_estimator", "probe.buffers_device", "probe.buffers_dtype", "probe.projection", "probe.unit_backward",
               "probe.unit_grads_budget_mb", "probe.nograd_memory_mb", "probe.jvp_mb_size_prompts",
               "importance.is_mode", "importance.clip_c", "importance.importance_microbatch_size",
               "model.autocast", "model.autocast_bf16", "task.chat_template", "task.system_prompt", "task.tokenize",
               "task.chat_template_kwargs", "seed", "logging.progress")
# the online probe's default functional: token_mean, the mean over generated tokens of the
# full-vocabulary entropy, which TRL logs as ``entropy`` and verl as ``actor/entropy``
ONLINE_WEIGHTING = "token_mean"
# source="rollouts" also reads the trainer's loss (each prompt's Y_n)
ROLLOUT_KEYS = ONLINE_KEYS + ("objective", "probe.rollouts_prompts")  # step: the probed one (a log entry may come later)


def online_config(overrides: Mapping[str, Any], fixed: Mapping[str, Any] | None = None,
                  source: str = "held_out") -> EntprobeConfig:
    """The typed config of the online probe: ``overrides`` (the command line's keys, as
    ``entprobe.probe`` takes them) restricted to ``ONLINE_KEYS`` (``ROLLOUT_KEYS`` for
    ``source="rollouts"``), then ``fixed`` (set by an integration from its trainer: its sampling
    temperature, G, loss, ...; the user cannot override them)."""
    keys = ROLLOUT_KEYS if source == "rollouts" else ONLINE_KEYS
    choices, values = flatten_overrides(overrides)
    for key in [c.split("=")[0] for c in choices] + list(values):
        if not any(key == k or key.startswith(k + ".") for k in keys):
            raise ConfigError(f"{key}: does not apply to the online probe, which predicts the step your training "
                              f"loop takes (its gradient, optimizer and lr); it reads {', '.join(keys)}")
        if key.startswith("sampling.coupling"):  # the sampler of E here draws each response on its own stream
            raise ConfigError(f"{key}: the online probe draws its held-out E independently and the step's own batch "
                              "comes from your trainer; coupled draws are for the command line's prediction-only "
                              "runs (importance.enabled=false): leave sampling.coupling out here")
        if fixed and key in fixed:
            raise ConfigError(f"{key}: is your trainer's ({fixed[key]!r} there); the probe samples as it does")
    merged = {**dict(overrides), **dict(fixed or {})}
    merged.setdefault("logging.progress", False)
    if not any(k == "probe.weighting_mode" for k in values):  # the entropy trainers log (TRL's entropy)
        merged["probe"] = {**dict(merged.get("probe") or {}), "weighting_mode": ONLINE_WEIGHTING}
    return api_config(merged, False)[0]


def one_lr(optimizer: torch.optim.Optimizer, where: str) -> None:
    """A ConfigError when the param groups have different lrs: the probe's geometry and its
    reported ``lr`` are those of one lr (the command line's ``optimizer.lr`` does not apply here)."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    if any(lr != lrs[0] for lr in lrs):
        raise ConfigError(f"{where}: the optimizer's param groups have different lrs ({lrs}); the online probe "
                          "(and EntropyGuard) predicts a step at one lr: give every param group the same lr")
