"""A fully async run whose engines are actors on two node processes, behind the router: a node
killed mid-run leaves rotation and the run trains every step on the survivor, within the
staleness bound, with no sample lost (``weights.on_engine_failure=remove``); with every engine
node dead the run stops with a typed error, promptly, and leaves no task behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from rlasync import LocalCluster, RuntimeConfig
from rlasync.config import load_config
from rlasync.engines import EngineActor, EngineConfig, EngineGroup, NoEngineError, Router, RouterConfig
from rlasync.models.tiny import load_tokenizer
from rlasync.modes import train_fully_async
from rlasync.modes.parts import Run
from rlasync.trainer import TrainerActor
from rlasync.weights import ParameterSynchronizer, SyncError

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
FAST = RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=2.0, call_timeout_s=60, join_timeout_s=60, preload_modules=("rlasync.engines",))


@contextlib.asynccontextmanager
async def _fleet(tmp_path: Path, model_dir: Path, steps: int) -> AsyncIterator[tuple[LocalCluster, Router, Run]]:
    config = load_config(CONFIG, [
        f"train.run_dir={tmp_path}", f"train.model_dir={model_dir}", "train.mode=fully_async", f"train.steps={steps}",
        "train.prompts_per_step=4", "train.group_size=4", "train.max_new_tokens=24", "trainer.lr=1e-3",
        "async_training.staleness_threshold=1", "weights.transport=broadcast", "weights.on_engine_failure=remove", "weights.timeout_s=10",
    ])  # fmt: skip
    async with LocalCluster(nodes=3, config=FAST) as cluster, TrainerActor(config.trainer, log_dir=tmp_path) as trainer:
        engine_config = EngineConfig(model=str(model_dir), max_batch=16)
        refs = list(await asyncio.gather(*[cluster.spawn(EngineActor, engine_config, node=n, name=f"engine-{n}") for n in (1, 2)]))
        await trainer.start(model_dir, total_steps=steps)
        router = Router(refs, RouterConfig())
        synchronizer = ParameterSynchronizer(config.weights, trainer, refs, router=router)
        await synchronizer.start()
        run = Run.from_parts(config, engine=EngineGroup(router), trainer=trainer, synchronizer=synchronizer, tokenizer=load_tokenizer(model_dir))
        try:
            yield cluster, router, run
        finally:
            synchronizer.close()
            await router.close()


def _kill(cluster: LocalCluster, *nodes: int) -> None:
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(cluster.pid(node), signal.SIGKILL)


@pytest.mark.timeout(300)
async def test_a_dead_engine_node_leaves_rotation_and_the_async_run_trains_every_step(tmp_path: Path, nano_model_dir: Path) -> None:
    steps = 8
    async with _fleet(tmp_path, nano_model_dir, steps) as (cluster, router, run):
        records: list[dict[str, Any]] = []

        def on_step(record: dict[str, Any]) -> None:
            records.append(record)
            if record["step"] == 2:  # generation for the next steps is in flight on both engines
                _kill(cluster, 2)

        result = await train_fully_async(run.config, on_step=on_step, run=run)
        assert result.steps == steps and [r["step"] for r in records] == list(range(1, steps + 1))
        assert [e.name for e in router.engines] == ["engine-1"]  # out of rotation, by the router or the synchroniser
        assert max(r["async/staleness_max"] for r in records) <= 1  # the bound holds through the loss
        last = records[-1]
        assert last["async/consumed"] == steps * 4  # every step got its whole batch
        # Nothing admitted was dropped: what was not trained on is still finished or running.
        assert last["async/admitted"] == last["async/consumed"] + last["async/queue_ready"] + last["async/in_flight"]
        assert records[-1]["async/version"] == steps  # every step's weights reached the survivor


@pytest.mark.timeout(300)
async def test_with_every_engine_node_dead_the_async_run_stops_with_a_typed_error(tmp_path: Path, nano_model_dir: Path) -> None:
    async with _fleet(tmp_path, nano_model_dir, 200) as (cluster, router, run):
        killed: list[float] = []

        def on_step(record: dict[str, Any]) -> None:
            if record["step"] == 2:
                _kill(cluster, 1, 2)
                killed.append(time.monotonic())

        with pytest.raises((NoEngineError, SyncError), match="engine"):
            await train_fully_async(run.config, on_step=on_step, run=run)
        assert time.monotonic() - killed[0] < 30  # the node deadline (2 s) and the sync's, not a hang
        assert not router.engines
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending  # the rollouter and its samples were stopped
