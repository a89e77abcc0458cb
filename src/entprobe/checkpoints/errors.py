"""The checkpoint readers' shared error (raised by checkpoints/optim_state.py and checkpoints/trainer_states/)."""


class OptimizerStateError(ValueError):
    """The optimizer state does not fit the model or the step; the message says what to change."""


class ScheduleEndedError(OptimizerStateError):
    """The checkpoint's next lr is 0 (its schedule has ended): no step to probe at its own lr. Callers
    that walk a run's checkpoints (cli/probe_run.py) record it as skipped, not failed."""
