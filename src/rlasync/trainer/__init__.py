"""Training the policy on rollout batches: one rank's ``PolicyTrainer``, the ``TrainerRank``
actor that holds it in a process of its own on some node, and the ``TrainerActor`` that drives
N data-parallel ranks over torch.distributed as one."""

from .actor import RankLostError, TrainerActor
from .policy import PolicyTrainer
from .rank import GroupBroken, RankSpec, TrainerRank
from .types import TrainBatch, shard_rows

__all__ = [
    "GroupBroken",
    "PolicyTrainer",
    "RankLostError",
    "RankSpec",
    "TrainBatch",
    "TrainerActor",
    "TrainerRank",
    "shard_rows",
]
