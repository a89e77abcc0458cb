"""The update objective: which loss the probed step descends (docs/objectives.md).

Every supported trainer's policy loss, at the first iteration on a batch (ratio ``pi / pi_old = 1``,
no reference-model term), has a gradient of the form ``-sum_{n,g} W[n,g] grad S[n,g]``: each token of
response g of prompt n carries the same weight, so the loss is a weighted sum of sequence
log-probs S. An ``Objective`` gives those weights per prompt (unit): ``Y_n = sum_g w[n,g] grad S[n,g]``
with ``w = B W`` (B prompts in U), so that ``Ybar = mean_n Y_n`` is exactly minus the loss gradient.

Aggregations (A the preset's advantage, L[n,g] the generated length with EOS, Lmax[n] the group's
longest, G responses per prompt, B prompts, ``T = sum_{n,g} L`` the batch's tokens, ``Tbar = T / B``):

| aggregation | per-unit weight ``w[n,g]`` | trainers |
|---|---|---|
| ``group_lmax`` | ``A / (G Lmax[n])`` | entprobe (its DR-GRPO form) |
| ``seq_token_mean`` | ``c A / (G L[n,g])`` | TRL grpo, sapo; verl seq-mean-token-mean |
| ``seq_token_sum`` | ``c A / G`` | TRL luspo; verl seq-mean-token-sum |
| ``seq_constant`` | ``c A / (G C)``, C a constant length | TRL dr_grpo (C = max_completion_length); verl seq-mean-token-sum-norm (C = loss_scale_factor) |
| ``token_mean`` | ``c A / Tbar`` | TRL bnpo, dapo, cispo, vespo; verl token-mean |
| ``token_sum`` | ``c A B`` | verl token-sum |

``c`` is the per-token gradient factor at ratio 1 (1, except TRL cispo's ``min(1, epsilon_high)``).

``token_mean`` couples the prompts through T: ``Ybar = sum_n N_n / sum_n T_n`` (``N_n = sum_g A grad S``,
``T_n = sum_g L``) is a ratio estimator. ``mean_n Y_n = Ybar`` exactly, but the spread of the Y_n
alone misses the variability of the denominator; its first-order (delta-method) influence is
``Y_n - Ybar (T_n / Tbar - 1)``. TRL's ``scale_rewards=batch`` divides every advantage by the
batch's reward std ``sigma`` (+ 1e-4), another batch statistic: its influence adds
``- Ybar (v_n - vbar) / (2 sigma (sigma + 1e-4))`` with ``v_n = mean_g (r[n,g] - rbar)^2``. Both are
``Y_n - k_n Ybar`` with a per-unit ``k_n`` of mean zero (``Objective.coupling``); any linear
functional of the units (a projection ``b_n = Y_n . d``) is linearised the same way
(``Objective.linearize``), so the variance of the mean of the linearised units is the delta-method
variance of Ybar's projection (first order in 1/B).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from entprobe.math import estimators as est
from entprobe.rollouts.sampling import centred_rewards, finish_advantages, nan_std

AGGREGATIONS = ("group_lmax", "seq_token_mean", "seq_token_sum", "seq_constant", "token_mean", "token_sum")
# TRL GRPOTrainer loss_type (trl/trainer/grpo_trainer.py, ``_compute_loss``) -> aggregation
TRL_LOSS_TYPES = {"grpo": "seq_token_mean", "sapo": "seq_token_mean", "dr_grpo": "seq_constant",
                  "bnpo": "token_mean", "dapo": "token_mean", "cispo": "token_mean", "vespo": "token_mean",
                  "luspo": "seq_token_sum"}
TRL_SCALE_REWARDS = ("group", "batch", "none")
TRL_STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)
# verl actor.loss_agg_mode (verl/trainer/ppo/core_algos.py, ``agg_loss``) -> aggregation
VERL_LOSS_AGG_MODES = {"token-mean": "token_mean", "token-sum": "token_sum",
                       "seq-mean-token-sum": "seq_token_sum", "seq-mean-token-mean": "seq_token_mean",
                       "seq-mean-token-sum-norm": "seq_constant"}
VERL_STD_EPS = 1e-6  # verl compute_grpo_outcome_advantage: (r - mean) / (std + epsilon)


@dataclass(frozen=True, eq=False)
class Objective:
    """The update objective bound to one U batch (its batch constants and per-unit coupling).

    ``constant``: C for ``seq_constant``, Tbar for ``token_mean``, B for ``token_sum`` (unused
    otherwise); ``factor``: the per-token gradient factor c; ``coupling``: ``k_n`` [B_U] of the
    linearisation (None when the units do not depend on each other)."""
    name: str = "entprobe"
    aggregation: str = "group_lmax"
    factor: float = 1.0
    constant: float = 1.0
    coupling: torch.Tensor | None = None

    def unit_weights(self, A: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
        """``w[n,g]`` [n, G] with ``Y_n = sum_g w[n,g] grad S[n,g]`` (table in the module docstring)."""
        return unit_weights(self.aggregation, A, L, Lmax, self.factor, self.constant)

    def y_loss(self, S: torch.Tensor, A: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
        """``sum_n sum_g w[n,g] S[n,g]``: its gradient is ``sum_n Y_n`` (entprobe: ``estimators.y_loss``)."""
        if self.aggregation == "group_lmax":
            return est.y_loss(S, A, Lmax)
        return (self.unit_weights(A.to(S.dtype), L, Lmax).to(S.dtype) * S).sum()

    def effective_advantages(self, A: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
        """``G Lmax[n] w[n,g]``: the advantage that entprobe's ``A / (G Lmax)`` would turn into this
        objective's weight (A itself for entprobe); what ``deltaH_cov`` correlates with S_w."""
        if self.aggregation == "group_lmax":
            return A
        G = A.shape[-1]
        return self.unit_weights(A, L, Lmax) * G * Lmax.clamp(min=1).unsqueeze(-1).to(A.dtype)

    def token_weights(self, L: torch.Tensor, Lmax: torch.Tensor) -> torch.Tensor:
        """``u[n,g]`` [n, G] such that the objective's aggregation of a per-token value v (verl's
        ``agg_loss`` with this ``loss_agg_mode``: what an entropy bonus is aggregated with) is
        ``(1/B) sum_{n,g} u[n,g] sum_t v[n,g,t]``: the unit weights with A = 1 and no per-token
        factor (token-mean: ``1/Tbar``; entprobe's ``group_lmax``: ``1/(G Lmax)``)."""
        ones = torch.ones(L.shape, dtype=torch.float64)
        return unit_weights(self.aggregation, ones, L.to(ones.device), Lmax.to(ones.device), 1.0, self.constant)

    @property
    def coupled(self) -> bool:
        """Whether a unit's Y depends on the rest of the batch (then only linearised SEs exist)."""
        return self.coupling is not None

    def linearize(self, b: torch.Tensor) -> torch.Tensor:
        """Per-unit projections ``b [B, k]`` (or ``[B]``) of the ``Y_n`` onto fixed directions ->
        those of their first-order influences ``b_n - k_n mean(b)`` (identity when uncoupled)."""
        if self.coupling is None:
            return b
        k = self.coupling.to(b.device, torch.float64)
        if k.numel() != b.shape[0]:
            raise ValueError(f"objective {self.name}: {b.shape[0]} unit projections, but the objective "
                             f"was bound to a batch of {k.numel()} prompts")
        bd = b.double()
        kk = k if bd.dim() == 1 else k.unsqueeze(-1)
        return (bd - kk * bd.mean(0, keepdim=bd.dim() > 1)).to(b.dtype)


ENTPROBE = Objective()


def unit_weights(aggregation: str, A: torch.Tensor, L: torch.Tensor, Lmax: torch.Tensor, factor: float = 1.0,
                 constant: float = 1.0) -> torch.Tensor:
    """Per-unit response weights ``w[n,g]`` of an aggregation (module docstring), [n, G].

    A [n, G] advantages, L [n, G] generated lengths, Lmax [n]; ``constant`` is C (``seq_constant``),
    Tbar (``token_mean``) or B (``token_sum``)."""
    G = A.shape[-1]
    if aggregation == "group_lmax":
        return est.y_unit_coeffs(A, Lmax)
    if aggregation == "seq_token_mean":
        return factor * A / (G * L.clamp(min=1).to(A.dtype))
    if aggregation == "seq_token_sum":
        return factor * A / G
    if aggregation == "seq_constant":
        return factor * A / (G * constant)
    if aggregation == "token_mean":
        return factor * A / constant
    if aggregation == "token_sum":
        return factor * A * constant
    raise ValueError(f"unknown aggregation {aggregation!r}; one of {AGGREGATIONS}")


def trl_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """TRL GRPOTrainer's advantages of one generation batch [B, G] (``sum_then_normalize``):
    ``r - mean_g r``, divided by ``std + 1e-4`` with the group's std (``group``) or the whole
    batch's (``batch``), or not (``none``); std with Bessel's correction. NaN rewards (unscorable
    responses) are left out of means and stds and get advantage 0, as in TRL."""
    centred = centred_rewards(rewards)
    if scale_rewards == "group":
        centred = centred / (nan_std(rewards, -1, keepdim=True) + TRL_STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (nan_std(rewards) + TRL_STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r}; one of {TRL_SCALE_REWARDS}")
    return finish_advantages(centred)


def verl_advantages(rewards: torch.Tensor, norm_adv_by_std: bool) -> torch.Tensor:
    """verl's GRPO outcome advantage [B, G]: ``r - mean_g r``, divided by ``std_g r + 1e-6``
    (Bessel's correction) when ``norm_adv_by_std_in_grpo`` (NaN rewards as in ``trl_advantages``)."""
    centred = centred_rewards(rewards)
    if norm_adv_by_std:
        centred = centred / (nan_std(rewards, -1, keepdim=True) + VERL_STD_EPS)
    return finish_advantages(centred)


def token_coupling(L: torch.Tensor) -> torch.Tensor:
    """``k_n = T_n / Tbar - 1`` [B] of a token-mean ratio estimator (``T_n = sum_g L[n,g]``)."""
    T = L.double().sum(-1)
    return T / T.mean() - 1


def batch_std_coupling(rewards: torch.Tensor, eps: float = TRL_STD_EPS) -> torch.Tensor:
    """``k_n = (v_n - vbar) / (2 sigma (sigma + eps))`` [B] of advantages divided by the batch's
    reward std sigma (``v_n = mean_g (r[n,g] - rbar)^2``); zeros when sigma = 0 (every A is 0)."""
    r = rewards.double()
    sigma = float(nan_std(r))
    v = ((r - r.nanmean()) ** 2).nanmean(-1).nan_to_num(0.0)
    if not sigma > 0:
        return torch.zeros_like(v)
    return (v - v.mean()) / (2 * sigma * (sigma + eps))


# ---------------------------------------------------------------- the config's preset, checked and bound
TRL_KEYS = ("loss_type", "scale_rewards", "max_completion_length", "beta", "num_iterations", "epsilon",
            "epsilon_high")
VERL_KEYS = ("loss_agg_mode", "norm_adv_by_std_in_grpo", "loss_scale_factor")


def scale_rewards_choice(value) -> str:
    """TRL's ``scale_rewards`` in its string form (``True`` -> group, ``False`` -> none, as GRPOConfig)."""
    v = str(value).lower()
    return {"true": "group", "false": "none"}.get(v, v)


def is_coupled(ocfg) -> bool:
    """Whether the preset's per-prompt Y depends on the rest of the batch (token-count
    normalisers, TRL's batch-std advantages): then the U side has linearised SEs only."""
    preset = getattr(ocfg.preset, "value", ocfg.preset)
    if preset == "trl":
        return TRL_LOSS_TYPES.get(ocfg.loss_type) == "token_mean" or \
            scale_rewards_choice(ocfg.scale_rewards) == "batch"
    if preset == "verl":
        return VERL_LOSS_AGG_MODES.get(ocfg.loss_agg_mode) == "token_mean"
    return False


def config_errors(ocfg, cfg) -> list[tuple[str, str]]:
    """``(key, message)`` for every problem of the ``objective`` group in the root config ``cfg``."""
    preset = getattr(ocfg.preset, "value", ocfg.preset)
    errs: list[tuple[str, str]] = []
    own = {"trl": TRL_KEYS, "verl": VERL_KEYS}.get(preset, ())
    for key in TRL_KEYS + VERL_KEYS:
        if key not in own and getattr(ocfg, key) is not None:
            owner = "trl" if key in TRL_KEYS else "verl"
            errs.append((f"objective.{key}", f"is a key of objective={owner}, not of objective={preset}: "
                         f"choose objective={owner}, or drop it"))
    if preset != "entprobe" and getattr(cfg.batch.advantage, "value", cfg.batch.advantage) != "dr_grpo":
        errs.append(("batch.advantage", f"applies to objective=entprobe only; objective={preset} computes its "
                     "advantages itself (" + ("objective.scale_rewards" if preset == "trl" else
                                              "objective.norm_adv_by_std_in_grpo") + ")"))
    if preset == "trl":
        if ocfg.loss_type not in TRL_LOSS_TYPES:
            errs.append(("objective.loss_type", f"is {ocfg.loss_type!r}; one of {sorted(TRL_LOSS_TYPES)}"))
        if scale_rewards_choice(ocfg.scale_rewards) not in TRL_SCALE_REWARDS:
            errs.append(("objective.scale_rewards", f"is {ocfg.scale_rewards!r}; one of group, batch, none "
                         "(or true = group, false = none)"))
        if ocfg.beta:
            errs.append(("objective.beta", f"is {ocfg.beta}; the KL term needs a reference model, which the "
                         "probe does not load: only beta=0 (TRL's default) is supported"))
        if ocfg.num_iterations != 1:
            errs.append(("objective.num_iterations", f"is {ocfg.num_iterations}; the probe predicts the first "
                         "step on a batch (ratio 1): only num_iterations=1 is supported"))
        if ocfg.max_completion_length is not None and ocfg.max_completion_length < 1:
            errs.append(("objective.max_completion_length", "must be >= 1 (or null: sampling.max_new_tokens)"))
        for key in ("epsilon", "epsilon_high"):
            v = getattr(ocfg, key)
            if v is not None and v < 0:
                errs.append((f"objective.{key}", f"is {v}; must be >= 0"))
    elif preset == "verl":
        if ocfg.loss_agg_mode not in VERL_LOSS_AGG_MODES:
            errs.append(("objective.loss_agg_mode", f"is {ocfg.loss_agg_mode!r}; one of {list(VERL_LOSS_AGG_MODES)}"))
        if ocfg.norm_adv_by_std_in_grpo is None:
            errs.append(("objective.norm_adv_by_std_in_grpo", "must be true or false"))
        if ocfg.loss_scale_factor is not None and ocfg.loss_scale_factor <= 0:
            errs.append(("objective.loss_scale_factor", "must be > 0 (or null: sampling.max_new_tokens)"))
    elif preset != "entprobe":
        errs.append(("objective.preset", f"is {preset!r}; one of entprobe, trl, verl"))
    if is_coupled(ocfg) and getattr(cfg.probe.mode, "value", cfg.probe.mode) == "single_batch":
        errs.append(("probe.mode", f"single_batch needs per-prompt Y vectors that do not depend on the "
                     f"rest of the batch; objective={preset} with this aggregation normalises by batch "
                     "statistics (token count or the batch's reward std), so the U-statistic is not defined: "
                     "use probe.mode=two_batch (linearised SEs), or a per-sequence aggregation"))
    return errs


def preset_advantages(ocfg, rewards: torch.Tensor) -> torch.Tensor | None:
    """The preset's advantages of a global batch's rewards [B, G]; None for entprobe (the sampled
    ones, ``batch.advantage``, stay)."""
    preset = getattr(ocfg.preset, "value", ocfg.preset)
    if preset == "trl":
        return trl_advantages(rewards, scale_rewards_choice(ocfg.scale_rewards))
    if preset == "verl":
        return verl_advantages(rewards, bool(ocfg.norm_adv_by_std_in_grpo))
    return None


def bind(ocfg, rewards: torch.Tensor, L: torch.Tensor, max_new_tokens: int) -> Objective:
    """The objective of the global U batch (rewards and generated lengths [B, G]): its aggregation,
    per-token factor, batch constant and the units' coupling (module docstring)."""
    preset = getattr(ocfg.preset, "value", ocfg.preset)
    if preset == "entprobe":
        return ENTPROBE
    B = L.shape[0]
    couplings = []
    factor = 1.0
    if preset == "trl":
        agg = TRL_LOSS_TYPES[ocfg.loss_type]
        C = ocfg.max_completion_length or max_new_tokens
        if ocfg.loss_type == "cispo":  # clamp(ratio, max=epsilon_high).detach() at ratio 1
            eps_high = ocfg.epsilon_high if ocfg.epsilon_high is not None else ocfg.epsilon
            factor = min(1.0, float(eps_high))
        if scale_rewards_choice(ocfg.scale_rewards) == "batch":
            couplings.append(batch_std_coupling(rewards))
        name = f"trl/{ocfg.loss_type}"
    else:
        agg = VERL_LOSS_AGG_MODES[ocfg.loss_agg_mode]
        C = ocfg.loss_scale_factor or max_new_tokens
        name = f"verl/{ocfg.loss_agg_mode}"
    constant = {"seq_constant": float(C), "token_mean": float(L.double().sum()) / B,
                "token_sum": float(B)}.get(agg, 1.0)
    if agg == "token_mean":
        couplings.append(token_coupling(L))
    coupling = sum(couplings) if couplings else None
    return Objective(name, agg, factor, constant, coupling)


def prepare(ocfg, U, max_new_tokens: int):
    """The global update batch with the preset's advantages (entprobe: as sampled) and the
    objective bound to it: ``(U, Objective)``."""
    from dataclasses import replace

    A = preset_advantages(ocfg, U.rewards)
    if A is not None:
        U = replace(U, advantages=A.to(U.advantages.dtype))
    return U, bind(ocfg, U.rewards, U.gen_lengths, max_new_tokens)


# ---------------------------------------------------------------- TRL's entropy bonus (GRPOConfig.entropy_coef)
@dataclass(frozen=True)
class EntropyBonus:
    """TRL's entropy bonus in the step's loss, ``L = L_policy - coef H_bonus`` with ``H_bonus = sum_{n,g,t}
    m H / T`` the token mean of the per-position (full-vocabulary) entropy H over the step's masked
    completion tokens m (``T = sum m``; one micro-batch a step). Prompt n's share of ``-grad L``, as a
    unit (``Ybar = mean_n Y_n``): ``Y_n^bonus = coef grad(sum_{g,t} m H[n]) / Tbar`` with ``Tbar = T / B``.
    ``Tbar`` is fixed at the batch's: the ratio's dependence on prompt n's tokens is the coupling
    ``k_n = T_n / Tbar - 1`` (``token_coupling``), the objective's own for a token-mean loss, else folded
    into the units (stages/rollout_bonus.py)."""
    coef: float
    Tbar: float

    def y_loss(self, ent: torch.Tensor) -> torch.Tensor:
        """``(coef / Tbar) sum ent``: its gradient is the units' bonus part ``sum_n Y_n^bonus`` (``ent`` [b, G, T]
        differentiable, 0 off the completion tokens)."""
        return (self.coef / self.Tbar) * ent.sum()


def entropy_bonus(coef: float, response_mask: torch.Tensor) -> EntropyBonus | None:
    """The bonus at coefficient ``coef`` on a batch whose completion tokens are ``response_mask`` [B, G, T];
    None at ``coef == 0`` (the loss has no bonus: nothing changes)."""
    if coef == 0:
        return None
    B = response_mask.shape[0]
    return EntropyBonus(float(coef), float(response_mask.double().sum()) / B)
