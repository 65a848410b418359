"""Agent-loop workers on node processes, the manager, and the padded batch they produce."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import msgspec
import pytest
import torch
from waiting import wait_until

from rlasync import LocalCluster, RuntimeConfig
from rlasync.agents import (
    AgentLoopManager,
    AgentLoopWorker,
    AgentWorkerSpec,
    Trajectory,
    TrajectoryMetrics,
    collate,
)
from rlasync.config import AgentConfig, EngineConfig
from rlasync.engines import EngineActor, SamplingParams
from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

FAST = RuntimeConfig(
    heartbeat_interval_s=0.2,
    node_dead_after_s=1.5,
    join_timeout_s=60,
    preload_modules=("rlasync.engines", "rlasync.agents"),
)


def _t(prompt: list[int], response: list[int], mask: list[int], reward: float) -> Trajectory:
    n = len(response)
    return Trajectory(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        logprobs=[-0.1 * (i + 1) for i in range(n)],
        versions=[3 if m else -1 for m in mask],
        reward=reward,
        num_turns=2,
        termination="stop",
        metrics=TrajectoryMetrics(),
    )


def test_collate_pads_prompts_left_and_responses_right() -> None:
    batch = collate(
        [_t([1, 2, 3], [4, 5], [1, 1], 1.0), _t([6], [7, 8, 9, 10], [1, 0, 0, 1], 0.0)], pad_token_id=0
    )
    assert batch.prompts.tolist() == [[1, 2, 3], [0, 0, 6]]
    assert batch.responses.tolist() == [[4, 5, 0, 0], [7, 8, 9, 10]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]  # real tokens only
    assert batch.input_ids.shape == (2, 7) and batch.rewards.tolist() == [1.0, 0.0]
    assert batch.versions.tolist() == [[3, 3, -1, -1], [3, -1, -1, 3]]
    assert torch.equal(batch.logprobs[0], torch.tensor([-0.1, -0.2, 0.0, 0.0]))  # copied, not computed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=4))
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("nano"))


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_workers_on_two_nodes_roll_out_a_batch_and_a_lost_worker_loses_no_row(model_dir: Path) -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        engine = await cluster.spawn(EngineActor, EngineConfig(model=str(model_dir)), node=1, name="engine")
        spec = AgentWorkerSpec(model=str(model_dir), engines=[engine], agent=AgentConfig(response_length=512))
        workers = [await cluster.spawn(AgentLoopWorker, spec, node=n, name=f"worker-{n}") for n in (1, 2)]
        manager = AgentLoopManager(workers, pad_token_id=0)
        rows = [
            {"messages": [{"role": "user", "content": f"Reverse {w}"}], "uid": f"row-{i}"}
            for i, w in enumerate(["abc", "hgf", "dd", "eabc"] * 5)
        ]
        batch = await manager.generate(rows, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
        assert batch.responses.shape[0] == 20 and batch.response_mask.sum() > 0
        assert [t.messages[0]["content"] for t in batch.trajectories] == [
            r["messages"][0]["content"] for r in rows
        ]  # in order

        # Kill node-2 while its worker's loops generate: its rows run again on worker-1.
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=2)
        task = asyncio.ensure_future(manager.trajectories(rows, long))

        async def worker_2_generates() -> bool:
            from rlasync.agents.loops import LoopState

            states = msgspec.msgpack.decode(
                await workers[1].loop_states([r["uid"] for r in rows]), type=dict[str, LoopState]
            )
            return any(s.state == "GENERATING" for s in states.values())

        await wait_until(worker_2_generates, timeout_s=30, what="worker-2's loops generate")
        os.kill(cluster.pid(2), signal.SIGKILL)
        trajectories = await asyncio.wait_for(task, 120)
        assert len(trajectories) == 20 and all(len(t.response_ids) == 400 for t in trajectories)
        assert [w.name for w in manager.workers] == ["worker-1"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_trajectory_survives_its_engine_dying_mid_turn(model_dir: Path, stream: bool) -> None:
    from rlasync.agents import SingleTurnAgentLoop
    from rlasync.engines import Router
    from rlasync.models.tiny import load_tokenizer

    tok = load_tokenizer(model_dir)
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        engines = [
            await cluster.spawn(EngineActor, EngineConfig(model=str(model_dir)), node=n, name=f"engine-{n}")
            for n in (1, 2)
        ]
        async with Router(engines) as router:
            loop = SingleTurnAgentLoop(
                router, tok, AgentConfig(response_length=1000, stream=stream), trajectory_id="survivor"
            )
            params = SamplingParams(temperature=1.0, max_new_tokens=600, ignore_eos=True, seed=3)
            task = asyncio.ensure_future(
                loop.run(params, messages=[{"role": "user", "content": "Reverse abc"}])
            )
            await wait_until(
                lambda: any(e.outstanding for e in router.stats().engines),
                interval_s=0.005,
                what="the router sent the turn",
            )

            async def into_the_turn() -> bool:
                if stream:  # a few dozen tokens streamed into the loop's state
                    return len(loop.state.partial_ids) >= 24
                # An engine reports running rows after the step that gave them their first token.
                return any(s.running for s in await asyncio.gather(*[e.stats() for e in engines]))

            await wait_until(into_the_turn, timeout_s=30, what="the engine is generating the turn")
            assert not stream or loop.state.partial_ids
            serving = next(e.node for e in router.stats().engines if e.outstanding)
            os.kill(cluster.pid(serving), signal.SIGKILL)
            t = await asyncio.wait_for(task, 60)
            retries = router.stats().retries
    assert len(t.response_ids) == 600 and t.termination == "max_new_tokens"
    if stream:  # the turn went on from its streamed tokens on the other engine: nothing generated was lost
        assert t.metrics.aborts >= 1
    else:  # the router moved the request: the turn was generated again, whole, on the other engine
        assert retries >= 1 and t.metrics.aborts == 0
