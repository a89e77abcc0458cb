"""The checkpoint readers' shared error (raised by checkpoints/optim_state.py and checkpoints/trainer_states/)."""


class OptimizerStateError(ValueError):
    """The optimizer state does not fit the model or the step; the message says what to change."""
    # True on the error that the checkpoint's next lr is 0 (its schedule has ended: nothing to probe
    # at its own lr); cli/probe_run.py records such a checkpoint as skipped, not failed
    schedule_ended: bool = False
