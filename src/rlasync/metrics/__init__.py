"""A run's metrics: each step's record, typed (``step``), and how a metric combines across
micro-batches, trainer ranks and updates (``reduce``). Every schedule writes its steps as
``StepRecord``; ``metrics.jsonl`` holds their flat form, one JSON object per step. A node's
Prometheus ``/metrics`` is ``exporter.Exporter`` (imported on its own: it loads prometheus-client),
and ``timings.Timings`` the histogram the runtime observes per call.

    from rlasync.metrics import StepRecord, Weights, reduce_metrics

    train = reduce_metrics([(30.0, {"loss": 0.2, "ratio_max": 1.1}), (10.0, {"loss": 0.6, "ratio_max": 1.3})])
    record = StepRecord(step=1, reward=0.75, train=train, weights=Weights(transfer_s=0.1, pause_s=0.02))
    line = record.as_dict()
    assert line["train/loss"] == 0.3 and line["train/ratio_max"] == 1.3 and line["weights/pause_s"] == 0.02
    assert StepRecord.from_dict(line) == record

A leaf package: it imports no other part of ``rlasync``; the runtime, the trainer and the
schedules use it.
"""

from __future__ import annotations

from .reduce import REDUCTIONS, Reduction, reduce_metrics, reduction
from .step import Colocation, Flat, Processing, QueueStats, Rollouts, Staleness, Stamp, StepRecord, Weights

__all__ = [
    "Colocation",
    "REDUCTIONS",
    "Flat",
    "Processing",
    "QueueStats",
    "Reduction",
    "Rollouts",
    "Stamp",
    "Staleness",
    "StepRecord",
    "Weights",
    "reduce_metrics",
    "reduction",
]
