"""The checkpoint readers' shared error (raised by checkpoints/optim_state.py and checkpoints/trainer_states/)."""


class OptimizerStateError(ValueError):
    """The optimizer state does not fit the model or the step; the message says what to change."""
