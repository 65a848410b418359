"""Simulated tool calls (``rlasync.modes.sim_tools``): an agentic profile's trajectories make
their drawn number of calls through the real tool loop, each taking its drawn time on the
simulated clock, exact on a virtual-time loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rlasync.agents import get_loop
from rlasync.config import load_config
from rlasync.engines import SamplingParams
from rlasync.engines.sim import LatencyModel, LogNormalLengths, SimClock, VirtualTimeLoop
from rlasync.models import build_tokenizer
from rlasync.modes.profiles import PROFILES, ToolCalls
from rlasync.modes.sim import SimCluster, simulated_config, train_run

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def test_calls_and_latencies_are_drawn_from_the_seed_within_their_caps() -> None:
    tools = ToolCalls(
        mean_calls=3.0, max_calls=6, latency_median_s=2.0, latency_sigma=1.0, latency_cap_s=10.0
    )
    calls = [tools.calls(seed) for seed in range(4000)]
    assert calls == [tools.calls(seed) for seed in range(4000)]  # the seed decides
    assert min(calls) == 0 and max(calls) == 6
    # A geometric of mean 3 capped at 6 has mean sum_{k=1..6} (3/4)^k = 2.47.
    assert sum(calls) / len(calls) == pytest.approx(sum(0.75**k for k in range(1, 7)), abs=0.1)
    latencies = sorted(tools.latency_s(seed) for seed in range(4000))
    assert latencies[-1] == 10.0 and latencies[2000] == pytest.approx(2.0, rel=0.1)
    assert ToolCalls(mean_calls=0).calls(1) == 0
    assert PROFILES["generic-8b-h100-agent"].tools is not None


def _sync_step(latency_s: float, run_dir: Path) -> tuple[float, dict[str, Any]]:
    """One sync step's simulated seconds and record: 4 prompts x 2, every trajectory making
    exactly two tool calls (a geometric of huge mean, capped at 2) of ``latency_s`` each."""
    config = load_config(
        CONFIG,
        [
            "train.steps=1",
            "train.prompts_per_step=4",
            "train.group_size=2",
            "train.max_new_tokens=40",
            "agent.response_length=400",
            "train.validate_every=1000",
            f"train.run_dir={run_dir}",
            "train.model_dir=simulated",
        ],
    )
    tools = ToolCalls(
        mean_calls=1e9, max_calls=2, latency_median_s=latency_s, latency_sigma=0.0, latency_cap_s=1e6
    )

    async def main() -> tuple[float, dict[str, Any]]:
        clock = SimClock(0.01)
        records: list[dict[str, Any]] = []
        cluster = SimCluster(
            clock,
            engines=2,
            trainer_gpus=2,
            latency=LatencyModel(),
            lengths=LogNormalLengths(median=100, sigma=0.5, cap=500),
            tools=tools,
        )
        start = clock.now()
        await train_run(config, cluster, on_step=records.append)
        return clock.now() - start, records[0]

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())


def test_each_trajectory_waits_out_its_tool_calls_on_the_simulated_clock(tmp_path: Path) -> None:
    quick, record = _sync_step(0.0, tmp_path / "quick")
    slow, slow_record = _sync_step(1000.0, tmp_path / "slow")
    # Three model turns and two tool turns (and the prompt, as verl counts) in every trajectory.
    assert record["rollout/turns_mean"] == record["rollout/turns_max"] == 6
    assert slow_record["rollout/turns_mean"] == 6
    assert slow_record["rollout/tool_calls_mean"] == 2
    # Two calls of 1000 s in a row on every trajectory: the step waits them out, plus its model
    # turns (no longer than the whole of the quick step's, tools aside, per call gap).
    assert 2000.0 <= slow <= 2000.0 + 3 * quick


def test_the_loop_says_what_to_set_without_its_tool(tmp_path: Path) -> None:
    config = load_config(CONFIG, [f"train.run_dir={tmp_path}"])
    tools = ToolCalls()
    agent = simulated_config(config, SimClock(0.5), tools, token_block=8).agent
    assert agent.default_loop == "sim_tools"
    assert agent.tools == {
        "simulated_call": {"scale": 0.5, "token_block": 8, **msgspec.structs.asdict(tools)}
    }
    loop = get_loop("sim_tools")(None, build_tokenizer(), config.agent)  # type: ignore[arg-type]  # no tools given
    with pytest.raises(ValueError, match="agent.tools"):
        asyncio.run(loop.run(SamplingParams(), messages=[{"role": "user", "content": "hi"}]))
