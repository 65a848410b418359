"""What Prometheus costs: actor calls and quickstart steps with ``runtime.metrics_port`` on and
off, in one run.

    .venv/bin/python benchmarks/metrics_bench.py            # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/metrics_bench.py --smoke    # seconds: that it runs (make test)

(a) Calls: two 2-node clusters up at once, one with metrics on, one off; pipelined echo calls
(``actor_bench.py``'s, 1,000 in flight) in alternating rounds, and while the "on" cluster is
measured a scraper (a process of its own, as Prometheus is) reads both its nodes' ``/metrics``
every ``--scrape-every`` seconds (1 s: fifteen times Prometheus's default). ``calls_metrics_on_vs_off`` = median calls/s on / off.

(b) Steps: the quickstart (``configs/quickstart.yaml``, sync, one node and its trainer rank),
the same seeds, five runs each way alternating off and on, the "on" ones scraped the same way (every node in
``prometheus_targets.json``). A run's throughput is its steps per second after its first steps
(start-up excluded, from ``metrics.jsonl``'s ``elapsed_s``); ``step_metrics_on_vs_off`` = the
median over rounds of the "on" run's rate / the "off" run's (each round runs both, in turn
first: ABBA). Goals: >= 0.95 and
>= 0.98. Single runs vary by a few percent on a shared machine: run it on an idle one.

Last line: ``{"calls_metrics_on_vs_off":…, "step_metrics_on_vs_off":…, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the nodes import actor_bench's Echo

from actor_bench import Echo, _window

import rlasync
from rlasync.compose.model_dir import model_dir_for
from rlasync.compose.telemetry import TARGETS_FILE
from rlasync.config import RuntimeConfig, load_config
from rlasync.config.cluster import with_node_modules
from rlasync.metrics.plot import read_records
from rlasync.models import build_tiny_lm, save_pretrained_dir
from rlasync.modes import train
from rlasync.runtime.spawner import fork_children

ROOT = Path(__file__).resolve().parents[1]
# --smoke's quickstart runs: a few short trajectories a step and a few prompts to validate, drawn
# from 64 synthetic problems (not 20,000: ~0.4 s a run to make).
SMOKE_STEPS = [
    "train.prompts_per_step=2",
    "train.group_size=2",
    "train.max_new_tokens=8",
    "train.val_size=4",
    "data.synthetic_train_size=64",
]


# A scraper of its own process, as a Prometheus server is: in this one it would compete with the
# head (this process) for the GIL, which Prometheus never does. It reads ``argv[1]`` (a targets
# file, or addresses joined by commas) every ``argv[2]`` seconds until stdin closes, then prints
# how many scrapes it made.
_SCRAPER = """
import json, sys, threading, urllib.request
source, every = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
done = 0
while True:
    try:
        targets = [g["targets"][0] for g in json.load(open(source))] if source.endswith(".json") else source.split(",")
    except (OSError, ValueError):
        targets = []
    for target in targets:
        try:
            urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read()
            done += 1
        except OSError:
            pass
    if stop.wait(every):
        break
print(done)
"""


class Scraper:
    """Scrapes ``source`` (a targets file, or ``host:port`` addresses joined by commas) every
    ``every`` seconds from another process, while the ``async with`` block runs; ``scrapes``: how
    many. Stopped off the event loop: the nodes this process heads answer /metrics on it, and a
    scrape under way would otherwise wait out its 2 s deadline."""

    def __init__(self, source: str, every: float) -> None:
        self.source, self.every, self.scrapes = source, every, 0

    async def __aenter__(self) -> Scraper:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER, self.source, str(self.every)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        # stdin closes: it stops and reports
        out, _ = await asyncio.to_thread(self._proc.communicate, "", 30)
        self.scrapes = int(out.strip() or 0)


# -- (a) actor calls ---------------------------------------------------------------------------
async def bench_calls(calls: int, rounds: int, scrape_every: float) -> dict[str, Any]:
    # Both heads share this process's event loop, which one cluster's 1,000 calls in flight keep
    # saturated for seconds at a time: the other's heartbeats get a longer deadline than 3 s.
    patient = RuntimeConfig(node_dead_after_s=30.0)
    async with (
        rlasync.LocalCluster(nodes=2, config=patient) as off_cluster,
        rlasync.LocalCluster(nodes=2, config=msgspec.structs.replace(patient, metrics_port=0)) as on_cluster,
    ):
        off = await off_cluster.spawn(Echo, node=1)
        on = await on_cluster.spawn(Echo, node=1)
        addresses = [m.metrics for m in await on_cluster.head.members()]
        assert all(addresses), addresses
        for echo in (off, on):  # warm both: connections made, code paths hot
            await _window(echo.echo, min(calls, 2000), 1000)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        scrapes = 0
        for _ in range(rounds):
            rates["off"].append(calls / await _window(off.echo, calls, 1000))
            async with Scraper(",".join(addresses), scrape_every) as scraper:
                rates["on"].append(calls / await _window(on.echo, calls, 1000))
            scrapes += scraper.scrapes
    return {
        "calls_per_s_off": statistics.median(rates["off"]),
        "calls_per_s_on": statistics.median(rates["on"]),
        "scrapes": scrapes,
    }


# -- (b) quickstart steps ----------------------------------------------------------------------
def steps_per_s(run_dir: Path, skip: int) -> float:
    """Steps per second after the first ``skip`` steps (start-up and compile excluded)."""
    timed = [r for r in read_records(run_dir) if r["step"] >= skip]
    return (len(timed) - 1) / (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"])


async def bench_steps(
    model_dir: Path, out: Path, steps: int, rounds: int, scrape_every: float, extra: list[str]
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"off": [], "on": []}
    scrapes = 0
    skip = max(2, steps // 5)
    for r in range(rounds):
        # ABBA: the order flips every round, so a machine that drifts (slows down or speeds up
        # over minutes) favours neither side.
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            run_dir = out / f"{mode}-{r}"
            overrides = [
                f"train.steps={steps}",
                f"train.validate_every={steps * 10}",  # the first and the last: none in between
                "train.val_size=16",
                f"train.model_dir={model_dir}",
                f"train.run_dir={run_dir}",
                *(["runtime.metrics_port=0"] if mode == "on" else []),
                *extra,
            ]
            config = load_config(ROOT / "configs" / "quickstart.yaml", overrides)
            async with Scraper(str(run_dir / TARGETS_FILE), scrape_every) as scraper:
                await train(config)
            scrapes += scraper.scrapes
            rates[mode].append(steps_per_s(run_dir, skip))
            print(f"  round {r} metrics {mode:3}: {rates[mode][-1]:.2f} steps/s", flush=True)
    return {
        "steps_per_s_off": statistics.median(rates["off"]),
        "steps_per_s_on": statistics.median(rates["on"]),
        # Each round's "on" run against its "off" run (the machine's state drifts between rounds;
        # within a round it is most alike): the median of those ratios.
        "pair_ratio": statistics.median(on / off for on, off in zip(rates["on"], rates["off"])),
        "scrapes": scrapes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a few calls and steps (the figures mean nothing)"
    )
    parser.add_argument(
        "--scrape-every", type=float, default=1.0, help="seconds between scrapes of each node"
    )
    parser.add_argument("--steps", type=int, default=60, help="steps of each quickstart run")
    parser.add_argument(
        "--rounds", type=int, default=5, help="quickstart runs with metrics off, and as many on"
    )
    args = parser.parse_args()
    # A round of calls lasts a few seconds, so a scrape a second lands in each "on" round.
    calls, call_rounds = (2000, 1) if args.smoke else (200_000, 5)
    steps, rounds = (4, 1) if args.smoke else (args.steps, args.rounds)
    scrape_every = 0.2 if args.smoke else args.scrape_every
    # Node processes and trainer ranks forked from a copy of this process with the node's modules
    # loaded, as `rlasync train` starts them; before any thread exists.
    fork_children(with_node_modules(RuntimeConfig()))

    with tempfile.TemporaryDirectory(prefix="metrics-bench-") as tmp:
        t = time.perf_counter()
        if args.smoke:  # an untrained model: the smoke checks that everything runs
            model_dir = Path(tmp) / "nano"
            save_pretrained_dir(*build_tiny_lm("nano"), model_dir)
        else:  # the quickstart's warm-start, kept in runs/metrics_bench for the next time
            cache = load_config(ROOT / "configs" / "quickstart.yaml", ["train.run_dir=runs/metrics_bench"])
            model_dir = rlasync.run(model_dir_for(cache))
        print(f"model: {model_dir} ({time.perf_counter() - t:.0f} s)", flush=True)
        call_r = rlasync.run(bench_calls(calls, call_rounds, scrape_every))
        print(
            f"actor calls/s   off {call_r['calls_per_s_off']:9.0f}   on {call_r['calls_per_s_on']:9.0f}"
            f"   ({call_r['scrapes']} scrapes)",
            flush=True,
        )
        step_r = rlasync.run(
            bench_steps(model_dir, Path(tmp), steps, rounds, scrape_every, SMOKE_STEPS if args.smoke else [])
        )
        print(
            f"quickstart steps/s   off {step_r['steps_per_s_off']:.3f}   on {step_r['steps_per_s_on']:.3f}"
            f"   ({step_r['scrapes']} scrapes)"
        )
    result = {
        "calls_metrics_on_vs_off": round(call_r["calls_per_s_on"] / call_r["calls_per_s_off"], 3),
        "step_metrics_on_vs_off": round(step_r["pair_ratio"], 3),
        "calls_per_s_off": round(call_r["calls_per_s_off"]),
        "calls_per_s_on": round(call_r["calls_per_s_on"]),
        "steps_per_s_off": round(step_r["steps_per_s_off"], 3),
        "steps_per_s_on": round(step_r["steps_per_s_on"], 3),
        "scrape_every_s": scrape_every,
        "scrapes": call_r["scrapes"] + step_r["scrapes"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
