"""The synchroniser between a real trainer actor (its rank 0 process) and a torch engine here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_batch import tiny_batch

from rlasync.config import TrainerConfig, WeightsConfig
from rlasync.engines import TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.trainer import TrainerActor
from rlasync.weights import EngineWeights, ParameterSynchronizer, SyncError

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.fixture
def model_dir(nano_model_dir: Path) -> Path:
    return nano_model_dir


@pytest.mark.parametrize(
    "world_size, transport",
    [(1, "shm"), (1, "broadcast"), (2, "auto")],
    ids=["shm", "broadcast", "fsdp2-shm-packed"],
)
@pytest.mark.numerics
async def test_after_a_step_the_engine_serves_the_trainers_parameters_exactly(
    model_dir: Path, world_size: int, transport: str
) -> None:
    engine = TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0])  # other weights to start with
    async with TrainerActor(
        TrainerConfig(world_size=world_size, strategy="fsdp2" if world_size > 1 else "ddp", lr=1e-2)
    ) as trainer:
        await trainer.start(model_dir)
        sync = ParameterSynchronizer(
            WeightsConfig(bucket_mb=0.05, alone_mb=0.02, transport=transport), trainer, engine
        )  # type: ignore[arg-type]
        await sync.start()
        for version in (1, 2):
            await trainer.step(tiny_batch())
            report = await sync.sync(version)
            expected = await trainer.weights()
            served = dict(engine.model.named_parameters())
            assert (
                engine.weight_version == version
                and report.attempts == 1
                and report.engines == {"local-0": version}
            )
            assert report.transports == {"local-0": "broadcast" if transport == "broadcast" else "shm"}
            assert all(torch.equal(served[name].detach(), tensor) for name, tensor in expected.items())
        sync.close()
    await engine.close()


@pytest.mark.parametrize("retries", [1, 0])
async def test_a_failed_sync_forms_a_new_group_or_stops_with_the_engine_on_its_last_version(
    model_dir: Path, retries: int
) -> None:
    engine = TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0])
    async with TrainerActor(TrainerConfig(world_size=1)) as trainer:
        await trainer.start(model_dir)
        sync = ParameterSynchronizer(
            WeightsConfig(timeout_s=3, retries=retries, transport="broadcast"), trainer, engine
        )
        await sync.start()
        await sync.sync(1)
        local = sync._targets[0].sink
        assert isinstance(local, EngineWeights)
        local.close_group()  # this side drops out: the trainer's rank 0 waits for it until the deadline
        if retries:
            report = await sync.sync(2)
            assert (
                report.attempts == 2
                and sync.generation == 1
                and engine.weight_version == 2
                and not report.removed
            )
        else:
            with pytest.raises(SyncError, match="no engine is left"):
                await sync.sync(2)
            assert engine.weight_version == 1  # never a half-loaded version
        sync.close()
    await engine.close()


async def test_the_trainer_changing_its_parameters_mid_copy_is_an_error_not_a_mixed_version(
    model_dir: Path,
) -> None:
    engine = TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0])
    async with TrainerActor(TrainerConfig(world_size=1)) as trainer:
        await trainer.start(model_dir)
        sync = ParameterSynchronizer(WeightsConfig(timeout_s=1, retries=0, transport="shm"), trainer, engine)
        await sync.start()
        await sync.sync(1)
        await trainer.step(
            tiny_batch()
        )  # marks the shared parameters as changing; nobody publishes version 2
        local = sync._targets[0].sink
        assert isinstance(local, EngineWeights)
        with pytest.raises(SyncError, match="was not published within weights.timeout_s=1"):
            await local.stage(2, 1.0)
        assert engine.weight_version == 1
        sync.close()
    await engine.close()


async def test_one_trainer_syncs_engines_one_after_another_each_with_its_own_group(model_dir: Path) -> None:
    engines = [TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0]) for _ in range(2)]
    async with TrainerActor(TrainerConfig(world_size=1, lr=1e-2)) as trainer:
        await trainer.start(model_dir)
        await trainer.step(tiny_batch())
        expected = await trainer.weights()
        for engine in engines:  # the trainer's rank 0 leaves one group and forms the next
            sync = ParameterSynchronizer(WeightsConfig(timeout_s=30), trainer, engine)
            await sync.start()
            await sync.sync(1)
            sync.close()
            served = dict(engine.model.named_parameters())
            assert all(torch.equal(served[name].detach(), tensor) for name, tensor in expected.items())
    for engine in engines:
        await engine.close()


async def test_a_trainer_rank_lost_mid_sync_stops_the_sync_and_takes_no_engine_out(model_dir: Path) -> None:
    """The sending side is gone: no retry can help, and the engine that waited for it did nothing
    wrong. The sync raises the trainer's RankLostError at once; the engine stays in rotation."""
    import os
    import signal
    import time

    from rlasync.trainer import RankLostError

    engine = TorchEngine(build_tiny_lm(TinyLMConfig.preset("nano", seed=9))[0])
    async with TrainerActor(TrainerConfig(world_size=1)) as trainer:
        await trainer.start(model_dir)
        sync = ParameterSynchronizer(
            WeightsConfig(timeout_s=30, retries=3, transport="broadcast"), trainer, engine
        )
        await sync.start()
        await sync.sync(1)
        os.kill(trainer.info["pids"][0], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankLostError):
            await sync.sync(2)
        assert time.monotonic() - started < 15 and sync.engines == {"local-0": 1} and not sync.removed
        sync.close()
    await engine.close()
