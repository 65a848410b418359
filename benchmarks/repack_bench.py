"""Moving turns between real engines: samples/s with ``router.rebalance_queued`` against without.

    .venv/bin/python benchmarks/repack_bench.py [--rounds 16] [--batch 32] [--max-batch 2] [--smoke]

Two torch engines, each on a node process of its own (a core each), serve a tiny model behind
the head's router. A round is a synchronous step's rollout: ``--batch`` single-turn agent loops
with a long tail of answer lengths (log-normal, median ``--median`` tokens, sigma 1.0, capped;
``ignore_eos``, so each answer is exactly its drawn length), all started at once and all
awaited. Each engine starts at most ``--max-batch`` turns; the router sends it more, which wait
in its queue (the default config does the same: a cap of 256 a router, 64 a torch engine).

Least-outstanding routing evens the *number* of turns on each engine, not their work. The
engine that drew the longer answers still has turns queued when the other has finished all of
its own; without a move it idles to the end of the round. With ``router.rebalance_queued`` the
router, at each load refresh (``--refresh`` s), hands the newest queued turns to the least
loaded engine (``engines.repack.rebalance_moves``; a queued turn has made no token, so moving
it costs only the move).

Each round draws its lengths once and runs them both ways, alternating which goes first, so
both see the same work and the same machine state. Every answer is checked: exactly its drawn
length, every token a model token of version 0 (none lost, none made twice; the token-by-token
check across engines serving different weights is ``tests/engines/test_migrate.py``).

Prints a table and, last, one JSON line: ``repack_samples_per_s``, ``baseline_samples_per_s``,
``repack_speedup`` (their ratio; goal >= 1.15), ``repack_speedup_median_round``,
``shared_queue_bound`` (a round's decode steps with the router's split over those with one
queue over both engines' slots, the mean over rounds: the most any move between engines can
give this workload when a step costs the same at any batch), ``migrations``,
``answers_checked``. ``--smoke`` (for ``make test``): 2 short rounds, figures meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlasync import LocalCluster, RuntimeConfig
from rlasync.agents import SingleTurnAgentLoop
from rlasync.data import synthetic_rows
from rlasync.engines import EngineActor, EngineConfig, Router, RouterConfig, SamplingParams
from rlasync.engines.sim import LogNormalLengths
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir

RUNTIME = RuntimeConfig(call_timeout_s=600, join_timeout_s=120, preload_modules=("rlasync.engines",))


def makespan(turns: list[int], slots: int) -> int:
    """Decode steps for ``turns`` (answer lengths) on ``slots`` slots, each taking the next turn
    as it frees: one engine's queue in arrival order."""
    free = [0] * slots
    for n in turns:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free)


def bound(drawn: list[int], max_batch: int) -> float:
    """The most any move between the two engines can give a round, in decode steps: one queue
    over both engines' slots against the router's split (it alternates the turns it is given at
    once: least outstanding, ties to the first engine)."""
    split = max(makespan(drawn[0::2], max_batch), makespan(drawn[1::2], max_batch))
    return split / makespan(drawn, 2 * max_batch)


async def one_round(
    router: Router, tokenizer: Any, rows: list[dict[str, Any]], drawn: list[int], tag: str
) -> float:
    """Run ``rows`` (one answer of each drawn length) at once; seconds, after checking each answer."""
    loops = [SingleTurnAgentLoop(router, tokenizer, trajectory_id=f"{tag}-{i}") for i in range(len(rows))]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(drawn)
    ]
    started = time.perf_counter()
    trajectories = await asyncio.gather(*[loop.run(p, **row) for loop, p, row in zip(loops, params, rows)])
    seconds = time.perf_counter() - started
    for t, n in zip(trajectories, drawn):
        if len(t.response_ids) != n or not all(t.response_mask) or set(t.versions) != {0}:
            raise AssertionError(
                f"{t.trajectory_id}: {len(t.response_ids)} tokens for {n} drawn (versions {sorted(set(t.versions))}, "
                f"termination {t.termination!r})"
            )
    return seconds


async def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    _, tokenizer = load_pretrained_dir(model_dir)
    engine = EngineConfig(model=str(model_dir), max_batch=args.max_batch, cpu_threads=1)
    answers = LogNormalLengths(median=args.median, sigma=1.0, cap=args.cap)
    times: dict[str, list[float]] = {"baseline": [], "rebalance": []}
    bounds: list[float] = []
    migrations = checked = 0
    async with LocalCluster(nodes=3, config=RUNTIME) as cluster:
        engines = [
            await cluster.spawn(EngineActor, engine, node=node, name=f"engine-{node}") for node in (1, 2)
        ]
        routers = {
            name: RouterConfig(load_refresh_s=args.refresh, rebalance_queued=name == "rebalance")
            for name in times
        }
        rows = synthetic_rows("reverse", args.batch, seed=0, split="val")
        # One untimed round each: the engines' first steps (allocation, warm caches) out of the way.
        for name, config in routers.items():
            async with Router(engines, config) as router:
                await one_round(router, tokenizer, rows, [4] * args.batch, f"warm-{name}")
        for r in range(args.rounds):
            drawn = [answers.draw(r * args.batch + i) for i in range(args.batch)]
            bounds.append(bound(drawn, args.max_batch))
            order = list(routers) if r % 2 == 0 else list(reversed(routers))
            for name in order:
                async with Router(engines, routers[name]) as router:
                    times[name].append(await one_round(router, tokenizer, rows, drawn, f"{r}-{name}"))
                    migrations += router.stats().migrations if name == "rebalance" else 0
                checked += len(drawn)
            ratio = times["baseline"][-1] / times["rebalance"][-1]
            print(
                f"  round {r}: {sum(drawn)} tokens (longest {max(drawn)}): without {times['baseline'][-1]:.2f} s, "
                f"with {times['rebalance'][-1]:.2f} s: {ratio:.2f}x (one shared queue: {bounds[-1]:.2f}x)",
                flush=True,
            )
    ratios = [b / m for b, m in zip(times["baseline"], times["rebalance"])]
    return {
        "repack_samples_per_s": args.batch * args.rounds / sum(times["rebalance"]),
        "baseline_samples_per_s": args.batch * args.rounds / sum(times["baseline"]),
        "repack_speedup": sum(times["baseline"]) / sum(times["rebalance"]),
        "repack_speedup_median_round": statistics.median(ratios),
        "shared_queue_bound": statistics.mean(bounds),
        "migrations": float(migrations),
        "answers_checked": float(checked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="rounds; each is noisy (0.7-1.7x), so many")
    parser.add_argument("--batch", type=int, default=32, help="turns a round")
    parser.add_argument("--median", type=int, default=48, help="median answer length, tokens")
    parser.add_argument("--cap", type=int, default=480, help="longest answer, tokens")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=2,
        help="turns an engine runs at once (few: long contexts fill its KV cache)",
    )
    parser.add_argument("--refresh", type=float, default=0.1, help="router.load_refresh_s")
    parser.add_argument("--smoke", action="store_true", help="2 short rounds (seconds; figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.batch, args.median, args.cap = 2, 8, 8, 24
    print(
        f"2 torch engines on 2 node processes, max_batch {args.max_batch}; {args.batch} turns a round, answers "
        f"log-normal median {args.median} sigma 1.0 cap {args.cap}; router.load_refresh_s {args.refresh}:"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(
            save_pretrained_dir(*build_tiny_lm(TinyLMConfig.preset("nano", seed=0)), Path(tmp) / "nano")
        )
        result = asyncio.run(measure(args, model_dir))
    print(
        f"  with rebalance_queued {result['repack_samples_per_s']:.2f} samples/s, without "
        f"{result['baseline_samples_per_s']:.2f}: {result['repack_speedup']:.2f}x (goal >= 1.15x; median of rounds "
        f"{result['repack_speedup_median_round']:.2f}x); one queue over both engines would give {result['shared_queue_bound']:.2f}x "
        f"(the most any move can, in decode steps); {result['migrations']:.0f} turns moved, {result['answers_checked']:.0f} answers checked"
    )
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
