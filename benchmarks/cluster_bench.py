"""What placing roles on node processes costs, and what it saves the head, in one run.

    .venv/bin/python benchmarks/cluster_bench.py [--steps 60] [--repeats 2] [--smoke]

(a) Step time: the quickstart (synchronous GRPO on the tiny model, trainer rank in a process
    the head supervises) for ``--steps`` steps with the local placement (the engine and its
    agent loops in the head's process) against the same with the engine and its loops on a node
    process of their own (``cluster.engines=[1]``): ``rlasync train`` processes, alternating,
    ``--repeats`` pairs; the median pair's ratio counts. Wall time per step, the first few steps
    and the closing validation left out.
(b) The head's own cost: simulated engines (``engine.backend=sim``: no model compute) on two
    node processes, 128 trajectories a step (16 prompts x 8), the head's CPU time
    (``time.process_time()`` of this process, which is the head) per trajectory with the agent
    loops on the head (``cluster.agent_loops=head``: every turn crosses to an engine node and
    back) against with the loops next to the engines (``engines``: the head sends prompts and
    receives finished trajectories). Its inverse with the loops on the nodes is the head's
    capacity: finished trajectories per second one core absorbs. At 1,024 GPUs the need is about
    1,300/s for 2.7k-token answers, 7,400/s for 500-token ones (shared/reference/performance.md).

Last line, JSON: ``{"local_step_s", "cluster_step_s", "cluster_vs_local",
"head_cpu_ms_per_trajectory_loops_on_head", "head_cpu_ms_per_trajectory_loops_on_nodes",
"head_cpu_ratio", "head_trajectories_per_s_per_core"}``. Goals: ``cluster_vs_local`` <= 1.15;
``head_cpu_ratio`` <= 0.3; ``head_trajectories_per_s_per_core`` >= 13,000.
``--smoke`` runs every part for a few steps of a few short trajectories from an untrained model
(seconds, for ``make test``): its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlasync.compose.model_dir import model_dir_for
from rlasync.compose.run import Run
from rlasync.config import RuntimeConfig, load_config
from rlasync.runtime.spawner import fork_children

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
WARMUP_STEPS = 5  # left out of the step time: the first steps start engines' and ranks' caches
# --smoke: a few short trajectories a step and a few prompts to validate, drawn from 64 synthetic
# problems (not 20,000: ~0.4 s a run to make), on every run; what remains is mostly the start-up.
SMOKE = [
    "train.prompts_per_step=2",
    "train.group_size=2",
    "train.max_new_tokens=8",
    "train.val_size=4",
    "data.synthetic_train_size=64",
]


def warm_model(run_dir: Path) -> Path:
    """The quickstart's warm-started model (cached under ``run_dir``)."""
    config = load_config(QUICKSTART, [f"train.run_dir={run_dir}"])
    return asyncio.run(model_dir_for(config))


def step_time(placement: list[str], steps: int, model_dir: Path) -> float:
    """Seconds per step of a quickstart run with ``placement`` overrides, from its metrics."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable,
            "-m",
            "rlasync",
            "train",
            str(QUICKSTART),
            f"train.steps={steps}",
            "train.validate_every=100000",
            "train.checkpoint_every=0",
            f"train.run_dir={run_dir}",
            f"train.model_dir={model_dir}",
            *placement,
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=1800)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in records}
    first = min(WARMUP_STEPS, steps - 2)
    return (elapsed[steps - 1] - elapsed[first]) / (
        steps - 1 - first
    )  # the last step also validates: left out


async def head_cpu_per_trajectory(
    loops: str, steps: int, model_dir: Path, run_dir: Path, extra: list[str]
) -> float:
    """The head's CPU milliseconds per trajectory rolling out ``steps`` steps on simulated engines."""
    sim = {"base_s": 0.002, "per_seq_s": 0.00002, "median": 24, "sigma": 0.5, "cap": 48}
    config = load_config(
        QUICKSTART,
        [
            f"train.run_dir={run_dir}",
            f"train.model_dir={model_dir}",
            "cluster.engines=[1, 2]",
            f"cluster.agent_loops={loops}",
            "engine.backend=sim",
            *[f"engine.{name}={value}" for name, value in sim.items()],
            "weights.transport=broadcast",
            *extra,
        ],
    )
    run = await Run.open(config)
    try:
        await run.rollout(run.sampler.next_batch(config.train.prompts_per_step), name="warmup")
        trajectories = 0
        started = time.process_time()
        for step in range(steps):
            trajectories += len(
                await run.rollout(run.sampler.next_batch(config.train.prompts_per_step), name=f"step{step}")
            )
        cpu = time.process_time() - started
    finally:
        await run.close()
    return 1000 * cpu / trajectories


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="quickstart steps per run in (a)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="local/cluster pairs in (a); the median pair counts"
    )
    parser.add_argument("--sim-steps", type=int, default=20, help="rollout steps per placement in (b)")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=ROOT / "runs" / "cluster_bench",
        help="where the warm-started model is cached",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few steps of everything, to check that it runs"
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.sim_steps = 3, 1, 1  # 3: the fewest step_time can time
        # (b)'s node and rank processes (6) forked from a copy of this one with torch, the trainer
        # and the model's code loaded (as `rlasync train` starts them), not each started from
        # nothing: ~3 s of CPU less apiece. Before any thread exists. A full run starts them from
        # nothing, as it always has.
        fork_children(RuntimeConfig(preload_modules=("rlasync.trainer", "rlasync.models.model_code")))
    logging.basicConfig(level=logging.WARNING)
    extra = SMOKE if args.smoke else []
    if args.smoke:  # an untrained model: no warm-start
        from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

        model_dir = save_pretrained_dir(
            *build_tiny_lm(TinyLMConfig.preset("nano", seed=0)), args.run_dir / "nano"
        )
    else:
        model_dir = warm_model(args.run_dir)

    print(
        f"(a) quickstart, {args.steps} steps a run, {args.repeats} alternating pair(s): local placement vs engine and loops on node-1",
        flush=True,
    )
    pairs = []
    for repeat in range(args.repeats):
        local = step_time(extra, args.steps, model_dir)
        cluster = step_time(["cluster.engines=[1]", *extra], args.steps, model_dir)
        pairs.append((cluster / local, local, cluster))
        print(
            f"    pair {repeat + 1}: local {local * 1000:.1f} ms/step, cluster {cluster * 1000:.1f} ms/step, ratio {cluster / local:.3f}",
            flush=True,
        )
    ratio, local_s, cluster_s = sorted(pairs)[len(pairs) // 2] if len(pairs) % 2 else _median_pair(pairs)

    print(
        f"(b) head CPU per trajectory, simulated engines on node-1 and node-2, {args.sim_steps} steps of {'4' if args.smoke else '128'} trajectories",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        on_head = asyncio.run(
            head_cpu_per_trajectory("head", args.sim_steps, model_dir, Path(tmp) / "head", extra)
        )
        print(f"    loops on the head:  {on_head:.3f} ms of head CPU per trajectory", flush=True)
        on_nodes = asyncio.run(
            head_cpu_per_trajectory("engines", args.sim_steps, model_dir, Path(tmp) / "nodes", extra)
        )
        print(f"    loops on the nodes: {on_nodes:.3f} ms of head CPU per trajectory", flush=True)

    result = {
        "local_step_s": round(local_s, 4),
        "cluster_step_s": round(cluster_s, 4),
        "cluster_vs_local": round(ratio, 3),
        "head_cpu_ms_per_trajectory_loops_on_head": round(on_head, 3),
        "head_cpu_ms_per_trajectory_loops_on_nodes": round(on_nodes, 3),
        "head_cpu_ratio": round(on_nodes / on_head, 3),
        "head_trajectories_per_s_per_core": round(1000 / on_nodes),
    }
    print(
        f"goals: cluster_vs_local {result['cluster_vs_local']} <= 1.15; head_cpu_ratio {result['head_cpu_ratio']} <= 0.3; "
        f"head_trajectories_per_s_per_core {result['head_trajectories_per_s_per_core']:,} >= 13,000"
    )
    print(json.dumps(result))


def _median_pair(pairs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """With an even number of pairs: the median ratio, and the medians of each side."""
    return (
        statistics.median(p[0] for p in pairs),
        statistics.median(p[1] for p in pairs),
        statistics.median(p[2] for p in pairs),
    )


if __name__ == "__main__":
    main()
