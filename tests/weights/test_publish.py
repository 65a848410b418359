"""Released delivery (``ParameterSynchronizer.publish``): the trainer goes on once its relay
holds a version, and each engine pulls the newest one at its own pace, with engine actors on
real node processes. A stalled engine delays no other: the rest take every version while it
is stopped, and it catches up, bit for bit; one whose pull fails is kept if it answers and
takes the newest version, skipping those it missed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inspect_engine import InspectableEngine
from tiny_batch import tiny_batch

from rlasync import LocalCluster, RuntimeConfig
from rlasync.config import TrainerConfig, WeightsConfig
from rlasync.engines import EngineConfig, Router, RouterConfig
from rlasync.trainer import TrainerActor
from rlasync.weights import ParameterSynchronizer, SyncError

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@contextlib.asynccontextmanager
async def _trainer_and_engines(
    model_dir: Path, names: dict[str, int], *, dead_after_s: float = 30.0
) -> AsyncIterator[tuple[LocalCluster, TrainerActor, list[Any]]]:
    """A cluster of 3 node processes, a started trainer, and engine actors ``name -> node``."""
    config = RuntimeConfig(
        heartbeat_interval_s=0.2,
        node_dead_after_s=dead_after_s,
        call_timeout_s=60,
        join_timeout_s=60,
        preload_modules=("rlasync.engines", "inspect_engine"),
    )
    async with (
        LocalCluster(nodes=3, config=config) as cluster,
        TrainerActor(TrainerConfig(world_size=1, lr=1e-2)) as trainer,
    ):
        engine = EngineConfig(model=str(model_dir))
        engines = list(
            await asyncio.gather(
                *[cluster.spawn(InspectableEngine, engine, node=n, name=name) for name, n in names.items()]
            )
        )
        await trainer.start(model_dir)
        yield cluster, trainer, engines


async def _until(condition: Any, what: str, within_s: float = 60.0) -> None:
    """Poll ``condition`` (a deadline, not a timing claim: it fails only if it never holds)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {within_s:g} s"
        await asyncio.sleep(0.05)


async def _same_as_trainer(trainer: TrainerActor, engine: Any) -> bool:
    expected, served = await trainer.weights(), await engine.parameters()
    return all(torch.equal(served[name], tensor) for name, tensor in expected.items())


async def test_a_stalled_engine_delays_neither_the_trainer_nor_the_others_and_catches_up(
    nano_model_dir: Path,
) -> None:
    deadline = 3.0  # a stopped engine is slow here, not dead (node_dead_after_s is 30 s)
    async with _trainer_and_engines(nano_model_dir, {"engine-1": 1, "engine-2": 2}) as (
        cluster,
        trainer,
        engines,
    ):
        async with Router(engines, RouterConfig()) as router:
            sync = ParameterSynchronizer(
                WeightsConfig(transport="broadcast", bucket_mb=0.01, timeout_s=deadline, max_live_versions=2),
                trainer,
                engines,
                router=router,
            )
            served: list[int] = []
            sync.served_listeners.append(served.append)
            await sync.start()
            assert sync.can_release
            try:
                await sync.publish(1)
                await sync.settle()
                assert sync.engines == {"engine-1": 1, "engine-2": 1} and served[-1] == 1

                os.kill(cluster.pid(2), signal.SIGSTOP)  # engine-2 stops answering mid-run
                stopped = time.monotonic()
                for version in (2, 3):
                    await trainer.step(tiny_batch(version))
                    report = await sync.publish(version)
                    # Returned with engine-2 neither current nor out: nobody waited for it.
                    assert "engine-2" in report.engines and sync.engines["engine-2"] == 1
                    await _until(
                        lambda v=version: sync.engines["engine-1"] == v, f"engine-1 taking v{version}"
                    )
                assert await _same_as_trainer(trainer, engines[0])
                assert sync.served == 1 and served[-1] == 1  # admissions still count from engine-2's v1

                # It answers again, past the deadline of the trainer's side of its pull.
                await asyncio.sleep(max(0.0, deadline + 1.0 - (time.monotonic() - stopped)))
                os.kill(cluster.pid(2), signal.SIGCONT)
                await sync.settle()
                assert sync.engines == {"engine-1": 3, "engine-2": 3} and not sync.removed
                assert sync.served == 3 and served[-1] == 3
                assert await _same_as_trainer(trainer, engines[1])
                assert [e.name for e in router.engines] == ["engine-1", "engine-2"]
                await trainer.step(tiny_batch(4))
                taken = await sync.publish(4)  # what the engines took since v3 was published
                assert taken.engines == {"engine-1": 3, "engine-2": 3} and taken.expected == 3
                assert taken.engine_idle_s >= 0 and not taken.all_paused
            finally:
                os.kill(cluster.pid(2), signal.SIGCONT)
                sync.close()


async def test_an_engine_whose_pull_fails_is_kept_and_takes_the_newest_version(nano_model_dir: Path) -> None:
    async with _trainer_and_engines(nano_model_dir, {"engine-1": 1, "engine-2": 2}) as (_, trainer, engines):
        sync = ParameterSynchronizer(
            WeightsConfig(transport="broadcast", bucket_mb=0.01, timeout_s=3.0, max_live_versions=2),
            trainer,
            engines,
        )
        await sync.start()
        target = next(t for t in sync._targets if t.name == "engine-2")
        stage, staged = target.sink.stage, []

        async def fails_once_v3_is_out(version: int, timeout_s: float) -> float:
            staged.append(version)
            if version == 1:
                await _until(lambda: sync.newest == 2, "v2's publish")
                raise SyncError("injected: the pull of v1 broke")
            return await stage(version, timeout_s)

        target.sink.stage = fails_once_v3_is_out  # type: ignore[method-assign]
        try:
            await sync.publish(1)
            await _until(lambda: sync.engines["engine-1"] == 1, "engine-1 taking v1")
            await trainer.step(tiny_batch(2))
            await sync.publish(2)
            await sync.settle()
            assert staged == [1, 2] and sync.engines == {"engine-1": 2, "engine-2": 2} and not sync.removed
            assert sync.generation >= 1  # its pair was formed again
            assert await _same_as_trainer(trainer, engines[1])
        finally:
            sync.close()


async def test_without_a_relay_publish_is_a_whole_sync(nano_model_dir: Path) -> None:
    """``weights.max_live_versions=1``: the trainer's parameters are the only copy, so the
    trainer waits until every engine has the version (``can_release`` is false)."""
    async with _trainer_and_engines(nano_model_dir, {"engine-1": 1}) as (_, trainer, (engine,)):
        sync = ParameterSynchronizer(
            WeightsConfig(transport="broadcast", max_live_versions=1), trainer, [engine]
        )
        await sync.start()
        try:
            assert not sync.can_release
            await trainer.step(tiny_batch(1))
            report = await sync.publish(1)
            assert report.engines == {"engine-1": 1} and await _same_as_trainer(trainer, engine)
        finally:
            sync.close()


async def test_engines_of_one_node_take_each_version_once_from_the_trainer_and_copy_it_there(
    nano_model_dir: Path,
) -> None:
    """Two engines on node 1, one on node 2: the trainer forms a pair group with one engine of
    each node, which keeps each version in its node's relay; node 1's other engine copies it
    from there. Every engine serves the trainer's parameters bit for bit, after a whole sync and
    after released pulls; node 1 killed, its engines leave rotation and the run goes on."""
    names = {"engine-0": 1, "engine-1": 1, "engine-2": 2}
    async with _trainer_and_engines(nano_model_dir, names, dead_after_s=2.0) as (cluster, trainer, engines):
        async with Router(engines, RouterConfig()) as router:
            sync = ParameterSynchronizer(
                WeightsConfig(transport="broadcast", bucket_mb=0.01, timeout_s=5.0),
                trainer,
                engines,
                router=router,
            )
            await sync.start()
            try:
                await trainer.step(tiny_batch(1))
                report = await sync.sync(1)
                assert report.transports == {
                    "engine-0": "broadcast",
                    "engine-1": "node",
                    "engine-2": "broadcast",
                }
                assert sorted(t.name for t in sync._targets if t.grouped) == ["engine-0", "engine-2"]
                for version in (2, 3):
                    await trainer.step(tiny_batch(version))
                    await sync.publish(version)
                await sync.settle()
                assert sync.engines == {"engine-0": 3, "engine-1": 3, "engine-2": 3}
                for engine in engines:
                    assert await _same_as_trainer(trainer, engine)

                os.kill(cluster.pid(1), signal.SIGKILL)  # the node holding a relay and both its engines
                await trainer.step(tiny_batch(4))
                await sync.publish(4)
                await sync.settle()  # node 1's pulls fail once it is declared dead
                assert sync.engines == {"engine-2": 4} and sorted(sync.removed) == ["engine-0", "engine-1"]
                assert [e.name for e in router.engines] == ["engine-2"]
                assert await _same_as_trainer(trainer, engines[2])
            finally:
                sync.close()
