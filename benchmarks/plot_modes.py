"""The quickstart, synchronous and fully asynchronous: both validation curves against wall time
in one PNG, and whether async reached sync's final accuracy (within 0.05) sooner.

    .venv/bin/python benchmarks/plot_modes.py [--out runs/modes] [--no-run] [--smoke]

Runs ``rlasync train configs/quickstart.yaml`` and ``configs/quickstart_async.yaml`` one after
the other (the same task, model, recipe and number of samples; about 6 minutes on 2 cores),
reads their ``metrics.jsonl`` (``val_accuracy`` against ``elapsed_s``), and writes
``OUT/modes.png`` with ``rlasync plot`` (reward, held-out accuracy, staleness and throughput of
both runs, against steps and wall time). ``--no-run`` plots runs already in ``OUT``. Last line JSON:
``{"sync_final", "async_final", "sync_wall_s", "async_wall_s", "speedup", "within_0.05", "async_faster"}``.
``--smoke``: 2 short steps of each from an untrained model, the plot only if matplotlib is there.
Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rlasync.metrics.plot import plot_runs, read_records

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"sync": "quickstart.yaml", "fully_async": "quickstart_async.yaml"}


def train(config: str, run_dir: Path, extra: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(ROOT / "configs" / config),
        f"train.run_dir={run_dir}",
        *extra,
    ]
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def smoke_overrides(out: Path) -> list[str]:
    """Two steps of a few short trajectories from an untrained model (no warm-start), validating
    on a few prompts after each (a curve of three points): that the script runs, in seconds."""
    from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

    model_dir = save_pretrained_dir(*build_tiny_lm(TinyLMConfig.preset("nano", seed=0)), out / "nano")
    return [
        f"train.model_dir={model_dir}",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.max_new_tokens=8",
        "train.validate_every=1",
        "train.val_size=4",
        "train.checkpoint_every=0",
        "data.synthetic_train_size=64",  # not 20,000 problems to draw from: ~0.4 s a run to make
    ]


def curve(run_dir: Path) -> tuple[list[float], list[float], float]:
    """(seconds, validation accuracy) at each validation, and the wall time of the last step."""
    records = read_records(run_dir)
    points = [(r["elapsed_s"], r["val_accuracy"]) for r in records if "val_accuracy" in r]
    return [p[0] for p in points], [p[1] for p in points], records[-1]["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "modes")
    parser.add_argument("--no-run", action="store_true", help="plot the runs already in --out")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 short steps of each from an untrained model; the plot only if matplotlib is there",
    )
    args = parser.parse_args()
    try:  # before six minutes of training, not after
        import matplotlib
    except ImportError:
        if not args.smoke:
            sys.exit(
                "plot_modes.py needs matplotlib: `.venv/bin/pip install 'matplotlib>=3.8,<4'` (`make bench` installs it)"
            )
        matplotlib = None
    if not args.no_run:
        extra = smoke_overrides(args.out) if args.smoke else []
        for mode, config in RUNS.items():
            train(config, args.out / mode, extra)
    results = {}
    for mode in RUNS:
        seconds, accuracy, wall = curve(args.out / mode)
        results[mode] = (seconds, accuracy, wall)
    if matplotlib is not None:  # `rlasync plot`: reward, accuracy, staleness, throughput; by step and time
        png = plot_runs(
            [args.out / mode for mode in RUNS],
            args.out / "modes.png",
            title="quickstart (reverse, nano model): sync vs fully async",
        )
        print(f"plot: {png}")
    else:
        print("plot: left out (matplotlib is not installed; `make bench` installs it)")
    (_, sync_acc, sync_wall), (_, async_acc, async_wall) = results["sync"], results["fully_async"]
    sync_final, async_final = sync_acc[-1], async_acc[-1]
    print(f"sync:        final accuracy {sync_final:.3f} after {sync_wall:.0f} s")
    print(
        f"fully async: final accuracy {async_final:.3f} after {async_wall:.0f} s ({sync_wall / async_wall:.2f}x faster)"
    )
    print(
        json.dumps(
            {
                "sync_final": sync_final,
                "async_final": async_final,
                "sync_wall_s": sync_wall,
                "async_wall_s": async_wall,
                "speedup": round(sync_wall / async_wall, 3),
                "within_0.05": async_final >= sync_final - 0.05,
                "async_faster": async_wall < sync_wall,
            }
        )
    )


if __name__ == "__main__":
    main()
