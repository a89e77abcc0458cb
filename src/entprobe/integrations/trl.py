"""``EntropyProbeCallback``: the online probe inside TRL's ``GRPOTrainer`` (a ``transformers.TrainerCallback``).

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.add_callback(EntropyProbeCallback(trainer, every_n_steps=10, batch={"B_E": 8}))
    trainer.train()      # logs entprobe/deltaH_pred, SE_deltaH_pred, deltaH_true, ... every 10 steps

Where the Trainer's loop offers it (``on_pre_optimizer_step``: gradients accumulated over the
step's microbatches and clipped, ``optimizer.step()`` next) the callback predicts the change of that
very step from the gradient the optimizer is about to use (``OnlineProbe.before_step``); the
held-out E is sampled there, at theta, by the trainer's own generation
(``_generate_and_score_completions`` on ``batch.B_E`` prompts of its train dataset, ``num_generations``
each: its tokenization, chat template, temperature and generation backend), without scoring: the
probe reads E's responses only, so the trainer's reward computation returns zeros meanwhile
(``rewards_skipped``) and your reward functions are never called on E. At
``on_optimizer_step`` (the real step taken) it measures the change on E (``after_step``). The
metrics join the next ``logs`` dict the trainer reports (the callback puts itself first among the
callbacks, so wandb / TensorBoard / ... see them) and that entry of ``trainer.state.log_history``;
``callback.history`` keeps every probe's full results.

The trajectory is unchanged: gradients, RNG, modes and the optimizer are restored by the online
probe; the trainer's own bookkeeping that its generation updates (``_metrics``, ``_logs``,
``state.num_input_tokens_seen``) is put back after E is sampled. With ``fused_backward=True`` a probed
step's gradient is the probe's per-prompt sum instead (trl_fused.py), equal to the trainer's to fp32
rounding, so the run is no longer bit-identical to an unprobed one. Needs ``num_iterations == 1`` and
``steps_per_generation == gradient_accumulation_steps`` (one generation batch per optimizer step);
one process.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import TrainerCallback

from entprobe.config import ConfigError
from entprobe.math.importance import psis_backend
from entprobe.integrations.online import SOURCES, OnlineProbe, online_config
from entprobe.integrations.online_checks import check_every
from entprobe.integrations.trl_fused import FUSE_RESIDUAL, FusedBackward, fits
from entprobe.integrations.trl_rollouts import (StepBatch, kappa_agrees, trl_entropy_coef, trl_objective,
                                                trl_rollout_batch, trl_token_entropy)
from entprobe.reporting.over_steps import merged_history, write_history
from entprobe.rollouts.sampling import RolloutBatch


@contextlib.contextmanager
def bookkeeping_kept(trainer):
    """Put back what GRPOTrainer's generation records about a batch (metrics, the completions
    table, tokens seen), so sampling E leaves the trainer's logs as they were."""
    saved = {k: copy.deepcopy(getattr(trainer, k)) for k in ("_metrics", "_logs") if hasattr(trainer, k)}
    tokens = trainer.state.num_input_tokens_seen
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
        trainer.state.num_input_tokens_seen = tokens


@contextlib.contextmanager
def rewards_skipped(trainer):
    """GRPOTrainer's ``_calculate_rewards`` returns zeros (``[completions, reward functions]``, as
    its own) inside the block: generation without scoring. The probe of E needs no rewards, and
    the user's reward functions (possibly slow, possibly keeping state) are not called on E."""
    if not hasattr(trainer, "_calculate_rewards"):
        yield
        return
    missing = object()
    own = trainer.__dict__.get("_calculate_rewards", missing)

    def zeros(inputs, prompts, *args, **kwargs):
        return torch.zeros(len(prompts), len(trainer.reward_funcs), device=trainer.accelerator.device)
    trainer._calculate_rewards = zeros
    try:
        yield
    finally:
        if own is missing:
            del trainer._calculate_rewards
        else:
            trainer._calculate_rewards = own


def cost_line(history: list[dict], train_s: float, every: int) -> str:
    """What the probes cost this run (wall clock): their time over the training's without them,
    ``sum(time_s) / (train_s - sum(time_s))``."""
    probe_s = sum(float(r.get("time_s", 0.0)) for r in history)
    rest = train_s - probe_s
    share = f"{100 * probe_s / rest:.1f}% of the {rest:.1f} s of training without them" if rest > 0 else "all of it"
    return (f"entprobe: {len(history)} probe(s) took {probe_s:.1f} s, {share} "
            f"({probe_s / len(history):.1f} s a probe, every {every} step(s), B_E = {history[-1].get('B_E', '?')})")


class EntropyProbeCallback(TrainerCallback):
    """Predict and measure the entropy change of every ``every_n_steps``-th optimizer step of a
    ``GRPOTrainer`` (module docstring). ``overrides``: the online probe's config keys
    (``integrations.online_config.ONLINE_KEYS``; G, temperature, top_k and top_p are the trainer's).
    ``source="rollouts"``: predict from the step's own generation batch (``OnlineProbe``'s
    ``source``; the loss is the trainer's, ``trl_rollouts.trl_objective``), no generation for the
    prediction; ``measure=True`` also samples a fresh E of ``batch.B_E`` prompts to measure the step
    on (the held-out source always does). ``fused_backward=True`` (source="rollouts"): on a probed step
    the trainer's gradient is the sum of the probe's per-prompt passes and its own backward is skipped
    (trl_fused.py: when that gradient has been checked to be the trainer's; the last bits can differ)."""

    def __init__(self, trainer, every_n_steps: int = 10, source: str = "held_out", measure: bool | None = None,
                 fused_backward: bool = False, **overrides):
        args = trainer.args
        check_every(every_n_steps, "every_n_steps")
        if source not in SOURCES:
            raise ConfigError(f"source={source!r}: one of {', '.join(SOURCES)}")
        if source == "held_out" and measure is False:
            raise ConfigError("measure=False: the held-out source predicts and measures on its E; use "
                              "source='rollouts' to predict without sampling")
        if not hasattr(trainer, "_generate_and_score_completions"):
            raise TypeError(f"{type(trainer).__name__} is not a TRL GRPOTrainer (no _generate_and_score_completions); "
                            "use entprobe.integrations.OnlineProbe in your own loop")
        if getattr(trainer, "num_iterations", 1) != 1:
            raise ConfigError(f"GRPOConfig.num_iterations={trainer.num_iterations}: the probe predicts the first "
                              "step on a batch; use num_iterations=1")
        if args.steps_per_generation != args.gradient_accumulation_steps:
            raise ConfigError(f"GRPOConfig.steps_per_generation={args.steps_per_generation} differs from "
                              f"gradient_accumulation_steps={args.gradient_accumulation_steps}: one generation batch "
                              "must be one optimizer step")
        self.trainer, self.every = trainer, every_n_steps
        fixed = {"batch.G": trainer.num_generations, "sampling.temperature": float(args.temperature),
                 "sampling.top_k": int(args.top_k or 0), "sampling.top_p": float(args.top_p)}
        if source == "rollouts":
            fixed.update(trl_objective(trainer))
        if fused_backward and source != "rollouts":
            raise ConfigError("fused_backward=True: the trainer's gradient comes from the probe's per-prompt passes "
                              "of the step's own batch; use source='rollouts'")
        self.fused = FusedBackward(self) if fused_backward else None
        self._fuse_ok = False  # an earlier probe checked the objective's gradient against the trainer's (FUSE_RESIDUAL)
        self.source, self.measure = source, source == "held_out" or bool(measure)
        self.cfg = online_config(overrides, fixed, source)  # bad keys fail here, before training (not composed again)
        self.step_batch = StepBatch()
        psis_backend()  # its one-time import (~1 s) now rather than at the start of training
        self.probe: OnlineProbe | None = None
        self._to_log: dict = {}
        # token_mean's constant: TRL's logged entropy of the step probed, and whether a probe's own agreed with it
        self._trl_kappa: float | None = None
        self._kappa_agrees = False

    @property
    def history(self) -> list[dict]:
        """Every probe's full results (the logged ``entprobe/*`` ones and the rest)."""
        return self.probe.history if self.probe is not None else []

    def sample_held_out(self, step: int) -> RolloutBatch:
        """E at the current parameters: ``batch.B_E`` prompts of the train dataset (seeded by
        ``batch.seed_E`` and the step), ``num_generations`` completions each, by the trainer's
        generation (not scored: ``rewards_skipped``)."""
        tr, b = self.trainer, self.cfg.batch
        ds = tr.train_dataset
        gen = torch.Generator().manual_seed(b.seed_E + 1_000_003 * step)
        rows = torch.randperm(len(ds), generator=gen)[:b.B_E].tolist()
        if len(rows) < 2:
            raise ConfigError(f"the train dataset has {len(ds)} row(s); the held-out batch needs >= 2 prompts")
        repeated = [i for i in rows for _ in range(tr.num_generations)]
        getitems = getattr(ds, "__getitems__", None)  # one read of all rows, as torch's DataLoader does
        inputs = getitems(repeated) if getitems else [ds[i] for i in repeated]
        with bookkeeping_kept(tr), rewards_skipped(tr), self.step_batch.paused(), torch.no_grad():
            out = tr._generate_and_score_completions(inputs)
        return trl_rollout_batch(out, tr.num_generations, self.cfg.sampling.temperature)

    def on_train_begin(self, args, state, control, **kwargs):
        self._t_begin = time.perf_counter()
        tr = self.trainer
        held_out = self.sample_held_out if self.measure else None
        self.probe = OnlineProbe(tr.model, tr.optimizer, tr.processing_class, held_out, self.every,
                                 config=self.cfg, source=self.source,
                                 max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None)
        if self.source == "rollouts":
            self.step_batch.install(tr)
        if self.fused is not None:
            self.fused.install(tr)
        cbs = tr.callback_handler.callbacks  # first: the reporting callbacks see what on_log adds
        cbs.insert(0, cbs.pop(cbs.index(self)))

    def step_batch_now(self) -> RolloutBatch:
        """The step's batch as the probe reads it, with TRL's logged entropy as token_mean's constant once
        a probe's own agreed with it (then no forward of the probe's own for it)."""
        batch = self.step_batch.batch(self.trainer.num_generations, self.cfg.sampling.temperature)
        self._trl_kappa = trl_token_entropy(self.trainer) if self.cfg.probe.weighting_mode.value == "token_mean" else None
        if self._trl_kappa is not None and self._kappa_agrees:
            batch.entropy_mean = self._trl_kappa
        return batch

    def step_rollouts(self, step: int) -> dict:
        """``before_step``'s keywords for ``source="rollouts"``: the step's batch and pre-clip norm (and the
        per-prompt passes when the step was fused: trl_fused.py)."""
        if self.source != "rollouts" or not self.probe.due(step):
            return {}
        given = self.fused.take(step) if self.fused is not None else None
        batch = given.batch if given is not None else self.step_batch_now()
        out = {"rollouts": batch, "grad_norm": self.step_batch.grad_norm, "entropy_coef": trl_entropy_coef(self.trainer)}
        return {**out, "given": given} if given is not None else out

    def fusable(self, step: int) -> bool:
        """Whether ``step``'s gradient is to come from the probe's passes (trl_fused.py's conditions), asked
        in its ``compute_loss``, the step's batch generated."""
        tr, cfg, out = self.trainer, self.cfg, self.step_batch.output
        if out is None or not (self._fuse_ok and self.probe.due(step) and tr.args.gradient_accumulation_steps == 1
                               and not getattr(tr, "_entropy_bonus_enabled", False)):  # no bonus, adaptive or not
            return False
        B = out["completion_ids"].shape[0] // tr.num_generations
        if cfg.probe.rollouts_prompts is not None and cfg.probe.rollouts_prompts < B:
            return False
        return fits([p for p in tr.model.parameters() if p.requires_grad], B, cfg.probe.unit_grads_budget_mb)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1  # the step about to be taken
        self.probe.before_step(step, **self.step_rollouts(step))

    def on_optimizer_step(self, args, state, control, **kwargs):
        metrics = self.probe.after_step()
        if metrics and self._trl_kappa is not None and not self._kappa_agrees:
            self._kappa_agrees = kappa_agrees(self.history[-1].get("rollouts/kappa"), self._trl_kappa)
        if metrics:
            self._to_log.update(metrics)
        self.check_fusable()

    def check_fusable(self) -> None:
        """After a probe that compared the objective's gradient with the trainer's own on a whole batch
        (the last in ``history``: not fused, not a subset, the gradient not 0): whether later probed steps
        may take their gradient from the probe's passes (``fused_backward``; its residual at most
        ``FUSE_RESIDUAL``). Nothing without ``fused_backward`` or before the first probe."""
        if self.fused is None or not self.history:
            return
        res = self.history[-1]
        r = res.get("rollouts/grad_residual")
        if r is not None and not res.get("rollouts/fused_backward") and not res.get("gradient_zero"):
            self._fuse_ok = r <= FUSE_RESIDUAL

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "entropy" in logs and self.feeds_entropy(args):  # joins the run's forecast
            self.probe.observe_entropy(state.global_step, logs["entropy"])
        if logs is not None and self._to_log:
            logs.update(self._to_log)  # what the reporting callbacks receive
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._to_log)  # the trainer's copy of the same entry
            self._to_log = {}

    def feeds_entropy(self, args) -> bool:
        """Whether TRL's logged ``entropy`` is one step's, in the probe's units: the forecast's
        observations (``OnlineProbe.observe_entropy``): with ``source="rollouts"``, token_mean (TRL's
        own functional) and ``logging_steps=1`` (a longer one logs the mean over its steps)."""
        return (self.source == "rollouts" and self.probe is not None and args.logging_steps == 1
                and self.cfg.probe.weighting_mode.value == "token_mean")

    def on_train_end(self, args, state, control, **kwargs):
        """``entprobe_over_steps.csv`` and ``.png`` (reporting/over_steps.py) of ``history`` in the
        trainer's ``output_dir``, their paths printed (nothing when no step was probed), and a line
        with what the probes cost (``cost_line``); after a
        resume, with the earlier probes as the log history holds them (``merged_history``). The
        trainer's own methods are put back (``source="rollouts"``)."""
        if getattr(self, "step_batch", None) is not None:
            self.step_batch.uninstall()
        if getattr(self, "fused", None) is not None:
            self.fused.uninstall()
        if state.is_world_process_zero:
            if self.history and getattr(self, "_t_begin", None) is not None:
                print(cost_line(self.history, time.perf_counter() - self._t_begin, self.every), flush=True)
            # a resumed run's earlier probes come from the log history its checkpoint carried
            for path in write_history(merged_history(state.log_history, self.history), args.output_dir,
                                      log_history=state.log_history):
                print(f"entprobe: over steps {path}", flush=True)
