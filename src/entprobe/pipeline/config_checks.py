"""Range checks a type cannot express, run on every composed config before a model is loaded
(``validate``); each failure is a ``ConfigError`` naming the key and what to change. The checks of
one area that live with its code (objectives, prompt styles, sharding, reward weights) are
collected here too."""
from __future__ import annotations

import math
from typing import Any

from entprobe.math.token_functionals import TOKEN_MODES
from entprobe.pipeline.stages.x_spec import PER_DECISION_IS_MODES as PER_DECISION_ESTIMATORS, resolve_x_estimator
from entprobe.config import (ConfigError, EntprobeConfig, ModelSource, ProbeMode, WeightingMode, structured,
                             what_if_enabled)
from entprobe.rollouts.coupled_uniforms import coupling_errors
from entprobe.rollouts.objectives import config_errors
from entprobe.tasks.prompt_ids import style_errors
from entprobe.runtime.sharding import config_errors as sharding_errors, defaults_to_turn_off
from entprobe.tasks.reward_funcs import weight_errors
from entprobe.checkpoints.trainer_args import explicit_keys, with_trainer_args
from entprobe.runtime import distributed as D
from entprobe.pipeline.config_errors import schema_error
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


# the largest probe.what_if lr factor / entropy coefficient (validate): beyond it the what-if's step is no
# step of this run, and the values that overflow are far beyond it (an lr factor of 1e308: lr x factor is
# no float32 step size; a coefficient of 1e30: the bonus gradient squared in Adam's second moment is inf)
WHAT_IF_MAX = 1e6
JSONL_TASK = "entprobe.tasks.jsonl.JsonlTask"  # task=jsonl's _target_ (conf/task/jsonl.yaml)



def what_if_errors(cfg) -> list[tuple[str, str]]:
    """``(key, message)`` for every out-of-range ``probe.what_if`` value of a config (an
    EntprobeConfig or a DictConfig of one); empty when the what-if settings are valid."""
    w = cfg.probe.what_if
    out = []

    def bad_list(key, xs, ok, what):
        seen = {}  # a repeat (to 6 significant digits) would share one results key: one value lost
        for x in xs:
            if not (isinstance(x, (int, float)) and math.isfinite(x) and ok(x)):
                out.append((f"probe.what_if.{key}", f"has {x}; {what}"))
                return
            if f"{x:g}" in seen:
                return out.append((f"probe.what_if.{key}", f"has {seen[f'{x:g}']} and {x}, the same setting to 6 "
                                   "significant digits (one results key); give each value once"))
            seen[f"{x:g}"] = x
    bad_list("lr_factors", w.lr_factors, lambda x: x > 0, "each factor must be a finite number > 0")
    bad_list("entropy_coef", w.entropy_coef, lambda x: x >= 0, "each coefficient must be a finite number >= 0")
    bad_list("clip_cov", w.clip_cov, lambda x: 0 < x <= 1, "each ratio is a fraction of U's tokens in (0, 1]")
    bad_list("kl_cov", w.kl_cov, lambda x: 0 < x <= 1, "each ratio is a fraction of U's tokens in (0, 1]")
    bad_list("top_entropy_quantile", w.top_entropy_quantile, lambda x: 0 < x <= 1,
             "each is the fraction of U's tokens kept (the highest-entropy ones), in (0, 1]")
    t = w.target_deltaH
    if t is not None and not (math.isfinite(t) and t != 0):
        out.append(("probe.what_if.target_deltaH", f"is {t}; give a finite nonzero change in nats (or null)"))
    if not (math.isfinite(w.clip_cov_lb) and math.isfinite(w.clip_cov_ub) and w.clip_cov_lb < w.clip_cov_ub):
        out.append(("probe.what_if.clip_cov_lb", f"is {w.clip_cov_lb} with clip_cov_ub {w.clip_cov_ub}; "
                    "need finite bounds with clip_cov_lb < clip_cov_ub"))
    if not (math.isfinite(w.ppo_kl_coef) and w.ppo_kl_coef >= 0):
        out.append(("probe.what_if.ppo_kl_coef", f"is {w.ppo_kl_coef}; must be a finite number >= 0"))
    if not 0 <= w.seed < 2**63:  # torch.Generator's range: a larger one failed after the passes
        out.append(("probe.what_if.seed", f"is {w.seed}; seeds must be in [0, 2^63)"))
    if not what_if_enabled(w):
        if w.measure:
            out.append(("probe.what_if.measure", "is true but no what-if setting is given: set lr_factors, "
                        "entropy_coef, clip_cov, kl_cov or top_entropy_quantile too"))
        return out
    mode = getattr(cfg.probe.mode, "value", cfg.probe.mode)
    if mode != "two_batch":
        out.append(("probe.what_if", f"is set with probe.mode={mode}: what-if predictions need the two-batch "
                    "probe (a held-out E to project each setting's step on); use probe.mode=two_batch"))
    i = cfg.importance
    if w.measure and not i.enabled:
        out.append(("probe.what_if.measure", "needs the ground truth: set importance.enabled=true"))
    if w.measure and not (i.reuse_probe_gradient and getattr(i.training_loss, "value", i.training_loss) == "rl"):
        out.append(("probe.what_if.measure", "steps on each setting's own gradient: set "
                    "importance.reuse_probe_gradient=true and importance.training_loss=rl"))
    return out

def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _finite(*xs) -> bool:
    return all(x is None or (isinstance(x, (int, float)) and math.isfinite(x)) for x in xs)


def _device_spec(spec: str) -> bool:
    if spec == "auto":
        return True
    import torch

    try:
        torch.device(spec)
    except (RuntimeError, ValueError):
        return False
    return True


def validate(cfg: Any) -> None:
    """Range checks a type cannot express. ``cfg`` is an EntprobeConfig or a DictConfig of one."""
    b, s, p, i = cfg.batch, cfg.sampling, cfg.probe, cfg.importance
    for key, v in (("batch.adv_eps", b.adv_eps), ("batch.lock_timeout_s", b.lock_timeout_s),
                   ("sampling.temperature", s.temperature), ("sampling.top_p", s.top_p),
                   ("probe.unit_grads_budget_mb", p.unit_grads_budget_mb),
                   ("probe.nograd_memory_mb", p.nograd_memory_mb), ("importance.clip_c", i.clip_c),
                   ("importance.max_grad_norm", i.max_grad_norm), ("importance.ess_threshold", i.ess_threshold),
                   ("importance.update_clip_eps", i.update_clip_eps),
                   ("importance.update_clip_eps_high", i.update_clip_eps_high),
                   ("optimizer.lr", cfg.optimizer.lr), ("optimizer.eps", cfg.optimizer.eps),
                   ("optimizer.weight_decay", cfg.optimizer.weight_decay)):
        _require(_finite(v), key, f"is {v}; must be a finite number")
    for key, v in (("seed", cfg.seed), ("batch.seed_E", b.seed_E), ("batch.seed_U", b.seed_U),
                   ("model.builtin_seed", cfg.model.builtin_seed), ("task.seed", cfg.task.seed)):
        # streams derive from seeds by small offsets (seed + 7919, seed_E + 1_000_003 * step) and
        # torch.Generator takes 64 bits: a seed past 2^32 failed with a raw overflow after loading
        _require(0 <= v < 2**32, key, f"is {v}; seeds must be in [0, 2^32)")
    t = cfg.task
    path_unset = OmegaConf.is_missing(t, "path") if isinstance(t, DictConfig) else t.path in (None, "???")
    if t._target_ == JSONL_TASK and (path_unset or not t.path):
        raise ConfigError("task.path is not set: task=jsonl needs task.path=FILE.jsonl (one prompt record per line)")
    _require(b.adv_eps > 0, "batch.adv_eps", f"is {b.adv_eps}; must be > 0 (GRPO divides by std + adv_eps)")
    _require(b.lock_timeout_s >= 0, "batch.lock_timeout_s", f"is {b.lock_timeout_s}; seconds to wait, >= 0")
    _require(b.G >= 2, "batch.G", f"is {b.G}; need >= 2 responses per prompt for the "
             "leave-one-out baseline and group advantages")
    if p.mode == ProbeMode.two_batch:
        _require(b.B_E >= 2, "batch.B_E", f"is {b.B_E}; need >= 2 prompts for a variance")
        _require(b.B_U >= 2, "batch.B_U", f"is {b.B_U}; need >= 2 prompts for a variance")
    else:
        _require(b.B_U >= 2, "batch.B_U", f"is {b.B_U}; single_batch mode uses B_U prompts, need >= 2")
        _require(not i.enabled or b.B_E >= 2, "batch.B_E", f"is {b.B_E}; single_batch measures the step on a "
                 "fresh batch of B_E prompts (importance.enabled), need >= 2")
    _require(s.temperature > 0, "sampling.temperature", "must be > 0")
    _require(s.top_k >= 0, "sampling.top_k", "must be >= 0 (0 disables top-k)")
    _require(0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
    _require(s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
    _require(s.gen_microbatch_prompts >= 1, "sampling.gen_microbatch_prompts", "must be >= 1")
    for key, msg in coupling_errors(cfg)[:1]:
        raise ConfigError(f"{key}: {msg}")
    _require(p.mb_size_prompts >= 1, "probe.mb_size_prompts", "must be >= 1")
    _require(p.jvp_mb_size_prompts is None or p.jvp_mb_size_prompts >= 1, "probe.jvp_mb_size_prompts",
             "must be >= 1 (or null: sized from nograd_memory_mb)")
    _require(p.unit_grads_budget_mb >= 0, "probe.unit_grads_budget_mb", "must be >= 0 (0: never store)")
    _require(p.unit_grads_max_copies >= 0, "probe.unit_grads_max_copies", "must be >= 0")
    _require(p.rollouts_prompts is None or (isinstance(p.rollouts_prompts, int) and p.rollouts_prompts >= 3),
             "probe.rollouts_prompts", f"is {p.rollouts_prompts!r}; must be an integer >= 3 (or null: every prompt)")
    _require(p.nograd_memory_mb >= 0, "probe.nograd_memory_mb", "must be >= 0")
    _require(p.buffers_device in ("auto", "cpu", "model") or p.buffers_device.startswith("cuda"),
             "probe.buffers_device", f"is {p.buffers_device!r}; use auto, cpu, model or cuda[:N]")
    _require(p.block_size >= 0 and p.num_blocks >= 0 and p.pairs_per_block >= 0,
             "probe.block_size/num_blocks/pairs_per_block", "must be >= 0")
    _require(not (p.block_size and p.num_blocks), "probe.block_size",
             "set block_size or num_blocks, not both")
    _require(p.top_k_params >= 0, "probe.top_k_params", f"is {p.top_k_params}; must be >= 0")
    _require(p.top_units >= 0, "probe.top_units", f"is {p.top_units}; must be >= 0")
    _require(i.clip_c > 0, "importance.clip_c", "must be > 0")
    _require(i.max_grad_norm is None or i.max_grad_norm > 0, "importance.max_grad_norm",
             f"is {i.max_grad_norm}; must be > 0 (or null: no clipping)")
    _require(i.update_clip_eps >= 0 and i.update_clip_eps_high >= 0, "importance.update_clip_eps/_high",
             "must be >= 0")
    _require(not (p.cross_fit and p.weighting_mode == WeightingMode.dr_grpo), "probe.cross_fit",
             "needs a weighting mode whose functional is a mean over responses (sequence or "
             "per_token_avg): dr_grpo's couples the whole group through Lmax, so X cannot use half of it")
    x_est = resolve_x_estimator(p.weighting_mode, p.x_estimator, i.is_mode)  # a ConfigError when it does not apply
    _require(not (p.cross_fit and (x_est == "rao_blackwell" or p.weighting_mode.value in TOKEN_MODES)),
             "probe.cross_fit", f"splits each group into an X half and a Y half of whole responses; the "
             f"{p.weighting_mode.value} / {x_est} X is built per token: use probe.x_estimator=score with "
             "weighting_mode sequence or per_token_avg")
    _require(x_est != "rao_blackwell" or i.is_mode.value in PER_DECISION_ESTIMATORS, "importance.is_mode",
             f"is {i.is_mode.value}; the Rao-Blackwellised X (probe.x_estimator={p.x_estimator.value} with "
             f"weighting_mode={p.weighting_mode.value}) is measured with per-decision weights, which offer "
             f"{' and '.join(PER_DECISION_ESTIMATORS)}: use one of them, or probe.x_estimator=score")
    _require(0 <= i.ess_threshold <= 1, "importance.ess_threshold", "is a fraction ESS/N in [0, 1]")
    _require(i.importance_microbatch_size is None or i.importance_microbatch_size >= 1,
             "importance.importance_microbatch_size", "must be >= 1 (or null: sized from nograd_memory_mb)")
    _require(i.rl_grad_accum >= 1, "importance.rl_grad_accum", "must be >= 1")
    _require(i.snapshot_device in ("auto", "cpu", "gpu", "model"), "importance.snapshot_device",
             f"is {i.snapshot_device!r}; use auto, cpu or gpu")
    _require(cfg.ddp.timeout_s > 0, "ddp.timeout_s", f"is {cfg.ddp.timeout_s}; seconds, must be > 0")
    _require(cfg.ddp.backend in ("auto", "nccl", "gloo", "mpi", "ucc"), "ddp.backend",
             f"is {cfg.ddp.backend!r}; use auto, nccl or gloo")
    _require(_device_spec(cfg.model.device), "model.device", f"is {cfg.model.device!r}; use auto, cpu, cuda or cuda:N")
    _require(cfg.task.num_prompts >= 0, "task.num_prompts", f"is {cfg.task.num_prompts}; must be >= 0 (0: all)")
    _require(cfg.task.max_operand >= 0, "task.max_operand", f"is {cfg.task.max_operand}; must be >= 0")
    _require(cfg.model.source != ModelSource.hf or bool(cfg.model.path), "model.path",
             "is required with model=hf: the save_pretrained checkpoint folder")
    _require(not cfg.model.base_path or cfg.model.source == ModelSource.hf, "model.base_path",
             "is the base model of a PEFT adapter folder given as model.path: use it with model=hf")
    o = cfg.optimizer
    _require(o.lr is None or o.lr > 0, "optimizer.lr", "must be > 0")
    _require(o.betas is None or len(o.betas) == 2, "optimizer.betas", "must be [beta1, beta2]")
    _require(o.betas is None or all(0 <= x < 1 for x in o.betas), "optimizer.betas",
             f"is {o.betas}; each beta must be in [0, 1)")
    _require(o.eps is None or o.eps > 0, "optimizer.eps", f"is {o.eps}; must be > 0")
    _require(o.step is None or o.step >= 1, "optimizer.step", f"is {o.step}; the steps already taken, >= 1")
    _require(o.weight_decay is None or o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    for key, msg in config_errors(cfg.objective, cfg) + style_errors(cfg) + sharding_errors(cfg) + \
            weight_errors(cfg.task.reward_funcs, cfg.task.reward_weights) + what_if_errors(cfg):
        _require(False, key, msg)
    w = p.what_if  # before the passes, not after Stages 1-2 as the stage itself would find it
    for key, xs, why in (("probe.what_if.lr_factors", w.lr_factors, "a millionfold lr is no step of this run, "
                          "and past ~1e30 lr x factor is no float32 step size"),
                         ("probe.what_if.entropy_coef", w.entropy_coef, "a bonus a million times the policy loss "
                          "(advantages of order 1) is no step of this run, and past ~1e19 its gradient squared "
                          "overflows Adam's float32 second moment")):
        big = [x for x in xs if isinstance(x, (int, float)) and x > WHAT_IF_MAX]
        _require(not big, key, f"has {big[0] if big else ''}; give values <= {WHAT_IF_MAX:g} ({why})")
    _require(not ((w.clip_cov or w.kl_cov or w.top_entropy_quantile) and D.launched_distributed()),
             "probe.what_if.clip_cov/kl_cov/top_entropy_quantile", "select tokens over U on one process; run "
             "this what-if without torchrun (or drop those settings)")
    _require(cfg.logging.wandb.mode in ("disabled", "offline", "online"), "logging.wandb.mode",
             f"is {cfg.logging.wandb.mode!r}; use disabled, offline or online")
    logger = getattr(cfg.logging.logger, "value", cfg.logging.logger)
    _require(logger == "wandb" or cfg.logging.wandb.mode != "online", "logging.logger",
             f"is {logger} but logging.wandb.mode=online asks for a wandb run: set logging.logger=wandb, "
             "or drop logging.wandb.mode=online")


def to_typed(cfg, explicit: list[str] | None = None, ranges: bool = True) -> EntprobeConfig:
    """The typed config of a composed one (``config.structured``: the schema merge), range-checked
    (``validate``): what every entry point runs first. ``explicit``: the overrides the user gave (the
    command line's); with them, a model=hf checkpoint's training_args.bin fills the keys they leave
    (``checkpoints.trainer_args``; None: not read), and a default setting FSDP2 cannot run is turned
    off with a printed note (``sharding.defaults_to_turn_off``; one the user set is refused). A key
    the schema does not have (``+batch.BE=16``) or a value of the wrong type is a ConfigError naming
    the override (``config_errors.schema_error``: the nearest key, the type wanted). ``ranges=False``:
    the schema only, no ``validate``."""
    if explicit is not None and isinstance(cfg, DictConfig):
        cfg = with_trainer_args(cfg, explicit, show=D.env_rank() == 0)
        for key, off, why in defaults_to_turn_off(cfg, explicit_keys(explicit)):
            OmegaConf.update(cfg, key, off, merge=False)
            if D.env_rank() == 0:
                print(f"entprobe: note: ddp.strategy=fsdp2 sets {key}={str(off).lower()} ({why}); "
                      f"use ddp.strategy=ddp to keep it", flush=True)
    try:
        obj = structured(cfg)
    except OmegaConfBaseException as exc:  # +key=value Hydra let through, a value of the wrong type: one line
        raise schema_error(exc, explicit) from exc
    if ranges:
        validate(obj)
    return obj
