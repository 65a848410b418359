"""The quickstart, synchronous and fully asynchronous: both validation curves against wall time
in one PNG, and whether async reached sync's final accuracy (within 0.05) sooner.

    .venv/bin/python benchmarks/plot_modes.py [--out runs/modes] [--no-run]

Runs ``rlasync train configs/quickstart.yaml`` and ``configs/quickstart_async.yaml`` one after
the other (the same task, model, recipe and number of samples; about 6 minutes on 2 cores),
reads their ``metrics.jsonl`` (``val_accuracy`` against ``elapsed_s``), and writes
``OUT/modes.png``. ``--no-run`` plots runs already in ``OUT``. Last line JSON:
``{"sync_final", "async_final", "sync_wall_s", "async_wall_s", "speedup", "within_0.05", "async_faster"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"sync": "quickstart.yaml", "fully_async": "quickstart_async.yaml"}


def train(config: str, run_dir: Path) -> None:
    command = [sys.executable, "-m", "rlasync", "train", str(ROOT / "configs" / config), f"train.run_dir={run_dir}"]
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def curve(run_dir: Path) -> tuple[list[float], list[float], float]:
    """(seconds, validation accuracy) at each validation, and the wall time of the last step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(r["elapsed_s"], r["val_accuracy"]) for r in records if "val_accuracy" in r]
    return [p[0] for p in points], [p[1] for p in points], records[-1]["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "modes")
    parser.add_argument("--no-run", action="store_true", help="plot the runs already in --out")
    args = parser.parse_args()
    try:  # before six minutes of training, not after
        import matplotlib
    except ImportError:
        sys.exit("plot_modes.py needs matplotlib: `.venv/bin/pip install 'matplotlib>=3.8,<4'` (`make bench` installs it)")
    if not args.no_run:
        for mode, config in RUNS.items():
            train(config, args.out / mode)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    results = {}
    for mode in RUNS:
        seconds, accuracy, wall = curve(args.out / mode)
        results[mode] = (accuracy[-1], wall)
        ax.plot(seconds, accuracy, marker="o", label=f"{mode}: {accuracy[-1]:.3f} after {wall:.0f} s")
    ax.set_xlabel("wall time (s), 2 CPU cores")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("quickstart (reverse, nano model, 600 steps): sync vs fully async")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    png = args.out / "modes.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    (sync_final, sync_wall), (async_final, async_wall) = results["sync"], results["fully_async"]
    print(f"sync:        final accuracy {sync_final:.3f} after {sync_wall:.0f} s")
    print(f"fully async: final accuracy {async_final:.3f} after {async_wall:.0f} s ({sync_wall / async_wall:.2f}x faster)")
    print(f"plot: {png}")
    print(json.dumps({
        "sync_final": sync_final, "async_final": async_final, "sync_wall_s": sync_wall, "async_wall_s": async_wall,
        "speedup": round(sync_wall / async_wall, 3), "within_0.05": async_final >= sync_final - 0.05, "async_faster": async_wall < sync_wall,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
