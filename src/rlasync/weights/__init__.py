"""Moving parameters from the trainer to the engines: bucket plans, a dedicated
torch.distributed group with deadlines, the same-host shared-memory path, the sender and
receivers of one version, and the synchroniser that drives them for every engine."""

from .buckets import (
    BucketPlan,
    TensorSpec,
    contiguous_bucket,
    fill_flat,
    flat_layout,
    pack,
    plan_buckets,
    plan_for,
    unpack,
)
from .group import SyncError, WeightGroup
from .shm import SharedWeights, ShmOffer
from .sink import EngineWeights
from .sync import StagingRing, SyncStats, WeightReceiver, WeightSender
from .synchronizer import ParameterSynchronizer, SyncReport, WeightSource

__all__ = [
    "BucketPlan",
    "EngineWeights",
    "ParameterSynchronizer",
    "SharedWeights",
    "ShmOffer",
    "StagingRing",
    "SyncError",
    "SyncReport",
    "SyncStats",
    "TensorSpec",
    "WeightGroup",
    "WeightReceiver",
    "WeightSender",
    "WeightSource",
    "contiguous_bucket",
    "fill_flat",
    "flat_layout",
    "pack",
    "plan_buckets",
    "plan_for",
    "unpack",
]
