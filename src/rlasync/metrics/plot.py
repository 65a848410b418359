"""``rlasync plot RUN_DIR [RUN_DIR ...]``: one PNG of runs side by side, read from their
``metrics.jsonl``: reward, held-out accuracy, staleness and throughput, against steps (top row)
and wall time (bottom row). matplotlib is an optional extra (``pip install 'rlasync[plot]'``).

    png = plot_runs(["runs/quickstart", "runs/quickstart_async"], "runs/compare.png")
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of ``run_dir/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run folder (train.run_dir)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, float]]]:
    """``(step, elapsed_s, value)`` points of each panel: ``reward``, ``val_accuracy``,
    ``staleness`` (mean versions behind per trained token; 0 for the synchronous schedule) and
    ``tokens_per_s`` (model tokens trained per second of wall time, step to step)."""
    out: dict[str, list[tuple[float, float, float]]] = {
        "reward": [],
        "val_accuracy": [],
        "staleness": [],
        "tokens_per_s": [],
    }
    previous: float | None = None
    for r in records:
        step, at = float(r["step"]), float(r.get("elapsed_s", 0.0))
        if r.get("val_accuracy") is not None:
            out["val_accuracy"].append((step, at, float(r["val_accuracy"])))
        if r["step"] == 0:
            previous = at
            continue
        if r.get("reward") is not None:
            out["reward"].append((step, at, float(r["reward"])))
        out["staleness"].append((step, at, float(r.get("async/staleness_token_mean", 0.0))))
        if previous is not None and at > previous and r.get("response_tokens"):
            out["tokens_per_s"].append((step, at, float(r["response_tokens"]) / (at - previous)))
        previous = at
    return out


PANELS = {
    "reward": "mean reward (training batch)",
    "val_accuracy": "held-out accuracy",
    "staleness": "staleness (versions behind, per token)",
    "tokens_per_s": "trained tokens / s",
}


def plot_runs(run_dirs: Sequence[str | Path], png: str | Path, *, title: str = "") -> Path:
    """Write the PNG of ``run_dirs`` to ``png``; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("rlasync plot needs matplotlib: pip install 'rlasync[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): series(read_records(d)) for d in run_dirs}
    fig, axes = plt.subplots(2, len(PANELS), figsize=(4.2 * len(PANELS), 7), squeeze=False)
    for column, (key, label) in enumerate(PANELS.items()):
        for row, (x, xlabel) in enumerate(((0, "step"), (1, "wall time (s)"))):
            ax = axes[row][column]
            for name, points in runs.items():
                if points[key]:
                    ax.plot([p[x] for p in points[key]], [p[2] for p in points[key]], label=Path(name).name)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(loc="best", fontsize="small")
    fig.suptitle(title or " vs ".join(Path(d).name for d in run_dirs))
    fig.tight_layout()
    path = Path(png)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["PANELS", "PlotUnavailable", "plot_runs", "read_records", "series"]
