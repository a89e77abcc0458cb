"""The probe inside a training run: ``OnlineProbe`` for a plain PyTorch loop (online.py) and
``EntropyProbeCallback`` for TRL's GRPOTrainer (trl.py)."""
from entprobe.integrations.online import OnlineProbe
from entprobe.integrations.trl import EntropyProbeCallback

__all__ = ["OnlineProbe", "EntropyProbeCallback"]
