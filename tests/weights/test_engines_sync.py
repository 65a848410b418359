"""The synchroniser with engine actors on real node processes: every engine gets the trainer's
parameters bit for bit, over the broadcast or shared memory; an engine killed or stalled mid-sync
is an error within the deadline, and it leaves rotation (or the run stops), never a hang."""

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
from rlasync.engines import EngineConfig, Router, RouterConfig, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.trainer import TrainerActor
from rlasync.weights import ParameterSynchronizer, SyncError

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

FAST = RuntimeConfig(
    heartbeat_interval_s=0.2,
    node_dead_after_s=2.0,
    call_timeout_s=60,
    join_timeout_s=60,
    preload_modules=("rlasync.engines", "inspect_engine"),
)


async def _engines(cluster: LocalCluster, model_dir: Path) -> list[Any]:
    config = EngineConfig(model=str(model_dir))
    return list(
        await asyncio.gather(
            *[cluster.spawn(InspectableEngine, config, node=n, name=f"engine-{n}") for n in (1, 2)]
        )
    )


@pytest.mark.parametrize(
    "transport, bucket_mb",
    [("broadcast", 0.01), ("broadcast", 64.0), ("auto", 0.05)],
    ids=["broadcast-tiny-buckets", "broadcast-one-bucket", "shm"],
)
async def test_every_engine_on_every_node_serves_the_trainers_parameters_bit_for_bit(
    nano_model_dir: Path, transport: str, bucket_mb: float
) -> None:
    local = TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0])  # and one in this process
    async with (
        LocalCluster(nodes=3, config=FAST) as cluster,
        TrainerActor(TrainerConfig(world_size=1, lr=1e-2)) as trainer,
    ):
        remote = await _engines(cluster, nano_model_dir)
        await trainer.start(nano_model_dir)
        async with Router(remote, RouterConfig()) as router:
            sync = ParameterSynchronizer(
                WeightsConfig(bucket_mb=bucket_mb, transport=transport),
                trainer,
                [*remote, local],
                router=router,
            )  # type: ignore[arg-type]
            await sync.start()
            for version in (1, 2):
                await trainer.step(tiny_batch(version))
                report = await sync.sync(version)
                assert (
                    report.engines == {"engine-1": version, "engine-2": version, "local-2": version}
                    and not report.removed
                )
                assert set(report.transports.values()) == {"shm" if transport == "auto" else "broadcast"}
            expected = await trainer.weights()
            for served in [
                *(await asyncio.gather(*[e.parameters() for e in remote])),
                dict(local.model.named_parameters()),
            ]:
                assert served.keys() == expected.keys()
                assert all(torch.equal(served[name].detach(), tensor) for name, tensor in expected.items())
            assert await asyncio.gather(*[e.weight_version() for e in remote]) == [2, 2]
            assert [e.name for e in router.engines] == ["engine-1", "engine-2"]
            sync.close()
    await local.close()


@pytest.mark.parametrize("policy", ["remove", "stop"])
@pytest.mark.parametrize("fault", ["killed", "stalled"])
async def test_an_engine_killed_or_stalled_mid_sync_is_an_error_within_the_deadline(
    nano_model_dir: Path, fault: str, policy: str
) -> None:
    deadline = 3.0
    async with (
        LocalCluster(nodes=3, config=FAST) as cluster,
        TrainerActor(TrainerConfig(world_size=1, lr=1e-2)) as trainer,
    ):
        remote = await _engines(cluster, nano_model_dir)
        await trainer.start(nano_model_dir)
        async with Router(remote, RouterConfig()) as router:
            config = WeightsConfig(
                bucket_mb=0.01, transport="broadcast", timeout_s=deadline, on_engine_failure=policy
            )  # type: ignore[arg-type]
            sync = ParameterSynchronizer(config, trainer, remote, router=router)
            await sync.start()
            await sync.sync(1)
            await trainer.step(tiny_batch(1))
            victim = cluster.pid(2)
            os.kill(victim, signal.SIGSTOP)  # engine-2 stops answering: the sync starts without it

            async def fault_mid_sync() -> None:
                await asyncio.sleep(0.5)  # the trainer is broadcasting by now, engine-2 takes no part
                if fault == "killed":
                    os.kill(victim, signal.SIGKILL)

            started = time.monotonic()
            try:
                if policy == "stop":
                    with pytest.raises(SyncError, match="on_engine_failure=stop"):
                        await asyncio.gather(sync.sync(2), fault_mid_sync())
                    assert await remote[0].weight_version() == 1  # staged at most: never switched alone
                else:
                    report, _ = await asyncio.gather(sync.sync(2), fault_mid_sync())
                    assert report.removed == ["engine-2"] and report.engines == {"engine-1": 2}
                    assert [e.name for e in router.engines] == ["engine-1"]  # out of rotation
                    await trainer.step(tiny_batch(2))
                    assert (await sync.sync(3)).engines == {"engine-1": 3}  # the run goes on with the rest
                    expected, served = await trainer.weights(), await remote[0].parameters()
                    assert all(torch.equal(served[name], tensor) for name, tensor in expected.items())
                # The trainer gave up at the deadline; the stalled engine's call a little after.
                print(f"{fault}/{policy}: sync ended after {time.monotonic() - started:.1f} s")
                assert time.monotonic() - started < 3 * deadline + 10
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                sync.close()


@contextlib.asynccontextmanager
async def _one_engine_and_a_late_one(nano_model_dir: Path) -> AsyncIterator[tuple[Any, ...]]:
    """A trainer after one step, its synchroniser over one engine in a router, and a second
    engine not yet added: (trainer, router, sync, late)."""
    async with (
        LocalCluster(nodes=3, config=FAST) as cluster,
        TrainerActor(TrainerConfig(world_size=1, lr=1e-2)) as trainer,
    ):
        first, late = await _engines(cluster, nano_model_dir)
        await trainer.start(nano_model_dir)
        async with Router([first], RouterConfig()) as router:
            sync = ParameterSynchronizer(
                WeightsConfig(transport="broadcast"), trainer, [first], router=router
            )
            await sync.start()
            await trainer.step(tiny_batch(1))
            try:
                yield trainer, router, sync, late
            finally:
                sync.close()


async def test_an_engine_added_later_enters_rotation_once_it_serves_the_current_version(
    nano_model_dir: Path,
) -> None:
    async with _one_engine_and_a_late_one(nano_model_dir) as (trainer, router, sync, late):
        await sync.sync(1)
        await sync.add_engine(late)  # e.g. a restarted node: out of rotation until it is current
        assert [e.name for e in router.engines] == ["engine-1"]
        await trainer.step(tiny_batch(2))
        report = await sync.sync(2)
        assert report.engines == {"engine-1": 2, "engine-2": 2} and sync.generation == 1
        assert [e.name for e in router.engines] == ["engine-1", "engine-2"]
        expected, served = await trainer.weights(), await late.parameters()
        assert all(torch.equal(served[name], tensor) for name, tensor in expected.items())


async def test_an_engine_added_while_a_sync_is_sending_joins_at_the_next_one(
    nano_model_dir: Path,
) -> None:
    """A node that joins again mid-sync (fully_async: its handler runs beside the trainer's sync)
    has not staged that version: the sync commits what it staged and leaves the new engine
    joining, instead of committing to it and dropping it for good (CI saw engine-2 leave
    rotation at its first sync, "failed while committing", and never come back)."""
    async with _one_engine_and_a_late_one(nano_model_dir) as (trainer, router, sync, late):
        send = sync.source.send_weights

        async def send_then_a_node_joins(version: int, peers: Any = None) -> Any:
            sent = await send(version, peers)
            await sync.add_engine(late)  # after the staged list was taken, before the commit
            return sent

        sync.source.send_weights = send_then_a_node_joins
        report = await sync.sync(1)
        sync.source.send_weights = send
        assert report.removed == [] and report.engines == {"engine-1": 1, "engine-2": -1}  # joining
        assert [e.name for e in router.engines] == ["engine-1"]
        await trainer.step(tiny_batch(2))
        report = await sync.sync(2)
        assert report.engines == {"engine-1": 2, "engine-2": 2} and not sync.removed
        assert [e.name for e in router.engines] == ["engine-1", "engine-2"]
