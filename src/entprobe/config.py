"""Structured configs: the schema of every Hydra group and its validation.

The root dataclass is registered in Hydra's ConfigStore as ``entprobe_schema`` and listed first in
``conf/config.yaml``, so composition rejects unknown keys, wrong types and values outside an
Enum's choices before any model is loaded. ``config_checks.validate(cfg)`` adds the range
checks a type cannot express (B >= 2, G >= 2, lr > 0, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from entprobe.conf_help import help_text


class WeightingMode(str, Enum):
    sequence = "sequence"
    dr_grpo = "dr_grpo"
    per_token_avg = "per_token_avg"
    token_mean = "token_mean"  # the trainers' token entropy: TRL `entropy`, verl `actor/entropy` (token-mean)
    seq_mean_token_mean = "seq_mean_token_mean"  # verl's seq-mean-token-mean of the token entropies


class XEstimator(str, Enum):
    auto = "auto"  # rao_blackwell for sums over tokens (sequence, token_mean; not with is_mode=psis), else score
    score = "score"  # (S_w - baseline) grad S over whole responses
    rao_blackwell = "rao_blackwell"  # token entropies H_t and the reward-to-go: same target, less noise


class AdvantageMode(str, Enum):
    dr_grpo = "dr_grpo"
    grpo = "grpo"


class ObjectivePreset(str, Enum):
    entprobe = "entprobe"  # entprobe's DR-GRPO form: A / (G Lmax), batch.advantage
    trl = "trl"  # TRL GRPOTrainer's loss (loss_type, scale_rewards, ...)
    verl = "verl"  # verl's actor loss (loss_agg_mode, norm_adv_by_std_in_grpo)


class ProbeMode(str, Enum):
    two_batch = "two_batch"
    single_batch = "single_batch"


class ProjectionMode(str, Enum):
    auto = "auto"  # jvp below 10M params; else stored when U's unit gradients fit the budget, else fused
    stored = "stored"  # per-unit dots during the X pass; U's per-unit gradients kept on the device
    fused = "fused"  # per-unit dots during the X pass + one forward-mode pass over U
    jvp = "jvp"  # one forward-mode pass per side (no per-unit backward; best when host-bound)
    backward = "backward"  # reference: per-unit backward, grads moved to the buffers
    ghost = "ghost"  # E's per-unit dots from layer hooks in one backward per microbatch; U as stored or fused


class Strategy(str, Enum):
    ddp = "ddp"  # every rank holds the whole model, optimizer state and probe buffers
    fsdp2 = "fsdp2"  # torch fully_shard: all of them sharded over the ranks (runtime/sharding.py)


class UnitBackward(str, Enum):
    auto = "auto"  # vmap below 10M params (host-bound), else loop
    loop = "loop"  # one backward per unit
    vmap = "vmap"  # one batched backward per microbatch (is_grads_batched): fewer ops, b x the arithmetic


class Preconditioner(str, Enum):
    adam = "adam"
    identity = "identity"


class ISMode(str, Enum):
    cv = "cv"
    snis = "snis"
    clip = "clip"
    psis = "psis"


class TrainingLoss(str, Enum):
    rl = "rl"
    nll = "nll"


class StepMode(str, Enum):
    optimizer = "optimizer"
    preconditioned_sgd = "preconditioned_sgd"


class ChatTemplate(str, Enum):
    auto = "auto"  # apply the tokenizer's chat template when it has one
    always = "always"
    never = "never"


class PromptTokenization(str, Enum):
    auto = "auto"  # as the objective's trainer: objective=trl -> trl, objective=verl -> verl, else entprobe
    entprobe = "entprobe"  # the built-in trainer's: task.chat_template / system_prompt, else BOS + text
    trl = "trl"  # TRL GRPOTrainer's: message lists through the chat template, texts as tokenizer(text)
    verl = "verl"  # verl RLHFDataset's: every prompt through the chat template (a text as one user message)


class TrainerArgs(str, Enum):
    auto = "auto"  # model=hf: read the run's settings from the checkpoint's training_args.bin (TRL GRPOConfig)
    ignore = "ignore"  # do not read it


class ModelSource(str, Enum):
    builtin = "builtin"
    hf = "hf"
    gguf = "gguf"


class Logger(str, Enum):
    wandb = "wandb"  # a wandb run (logging.wandb.mode: offline / online; disabled turns it off)
    csv = "csv"  # results.csv in the run dir
    none = "none"


class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"


class Autocast(str, Enum):
    auto = "auto"  # bf16 on CUDA when model.autocast_bf16, none on CPU (the default)
    bf16 = "bf16"  # torch.autocast(dtype=torch.bfloat16) on any device, the CPU included
    fp16 = "fp16"  # torch.autocast(dtype=torch.float16) on any device
    off = "off"  # no autocast: the parameters' dtype throughout


@dataclass
class BatchConfig:
    B_E: int = 8
    B_U: int = 8
    G: int = 4
    seed_E: int = 1
    seed_U: int = 2
    advantage: AdvantageMode = AdvantageMode.dr_grpo
    adv_eps: float = 1e-6
    save: Optional[str] = None
    load: Optional[str] = None
    lock_timeout_s: float = 3600.0
    share_across_lr: bool = True  # sweeps: jobs differing only in optimizer.lr share Stages 1-2


@dataclass
class ObjectiveConfig:
    """The update objective (conf/objective/*.yaml, docs/objectives.md); a key of the other trainer
    must stay null."""
    preset: ObjectivePreset = ObjectivePreset.entprobe
    loss_type: Optional[str] = None  # TRL GRPOConfig keys
    scale_rewards: Optional[str] = None
    max_completion_length: Optional[int] = None
    beta: Optional[float] = None
    num_iterations: Optional[int] = None
    epsilon: Optional[float] = None
    epsilon_high: Optional[float] = None
    loss_agg_mode: Optional[str] = None  # verl keys
    norm_adv_by_std_in_grpo: Optional[bool] = None
    loss_scale_factor: Optional[float] = None


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 4
    gen_microbatch_prompts: int = 16
    coupling: str = "none"  # none | stratified | antithetic: coupled draws within a prompt (coupled_uniforms.py)
    coupling_block: int = 0  # responses per coupled block (0: G // 2; antithetic: 2)
    coupling_order: str = "probability"  # probability | vocab: the coupled inverse CDF's token order
    coupling_U: bool = False  # couple U too (the step's own noise falls, and its expectation moves)


@dataclass
class WhatIfConfig:
    """``probe.what_if``: the predicted entropy change of the next step under other settings of the
    knobs users turn (docs/what_if.md). Everything is off by default (the run and its cost are then
    unchanged). ``what_if_errors`` (pipeline/config_checks.py) range-checks it."""
    lr_factors: list[float] = field(default_factory=list)  # the step at lr x f, for each f
    target_deltaH: Optional[float] = None  # the lr whose predicted change is this (nats), with its interval
    entropy_coef: list[float] = field(default_factory=list)  # verl actor.entropy_coeff values (entropy bonus)
    clip_cov: list[float] = field(default_factory=list)  # Clip-Cov clip_cov_ratio values (verl loss_mode=clip_cov)
    clip_cov_lb: float = 1.0  # verl policy_loss.clip_cov_lb
    clip_cov_ub: float = 5.0  # verl policy_loss.clip_cov_ub
    kl_cov: list[float] = field(default_factory=list)  # KL-Cov kl_cov_ratio values (verl loss_mode=kl_cov)
    ppo_kl_coef: float = 0.1  # verl policy_loss.ppo_kl_coef (KL-Cov's penalty weight)
    top_entropy_quantile: list[float] = field(default_factory=list)  # TRL GRPOConfig top_entropy_quantile values
    seed: int = 0  # Clip-Cov's random choice among the eligible tokens
    measure: bool = False  # also take each setting's real step and measure it (Stage 3 per setting)

    @property
    def enabled(self) -> bool:
        return what_if_enabled(self)


def what_if_enabled(w) -> bool:
    """Whether a ``probe.what_if`` (a WhatIfConfig or a DictConfig of one) asks for any setting."""
    return bool(w.lr_factors or w.target_deltaH is not None or w.entropy_coef or w.clip_cov or w.kl_cov
                or w.top_entropy_quantile)


@dataclass
class ProbeConfig:
    mode: ProbeMode = ProbeMode.two_batch
    mb_size_prompts: int = 2
    weighting_mode: WeightingMode = WeightingMode.token_mean
    x_estimator: XEstimator = XEstimator.auto
    buffers_device: str = "auto"
    buffers_dtype: DType = DType.float32
    variance_enabled: bool = True
    projection: ProjectionMode = ProjectionMode.auto
    unit_grads_budget_mb: float = 4096.0
    rollouts_prompts: Optional[int] = None  # online source=rollouts: X and Y on k of the step's prompts (None: all)
    unit_grads_max_copies: int = 4
    nograd_memory_mb: float = 1024.0
    jvp_mb_size_prompts: Optional[int] = None
    unit_backward: UnitBackward = UnitBackward.auto
    save_buffers: bool = False
    top_k_params: int = 10
    block_size: int = 0
    num_blocks: int = 0
    pairs_per_block: int = 0
    cross_fit: bool = False
    top_units: int = 5
    ddp_allreduce: bool = True
    what_if: WhatIfConfig = field(default_factory=WhatIfConfig)


@dataclass
class ImportanceConfig:
    enabled: bool = True
    is_mode: ISMode = ISMode.cv
    clip_c: float = 10.0
    training_loss: TrainingLoss = TrainingLoss.rl
    step_mode: StepMode = StepMode.optimizer
    reuse_probe_gradient: bool = True
    snapshot_device: str = "auto"
    importance_microbatch_size: Optional[int] = None
    rl_grad_accum: int = 1
    max_grad_norm: Optional[float] = None
    report_per_token: bool = False
    ess_threshold: float = 0.3
    resample_on_low_ess: bool = True
    update_clip_eps: float = 0.2
    update_clip_eps_high: float = 0.28
    split_step: bool = False  # also split deltaH1_step by a zero-gradient step (other optimizers' parts)


@dataclass
class OptimizerConfig:
    state_path: Optional[str] = None
    preconditioner: Preconditioner = Preconditioner.adam
    lr: Optional[float] = None
    betas: Optional[list[float]] = None
    eps: Optional[float] = None
    weight_decay: Optional[float] = None
    step: Optional[int] = None


@dataclass
class DDPConfig:
    strategy: Strategy = Strategy.ddp
    backend: str = "auto"
    find_unused_parameters: bool = True
    timeout_s: int = 1800


@dataclass
class ModelConfig:
    source: ModelSource = ModelSource.builtin
    path: Optional[str] = None
    gguf_file: Optional[str] = None
    gguf_package: Optional[str] = None
    tokenizer_path: Optional[str] = None
    base_path: Optional[str] = None  # a PEFT adapter's base model folder (checkpoints/peft.py)
    trainer_args: TrainerArgs = TrainerArgs.auto  # training_args.bin -> config keys (checkpoints/trainer_args.py)
    dtype: DType = DType.float32
    device: str = "auto"
    autocast_bf16: bool = True  # read by autocast=auto only
    autocast: Autocast = Autocast.auto  # rollouts/logprobs.py autocast_dtype
    attn_implementation: str = "eager"
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward
    trust_remote_code: bool = False
    cache_dir: Optional[str] = None
    builtin_seed: int = 0


@dataclass
class TaskConfig:
    _target_: str = "entprobe.tasks.arithmetic.ArithmeticTask"
    path: Optional[str] = None
    reward: str = "numeric"
    template: str = "{a}+{b}="  # the arithmetic task's prompt text, with the operands as {a} and {b}
    num_prompts: int = 512
    max_operand: int = 9
    seed: int = 0
    chat_template: ChatTemplate = ChatTemplate.auto
    system_prompt: Optional[str] = None
    tokenize: PromptTokenization = PromptTokenization.auto  # tasks/prompt_ids.py
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # TRL GRPOConfig / verl data key
    reward_funcs: list[str] = field(default_factory=list)  # TRL reward functions by import path (tasks/reward_funcs.py)
    reward_weights: Optional[list[float]] = None


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "entprobe"
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    job_type: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    logger: Logger = Logger.wandb
    wandb: WandbConfig = field(default_factory=WandbConfig)
    report: bool = True
    progress: bool = True
    verdict: bool = True
    console_table: bool = False
    results_file: str = "results.json"


@dataclass
class EntprobeConfig:
    batch: BatchConfig = field(default_factory=BatchConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str = "."
    seed: int = 0


def register_configs() -> None:
    """Register the root schema (config.yaml lists it first, so every group is typed by it) and the
    ``entprobe_keys`` resolver that ``--help`` lists the documented keys with (conf_help.py)."""
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="entprobe_schema", node=EntprobeConfig)
    if not OmegaConf.has_resolver("entprobe_keys"):
        OmegaConf.register_new_resolver("entprobe_keys", help_text)


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the key and what to change."""


def structured(cfg) -> "EntprobeConfig":
    """A composed DictConfig merged onto the schema (rejects unknown keys, wrong types and bad
    choices) as the typed object; a typed object is returned as it is. Range checks:
    ``pipeline.config_checks.validate`` (``to_typed`` does both)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return cfg
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EntprobeConfig), plain))


ONLINE_ONLY = "probe.rollouts_prompts"


def check_offline(cfg: "EntprobeConfig") -> None:
    """The keys only the online probe reads (``source="rollouts"``), refused for the command line's job and
    ``entprobe.probe``, which probe E and U of their own."""
    if cfg.probe.rollouts_prompts is not None:
        raise ConfigError(f"{ONLINE_ONLY}={cfg.probe.rollouts_prompts}: applies to the online probe's source='rollouts' "
                          "(OnlineProbe, the TRL callbacks), which probes k of a training step's prompts; this job "
                          "probes its own E and U: leave it out (or set batch.B_E)")
