"""The probe inside a training run: ``OnlineProbe`` for a plain PyTorch loop (online.py) and
``EntropyProbeCallback`` for TRL's GRPOTrainer (trl.py), and entprobe's own DR-GRPO / GRPO trainer
(integrations/grpo_trainer.py); ``EntropyGuard`` / ``EntropyGuardCallback`` (guard.py, guard_callback.py) set each step's lr from
the probe's prediction to hold entropy in a band. Imports every package below it (pipeline and down); only cli imports it."""
from entprobe.integrations.online import OnlineProbe
from entprobe.integrations.trl import EntropyProbeCallback
from entprobe.integrations.guard import EntropyGuard
from entprobe.integrations.guard_callback import EntropyGuardCallback

__all__ = ["OnlineProbe", "EntropyProbeCallback", "EntropyGuard", "EntropyGuardCallback"]
