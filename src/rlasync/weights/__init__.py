"""Moving parameters from the trainer to the engines: bucket plans, a dedicated
torch.distributed group with deadlines, the same-host shared-memory path, the sender and
receivers of one version, and the synchroniser that drives them for every engine."""

from .buckets import (
    BucketPlan,
    TensorSpec,
    contiguous_bucket,
    fill_flat,
    flat_layout,
    flat_views,
    pack,
    plan_buckets,
    plan_for,
    unpack,
)
from .errors import SyncError, is_transfer_failure, raised_remotely
from .group import WeightGroup
from .protocol import GroupAddress
from .roles import SyncReport, WeightSink, WeightSource, WeightSync
from .shm import SharedWeights, ShmOffer
from .sink import EngineWeights
from .sync import StagingRing, SyncStats, WeightReceiver, WeightSender
from .synchronizer import ParameterSynchronizer
from .targets import ActorSink

__all__ = [
    "ActorSink",
    "BucketPlan",
    "EngineWeights",
    "GroupAddress",
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
    "WeightSink",
    "WeightSource",
    "WeightSync",
    "contiguous_bucket",
    "fill_flat",
    "flat_layout",
    "flat_views",
    "is_transfer_failure",
    "pack",
    "plan_buckets",
    "plan_for",
    "raised_remotely",
    "unpack",
]
