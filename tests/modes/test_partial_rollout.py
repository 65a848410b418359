"""Partial rollouts on the warm-started calculator model: a weight sync in the middle of tool
calls and of a long generation never waits for the tools, and every trajectory goes on under
the new weights with its tokens and per-token versions intact: cut and re-submitted
(``interrupt=abort``) or carried across the swap with its KV cache (``keep``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from waiting import wait_until

from rlasync.agents import SingleTurnAgentLoop, ToolAgentLoop
from rlasync.config import AgentConfig, AsyncTrainingConfig, TrainerConfig, WeightsConfig
from rlasync.data import synthetic_rows
from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import load_pretrained_dir
from rlasync.modes.fully_async import _sync
from rlasync.tools import CalculatorTool
from rlasync.trainer import TrainBatch, TrainerActor
from rlasync.weights import ParameterSynchronizer

uvloop = pytest.mark.asyncio(loop_factories=["uvloop"])


class HeldCalculator(CalculatorTool):
    """The calculator, held until the test lets it answer: a long-running tool."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0

    async def call(self, arguments: dict[str, Any], context: Any) -> str:
        self.running += 1
        await self.release.wait()
        return await super().call(arguments, context)


def _a_step(ids: list[int]) -> TrainBatch:
    """A big step on one sequence: enough to change the weights."""
    row = torch.tensor([ids])
    return TrainBatch(
        prompts=row[:, :-4],
        responses=row[:, -4:],
        response_mask=torch.ones(1, 4, dtype=torch.long),
        attention_mask=torch.ones_like(row),
        position_ids=torch.arange(row.shape[1])[None],
        logprobs=torch.full((1, 4), -2.0),
        advantages=torch.tensor([1.0]),
    )


@pytest.mark.timeout(600)  # the calculator warm-start (about a minute, more on a busy machine) runs first
@pytest.mark.parametrize("interrupt", ["abort", "keep"])
@uvloop
async def test_a_sync_mid_tool_call_never_waits_for_the_tool_and_trajectories_resume_intact(
    interrupt: str,
    calc_model: Path,
) -> None:
    _, tok = load_pretrained_dir(calc_model)
    engine = TorchEngine.from_pretrained(str(calc_model), max_batch=16)
    tool = HeldCalculator()
    rows = synthetic_rows("calc", 6, seed=0, split="val")
    greedy = SamplingParams(temperature=0, max_new_tokens=48)
    agent = AgentConfig(default_loop="tool", tools=["calculator"], max_tool_response_length=64)
    tool_loops = [
        ToolAgentLoop(engine, tok, agent, tools={"calculator": tool}, trajectory_id=f"tool{i}")
        for i in range(len(rows))
    ]
    long_loop = SingleTurnAgentLoop(engine, tok, trajectory_id="long")
    async with TrainerActor(TrainerConfig(lr=5e-2)) as trainer:
        await trainer.start(calc_model)
        synchronizer = ParameterSynchronizer(WeightsConfig(), trainer, engine)
        await synchronizer.start()
        tasks = [asyncio.ensure_future(loop.run(greedy, **row)) for loop, row in zip(tool_loops, rows)]

        def in_tool_calls() -> bool:  # every trajectory is in the middle of its tool call
            if tool.running >= len(rows):
                return True
            assert not any(t.done() for t in tasks), [t.result().termination for t in tasks if t.done()]
            return False

        await wait_until(in_tool_calls, timeout_s=120, what="every trajectory is inside its tool call")
        long_task = asyncio.ensure_future(
            long_loop.run(
                SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=1), **rows[0]
            )
        )
        await wait_until(
            lambda: any(
                seq.request.request_id.startswith("long") and len(seq.tokens) >= 8
                for seq in engine._by_id.values()
            ),
            interval_s=0.001,
            what="the long turn has 8 tokens",
        )
        await trainer.step(_a_step(tool_loops[0].state.prompt_ids + tool_loops[0].state.response_ids[:8]))
        started = time.monotonic()
        config = SimpleNamespace(
            weights=WeightsConfig(), async_training=AsyncTrainingConfig(interrupt=interrupt)
        )
        run = SimpleNamespace(engine=engine, synchronizer=synchronizer, config=config)
        weights = await _sync(run, None, 1, advance=False)  # type: ignore[arg-type]
        took = time.monotonic() - started
        assert engine.weight_version == 1 and not tool.release.is_set() and not any(t.done() for t in tasks)
        assert took < 10, took  # the tools are still running: the sync did not wait for them
        if interrupt == "abort":
            await wait_until(
                lambda: len(long_loop.state.partial_ids) >= 8,
                interval_s=0.001,
                what="the cut turn's output reached its loop",
            )
            cut = list(long_loop.state.partial_ids)  # the long turn's tokens so far, all version 0
            assert weights.reprefill_tokens and weights.reprefill_tokens >= len(cut)
        else:
            cut = list(
                next(
                    seq.tokens for seq in engine._by_id.values() if seq.request.request_id.startswith("long")
                )
            )
            assert weights.reprefill_tokens == 0 and len(cut) >= 8
        before = [(list(loop.state.response_ids), list(loop.state.versions)) for loop in tool_loops]
        tool.release.set()
        trajectories = await asyncio.gather(*tasks)
        long = await long_task
        synchronizer.close()
    await engine.close()
    for (ids, versions), t in zip(before, trajectories):
        model_versions = [v for v, m in zip(t.versions, t.response_mask) if m]
        assert (
            t.response_ids[: len(ids)] == ids and t.versions[: len(versions)] == versions
        )  # the first turn, intact
        assert set(versions) - {-1} == {0} and t.metrics.tool_calls >= 1
        assert (
            model_versions == sorted(model_versions) and model_versions[-1] == 1
        )  # answered under the new weights
    versions = long.versions
    assert long.response_ids[: len(cut)] == cut and len(long.response_ids) == 400
    assert long.metrics.aborts == (1 if interrupt == "abort" else 0)
    assert (
        versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    )  # cut mid-turn, resumed under v1
