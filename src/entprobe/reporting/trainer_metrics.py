"""The probed step in the metric names TRL's ``GRPOTrainer`` and verl's PPO trainer log, so a run
lines up with the training curves it came from (docs/metrics.md). All are of the update batch U
(the rollouts the step is taken on), except the token entropy, which is measured on E (same policy,
other prompts: the probe evaluates the entropy there).

TRL (trl/trainer/grpo_trainer.py): ``entropy`` (mean over completion tokens), ``reward``,
``reward_std``, ``frac_reward_zero_std`` (groups whose rewards are all equal),
``completions/{mean,min,max}_length``. verl (trainer/ppo/metric_utils.py, dp_actor): ``actor/entropy``
(token-mean), ``critic/score/{mean,max,min}`` (sequence reward), ``response_length/{mean,max,min}``
and ``response_length/clip_ratio`` (responses as long as the length cap).
"""
from __future__ import annotations

from entprobe.rollouts.sampling import RolloutBatch, nan_std


def trainer_metrics(U: RolloutBatch, max_new_tokens: int, token_entropy: float | None) -> dict[str, float]:
    """TRL / verl-named metrics of the global update batch ``U`` [B, G]; ``token_entropy``: the
    mean per-token entropy over E's generated tokens at theta (``token_entropy_orig``), or None."""
    r = U.rewards.double()  # NaN: unscorable responses, left out as TRL does
    scored = r[~r.isnan()] if bool(r.isnan().any()) else r
    if scored.numel() == 0:
        scored = r.new_full((1,), float("nan"))
    L = U.gen_lengths.double()
    out = {
        "reward": float(r.nanmean()), "reward_std": float(nan_std(r)) if r.numel() > 1 else 0.0,
        "frac_reward_zero_std": float((nan_std(r, -1).nan_to_num(0.0) == 0).double().mean()),
        "critic/score/mean": float(r.nanmean()), "critic/score/max": float(scored.max()),
        "critic/score/min": float(scored.min()),
        "completions/mean_length": float(L.mean()), "completions/min_length": float(L.min()),
        "completions/max_length": float(L.max()),
        "response_length/mean": float(L.mean()), "response_length/max": float(L.max()),
        "response_length/min": float(L.min()), "response_length/clip_ratio": float((L >= max_new_tokens).double().mean()),
    }
    if token_entropy is not None:
        out["actor/entropy"] = out["entropy"] = float(token_entropy)
    return out
