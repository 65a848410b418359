"""``Timings``: a histogram cheap enough to observe on every actor call (a list increment, not
prometheus-client's locked ``Histogram``), exported as a Prometheus histogram at scrape time.
No import of prometheus-client here: the runtime's hot path holds one of these.

    >>> t = Timings([0.1, 1.0])
    >>> t.observe(0.05); t.observe(0.5); t.observe(5.0)
    >>> t.buckets()
    [('0.1', 1.0), ('1.0', 2.0), ('+Inf', 3.0)]
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Seconds buckets from a millisecond to ten minutes: calls, turns, steps and syncs all fit.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)


class Timings:
    """A histogram cheap enough to observe on every call: bucket counts and a sum, exported as
    a Prometheus histogram by ``exporter.histogram``. Observed on the event loop only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(upper bound, count)`` pairs, ``+Inf`` last."""
        out, total = [], 0
        for bound, count in zip([*map(_bound, self.bounds), "+Inf"], self.counts):
            total += count
            out.append((bound, float(total)))
        return out


def _bound(value: float) -> str:
    return repr(float(value))


__all__ = ["SECONDS_BUCKETS", "Timings"]
