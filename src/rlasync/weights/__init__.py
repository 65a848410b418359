"""Moving parameters from the trainer to the engines: bucket plans, a dedicated
torch.distributed group with deadlines, and the sender/receiver of one version."""

from .buckets import BucketPlan, TensorSpec, contiguous_bucket, flat_layout, pack, plan_buckets, plan_for, unpack
from .group import SyncError, WeightGroup
from .sync import SyncStats, WeightReceiver, WeightSender
from .synchronizer import ParameterSynchronizer, SyncReport, WeightSource

__all__ = [
    "BucketPlan", "ParameterSynchronizer", "SyncError", "SyncReport", "WeightSource", "SyncStats", "TensorSpec", "WeightGroup", "WeightReceiver", "WeightSender",
    "contiguous_bucket", "flat_layout", "pack", "plan_buckets", "plan_for", "unpack",
]  # fmt: skip
