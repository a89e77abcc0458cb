"""What ``source="rollouts"`` reads from TRL's GRPOTrainer: the step's own batch and the norm of its
gradient before clipping, and the trainer's loss as entprobe's objective.

``StepBatch.install(trainer)`` wraps three of the trainer's methods on the instance (not the
class): ``_generate_and_score_completions`` (its output, the generation batch of the coming optimizer
step: prompt-major rows, before the trainer shuffles them), ``_calculate_rewards`` (each completion's
reward per function, weighted by ``reward_weights`` as TRL sums them: for ``scale_rewards="batch"``'s
coupling) and ``_clip_grad_norm`` (its return: the norm before clipping). ``paused()`` keeps the
held-out sampling (the measurement's E, also made by the trainer's generation) out of them.
``uninstall()`` puts the trainer's own methods back.
"""
from __future__ import annotations

import contextlib

import torch

from entprobe.config import ConfigError
from entprobe.rollouts.sampling import RolloutBatch

WRAPPED = ("_generate_and_score_completions", "_calculate_rewards", "_clip_grad_norm")


def trl_rollout_batch(inputs: dict, G: int, temperature: float) -> RolloutBatch:
    """A GRPOTrainer generation batch (``prompt_ids`` left-padded, ``completion_ids`` right-padded,
    their masks, ``advantages``; rows prompt-major, G per prompt as its sampler yields them, before
    the trainer shuffles them) as a RolloutBatch [B, G, T]. Rewards are not carried (zeros): the
    probe of E reads responses only."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1).cpu()
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).long().cpu()
    resp = torch.cat([torch.zeros_like(inputs["prompt_mask"]), inputs["completion_mask"]], 1).long().cpu()
    N, T = ids.shape
    if N % G:
        raise ValueError(f"a generation batch of {N} rows is not G={G} responses per prompt")
    B = N // G
    P = inputs["prompt_ids"].shape[1]
    grouped = ids[:, :P].view(B, G, P)
    if not bool((grouped == grouped[:, :1]).all()):
        raise ValueError("the generation batch's rows are not grouped by prompt (G consecutive rows each)")
    return RolloutBatch(ids.view(B, G, T), att.view(B, G, T), resp.view(B, G, T), torch.zeros(B, G, T),
                        torch.zeros(B, G), inputs["advantages"].detach().float().cpu().view(B, G),
                        torch.arange(B), float(temperature))


def trl_objective(trainer) -> dict:
    """The online config's ``objective`` keys of the trainer's loss (``GRPOConfig``): TRL's preset with
    its ``loss_type``, ``scale_rewards``, ``max_completion_length``, ``beta``, ``epsilon``,
    ``epsilon_high`` (docs/objectives.md). A loss the probe cannot split by prompt is refused."""
    a = trainer.args
    out = {"objective": "trl", "objective.loss_type": str(a.loss_type),
           "objective.scale_rewards": a.scale_rewards if isinstance(a.scale_rewards, str) else
           ("group" if a.scale_rewards else "none"),
           "objective.max_completion_length": int(a.max_completion_length),
           "objective.beta": float(a.beta), "objective.epsilon": float(a.epsilon)}
    if getattr(a, "epsilon_high", None) is not None:
        out["objective.epsilon_high"] = float(a.epsilon_high)
    if float(a.beta) != 0.0:
        raise ConfigError(f"GRPOConfig.beta={a.beta}: source='rollouts' splits the loss by prompt and has no KL term; "
                          "use beta=0, or source='held_out'")
    for name, neutral in (("top_entropy_quantile", 1.0), ("mask_truncated_completions", False)):
        if getattr(a, name, neutral) != neutral:
            raise ConfigError(f"GRPOConfig.{name}={getattr(a, name)!r}: changes which tokens the loss sees, which "
                              "source='rollouts' does not model; use source='held_out'")
    return out


def trl_entropy_coef(trainer) -> float:
    """The coefficient of TRL's entropy bonus in the loss of the step just computed (``L_policy - c H``): 0
    when the bonus is off, ``entropy_coef`` (TRL 1.16), under ``use_adaptive_entropy`` only while the last
    step's entropy was at or below ``entropy_target`` (TRL's gate). A bonus with gradient accumulation is
    refused: TRL takes its mean over each micro-batch's tokens, which the probe does not split."""
    if not getattr(trainer, "_entropy_bonus_enabled", False):
        return 0.0
    a = trainer.args
    c = float(trainer.entropy_coef)
    if getattr(a, "use_adaptive_entropy", False) and not trainer._last_world_entropy <= a.entropy_target:
        c = 0.0
    if c != 0.0 and a.gradient_accumulation_steps != 1:
        raise ConfigError(f"GRPOConfig.gradient_accumulation_steps={a.gradient_accumulation_steps} with an entropy bonus "
                          f"(entropy_coef={c:g}): source='rollouts' needs one micro-batch a step; use 1, or "
                          "source='held_out'")
    return c


# |kappa_probe / kappa_trl - 1| at most this: the trainer's logged entropy is the probe's token_mean constant.
# Both are fp32 forwards over the same tokens (batch widths and kernels differ: ~1e-6 apart); a different
# temperature, mask or model moves it by far more
KAPPA_AGREES = 1e-4


def trl_token_entropy(trainer) -> float | None:
    """The step's ``sum H / sum L`` over its generated tokens as TRL's loss forward computed it (its
    logged ``entropy``, the last value of the step: ``_compute_loss``'s ``global_masked_mean``), when
    that forward saw the whole generation batch (``gradient_accumulation_steps=1``) and only the
    completion mask (no ``tool_mask``); else None."""
    if trainer.args.gradient_accumulation_steps != 1:
        return None
    out = getattr(trainer, "_metrics", {}).get("train", {}).get("entropy")
    batch = getattr(trainer, "_buffered_inputs", None)
    if not out or (batch and any("tool_mask" in b for b in batch)):
        return None
    value = float(out[-1])
    return value if value == value and value >= 0 else None


def kappa_agrees(probe_kappa: float | None, trl_kappa: float) -> bool:
    """Whether the probe's own token_mean constant (its forward) and TRL's logged entropy are one number
    (``KAPPA_AGREES``): then later probes take TRL's and skip that forward."""
    if probe_kappa is None or not trl_kappa > 0:
        return False
    return abs(probe_kappa / trl_kappa - 1.0) <= KAPPA_AGREES


class StepBatch:
    """The trainer's last generation batch (``batch``), its rewards and the last pre-clip gradient
    norm (``grad_norm``), recorded by wrappers of the trainer's methods (module docstring)."""

    def __init__(self):
        self.output: dict | None = None
        self.rewards: torch.Tensor | None = None
        self.grad_norm: float | None = None
        self._paused = False
        self._trainer = None

    def install(self, trainer) -> None:
        self.uninstall()
        self._trainer = trainer
        own = {name: getattr(trainer, name) for name in WRAPPED if hasattr(trainer, name)}
        self._own = {name: trainer.__dict__.get(name) for name in own}

        def generate(inputs, *args, **kwargs):
            out = own["_generate_and_score_completions"](inputs, *args, **kwargs)
            if not self._paused:
                self.output = out
            return out

        def rewards(*args, **kwargs):
            r = own["_calculate_rewards"](*args, **kwargs)
            if not self._paused:
                w = trainer.reward_weights.to(r.device, r.dtype)
                self.rewards = (r * w.unsqueeze(0)).nansum(dim=1).detach().float().cpu()
            return r

        def clip(*args, **kwargs):
            n = own["_clip_grad_norm"](*args, **kwargs)
            self.grad_norm = float(n)
            return n
        for name, fn in (("_generate_and_score_completions", generate), ("_calculate_rewards", rewards),
                         ("_clip_grad_norm", clip)):
            if name in own:
                setattr(trainer, name, fn)

    def uninstall(self) -> None:
        tr = self._trainer
        if tr is None:
            return
        for name, was in self._own.items():
            if was is None:
                tr.__dict__.pop(name, None)
            else:
                setattr(tr, name, was)
        self._trainer = None

    @contextlib.contextmanager
    def paused(self):
        """Generation inside the block is not the step's batch (the measurement's E)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def batch(self, G: int, temperature: float) -> RolloutBatch:
        """The step's generation batch as a RolloutBatch [B, G, T] with the trainer's advantages and
        rewards (``trl_rollout_batch``)."""
        if self.output is None:
            raise RuntimeError("source='rollouts': no generation batch was recorded for this step")
        b = trl_rollout_batch(self.output, G, temperature)
        if self.rewards is not None and self.rewards.numel() == b.B * G:
            b.rewards = self.rewards.view(b.B, G)
        return b
