"""How a batch is split over trainer ranks, and how their metrics are combined."""

from __future__ import annotations

from rlasync.trainer import shard_rows
from rlasync.trainer.types import reduce_metrics


def test_shards_and_metric_reduction() -> None:
    assert shard_rows(7, 2) == [slice(0, 4), slice(4, 7)]
    assert shard_rows(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]
    parts = [(3.0, {"pg_clipfrac": 0.0, "ratio_min": 0.5, "ratio_max": 1.5}), (1.0, {"pg_clipfrac": 1.0, "ratio_min": 0.9, "ratio_max": 3.0})]
    assert reduce_metrics(parts) == {"pg_clipfrac": 0.25, "ratio_min": 0.5, "ratio_max": 3.0}
    assert reduce_metrics([(0.0, {"ratio_min": 1.0}), (2.0, {"ratio_min": 2.0})]) == {"ratio_min": 2.0}  # empty parts don't vote
