"""Training schedules: ``sync`` (on-policy GRPO, the baseline)."""

from .sync import TrainResult, train_sync

__all__ = ["TrainResult", "train_sync"]
