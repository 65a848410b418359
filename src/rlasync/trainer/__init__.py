"""Training the policy on rollout batches: one rank's ``PolicyTrainer``, and the
``TrainerActor`` that drives N data-parallel ranks (processes) over torch.distributed."""

from .actor import RankLostError, TrainerActor
from .policy import PolicyTrainer
from .types import TrainBatch, shard_rows

__all__ = ["PolicyTrainer", "RankLostError", "TrainBatch", "TrainerActor", "shard_rows"]
