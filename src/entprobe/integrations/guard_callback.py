"""``EntropyGuardCallback``: guard.py's ``EntropyGuard`` inside TRL's GRPOTrainer (the online probe's
callback, trl.py, with the guard's lr factor and entropy coefficient set around each optimizer step)."""
from __future__ import annotations

from entprobe.integrations.guard import STATE_KEY, Decision, EntropyGuard, GuardRule
from entprobe.integrations.guard_bonus import check_trl_bonus, coef_text
from entprobe.integrations.step_lines import probe_line
from entprobe.integrations.trl import EntropyProbeCallback


class EntropyGuardCallback(EntropyProbeCallback):
    """``EntropyGuard`` inside TRL's GRPOTrainer: the online probe every ``every_n_steps`` (its
    ``overrides`` as ``EntropyProbeCallback``'s) and the guard's factor on top of the scheduler's lr
    at ``on_pre_optimizer_step``, put back at ``on_optimizer_step`` (before the trainer's
    ``lr_scheduler.step()``). ``guard``: ``EntropyGuard``'s keywords (floor, max_decay, ...).
    The ``entprobe/guard_*`` metrics join the trainer's logs; ``decisions`` lists every decision.
    The guard's ``state_dict()`` goes into each checkpoint's ``trainer_state.json`` (key
    ``STATE_KEY`` of ``stateful_callbacks``, written at every step's end, before the trainer saves);
    ``trainer.train(resume_from_checkpoint=...)`` starts from the factor saved there. Each decision
    is printed as one line on the main process once its step is taken, with the prediction at the lr
    that step used and the measurement (``step_lines.probe_line``).
    (transformers' ``restore_callback_states_from_checkpoint`` is not needed; with it on, transformers
    warns that it found no callback named ``entprobe.EntropyGuard`` to rebuild: this callback reads it itself.)"""

    def __init__(self, trainer, every_n_steps: int = 1, guard: dict | None = None, **overrides):
        super().__init__(trainer, every_n_steps, **overrides)
        self.guard_kwargs = dict(guard or {})
        rule = GuardRule(**self.guard_kwargs)  # bad parameters fail here, before training
        if rule.entropy_coef_max is not None:
            check_trl_bonus(trainer, self.source, rule)
            self.guard_kwargs.setdefault("entropy_coef", float(trainer.args.entropy_coef))
            GuardRule(**self.guard_kwargs)  # TRL's own entropy_coef as the start: at most the max
        self.guard: EntropyGuard | None = None

    @property
    def decisions(self) -> list[Decision]:
        return self.guard.decisions if self.guard is not None else []

    def on_train_begin(self, args, state, control, **kwargs):
        if self.guard is not None:  # an earlier train() that raised inside optimizer.step(): its factor comes off
            self.guard.restore_lr()
        super().on_train_begin(args, state, control, **kwargs)
        self.guard = EntropyGuard(self.probe, **self.guard_kwargs)
        saved = (state.stateful_callbacks or {}).get(STATE_KEY) if state.global_step > 0 else None
        if saved is not None:
            self.guard.load_state_dict(saved)
            if state.is_world_process_zero:
                print(f"entprobe: EntropyGuard resumed at step {state.global_step} with lr factor "
                      f"{self.guard.factor:.4g} (trainer_state.json)", flush=True)
        if self.guard.rule.entropy_coef_max is not None:  # TRL's bonus on from the first step, at the guard's c
            self.trainer._entropy_bonus_enabled = True
            self.trainer.entropy_coef = self.guard.entropy_coef

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        knob = self.guard.rule.entropy_coef_max is not None
        rollouts = self.step_rollouts(step)
        if knob:  # the coefficient this step's loss used (TRL's); the one decided is its loss's from the next step
            self.guard.entropy_coef = float(self.trainer.entropy_coef)
            rollouts.pop("entropy_coef", None)  # the guard passes its own
        self.guard.before_step(step, **rollouts)
        if knob:
            self.trainer.entropy_coef = self.guard.entropy_coef

    def on_optimizer_step(self, args, state, control, **kwargs):
        dec = self.guard._decision  # the step's, before after_step measures it
        metrics = self.guard.after_step()
        self._to_log.update(metrics)
        self.check_fusable()
        if dec is not None and state.is_world_process_zero:  # one line a guarded step, at the lr it used
            coef = f"; {coef_text(dec.coef)}" if dec.coef is not None else ""
            print("entprobe: " + probe_line(dec.step, metrics, self.source, metrics.get("entprobe/H_rollouts"), dec,
                                            self.guard.rule) + coef, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[STATE_KEY] = self.guard.state_dict()  # saved with the checkpoint, if one follows
