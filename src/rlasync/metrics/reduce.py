"""How a metric combines across the parts of a step: micro-batches, trainer ranks, the
mini-batch updates of an asynchronous step.

Each part comes with its weight (its model tokens). A metric's reduction is declared here, by
name, in ``REDUCTIONS``; one that is not declared is a token-weighted mean (never a mean of
means). Names may carry their group (``offpolicy/ratio_min``): a name not declared whole is
looked up by its last part (``ratio_min``).

    >>> reduce_metrics([(3.0, {"loss": 0.0, "ratio_max": 1.5}), (1.0, {"loss": 1.0, "ratio_max": 3.0})])
    {'loss': 0.25, 'ratio_max': 3.0}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

Reduction = Literal["mean", "sum", "min", "max"]  # "mean": weighted by each part's tokens

REDUCTIONS: dict[str, Reduction] = {
    "tokens": "sum",  # the model tokens trained on
    "ratio_min": "min",  # the PPO ratio pi/mu (policy_loss; offpolicy_metrics as offpolicy/ratio_min)
    "ratio_max": "max",
    "compute_s_max": "max",  # a rank's step compute seconds: the slowest rank's
}


def reduction(name: str) -> Reduction:
    """How metric ``name`` combines: declared whole, or by its last part, else a weighted mean."""
    declared = REDUCTIONS.get(name)
    if declared is None and "/" in name:
        declared = REDUCTIONS.get(name.rsplit("/", 1)[1])
    return declared or "mean"


def reduce_metrics(parts: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """Combine per-part metrics, each part weighted by its tokens, each metric by its
    ``reduction``. Parts without tokens count only when no part has any (then the first alone)."""
    weighted = [(w, m) for w, m in parts if w > 0] or [(1.0, m) for _, m in parts[:1]]
    total = sum(w for w, _ in weighted)
    out: dict[str, float] = {}
    for weight, metrics in weighted:
        for key, value in metrics.items():
            how = reduction(key)
            if how == "min":
                out[key] = min(out.get(key, value), value)
            elif how == "max":
                out[key] = max(out.get(key, value), value)
            elif how == "sum":
                out[key] = out.get(key, 0.0) + value
            else:
                out[key] = out.get(key, 0.0) + value * weight / total
    return out


__all__ = ["REDUCTIONS", "Reduction", "reduce_metrics", "reduction"]
