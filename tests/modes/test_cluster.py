"""Runs that span node processes (``cluster.*``), through the package's one composition.

The quickstart on its cluster placement learns in the sync and the fully async mode (real
``rlasync train`` processes). A killed engine node leaves rotation and every step is still
trained, on the survivor, within the staleness bound, with no sample dropped; a killed node that
holds a trainer rank stops the run with ``RankLostError`` within ``trainer.operation_timeout_s``,
leaving no process and no task behind; with every engine node dead the run stops with a typed
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from learning import RISE, reward_rise

from rlasync.agents import NoWorkerError
from rlasync.compose.run import Run
from rlasync.config import load_config
from rlasync.engines import NoEngineError
from rlasync.modes import train_fully_async, train_one_step_off, train_sync
from rlasync.runtime.spawner import current_spawner
from rlasync.trainer import RankLostError
from rlasync.weights import SyncError

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop `rlasync train` runs on

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"
FAST = ["runtime.heartbeat_interval_s=0.2", "runtime.node_dead_after_s=2.0", "runtime.join_timeout_s=60"]


def _config(tmp_path: Path, model_dir: Path, *overrides: str) -> Any:
    small = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={model_dir}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=24",
        "train.val_size=8",
        "train.validate_every=1000",
        # A few steps of 4 prompts: 256 problems, not 20,000 built in the head's reading thread
        # while its loop must answer heartbeats within FAST's 2 s on a loaded machine.
        "data.synthetic_train_size=256",
        "trainer.lr=1e-3",
        *FAST,
    ]
    return load_config(CLUSTER, [*small, *overrides])


def _kill(run: Run, *nodes: int) -> None:
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.cluster.pid(node), signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every live (not zombie) process below ``pid``, but this test process's spawner (it forks
    the nodes the tests start, and lives as long as the session: tests/conftest.py)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                children.setdefault(int(stat[1]), []).append(int(entry.name))
    spawner = current_spawner()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if spawner is None or child != spawner.pid:
                found.append(child)
            todo.append(child)
    return found


async def _run(
    config: Any, schedule: Callable[..., Any], on_step: Callable[[Run, dict[str, Any]], None]
) -> tuple[Run, Any]:
    run = await Run.open(config)
    result = await schedule(config, run=run, on_step=lambda record: on_step(run, record))
    return run, result


# -- learning: the quickstart on its cluster placement, as a user runs it ---------------------------
# The run's own deadline (400 s), plus the warm-start the first test asking for reverse_model
# builds: pytest's default 120 s (which, under xdist, kills the worker) is below a loaded run's time.
ANSWER = """\
import openai


async def answer(client: openai.AsyncOpenAI, row: dict) -> None:
    await client.chat.completions.create(model="policy", messages=row["messages"])  # the run's reward scores it
"""


@pytest.mark.timeout(450)
@pytest.mark.parametrize(("mode", "loop"), [("sync", "openai"), ("fully_async", "single_turn")])
async def test_the_quickstart_cluster_learns(
    tmp_path: Path, reverse_model: Path, mode: str, loop: str
) -> None:
    """3 node processes: 2 engine replicas with their loops on nodes 1 and 2, trainer ranks on
    nodes 0 and 1. A short run (docs/clusters.md has the full one): its reward rises. The sync
    run's rows are answered by an agent of plain OpenAI-client calls (the ``openai`` loop: each
    worker's endpoint next to its engine; validation greedy because the agent leaves the
    temperature to the run). The async run learns a little slower on a loaded machine (more of
    its samples are a version stale): it gets 140 steps (0.32-0.36 after 100 steps, with the
    whole suite running beside it)."""
    steps = 100 if mode == "sync" else 140
    agent = tmp_path / "agents.py"
    agent.write_text(ANSWER)
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(CLUSTER),
        f"train.mode={mode}",
        f"train.steps={steps}",
        "train.validate_every=1000",  # at the start and the end only: those two are compared
        f"train.run_dir={tmp_path}",
        f"train.model_dir={reverse_model}",
        f"agent.default_loop={loop}",
        *([f"agent.openai_agent={agent}:answer"] if loop == "openai" else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert reward_rise(records) >= RISE, (reward_rise(records), result)
    assert [r["step"] for r in records[1:]] == list(range(1, steps + 1)) and all(
        r["cluster/engines"] == 2 for r in records
    )
    assert (
        "cluster: 3 node(s); engine replicas on node-1, node-2; agent loops next to their engines; trainer ranks on node-0, node-1"
        in done.stderr
    )
    # A clean run alarms nobody: the nodes and rank processes that shut down at its end left.
    alarming = [line for line in done.stderr.splitlines() if " WARNING " in line or "declared dead" in line]
    assert not alarming, alarming
    assert "node-2 left the cluster (it shut down)" in done.stderr


# -- failures ---------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
async def test_a_killed_engine_node_leaves_rotation_and_the_async_run_trains_every_step(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    steps = 8
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.mode=fully_async",
        f"train.steps={steps}",
        "cluster.trainer=[0]",
        "trainer.world_size=1",
        "async_training.staleness_threshold=1",
        "weights.on_engine_failure=remove",
        "weights.timeout_s=10",
    )
    records: list[dict[str, Any]] = []

    def on_step(run: Run, record: dict[str, Any]) -> None:
        records.append(record)
        if record["step"] == 2:  # generation for the next steps is in flight on both engines
            _kill(run, 2)

    run, result = await _run(config, train_fully_async, on_step)
    assert result.steps == steps and [r["step"] for r in records] == list(range(1, steps + 1))
    assert [e.name for e in run.router.engines] == ["engine-0"] and records[-1]["cluster/engines"] == 1
    assert max(r["async/staleness_max"] for r in records) <= 1  # the bound holds through the loss
    last = records[-1]
    assert last["async/consumed"] == steps * 4  # every step got its whole batch
    # Nothing admitted was dropped: what was not trained on is still finished or running.
    assert (
        last["async/admitted"] == last["async/consumed"] + last["async/queue_ready"] + last["async/in_flight"]
    )
    assert last["async/version"] == steps  # every step's weights reached the survivor
    assert not _descendants(os.getpid())


@pytest.mark.timeout(300)
async def test_a_killed_engine_node_leaves_rotation_and_the_sync_run_trains_every_step(
    tmp_path: Path, nano_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rlasync.runtime.membership")  # "left" is INFO
    steps = 6
    config = _config(
        tmp_path,
        nano_model_dir,
        f"train.steps={steps}",
        "cluster.trainer=[0]",
        "trainer.world_size=1",
        "weights.timeout_s=10",
    )
    records: list[dict[str, Any]] = []

    def on_step(run: Run, record: dict[str, Any]) -> None:
        records.append(record)
        if record["step"] == 2:
            _kill(run, 1)

    run, result = await _run(config, train_sync, on_step)
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and [
        e.name for e in run.router.engines
    ] == ["engine-1"]
    assert all(r["response_tokens"] > 0 for r in records) and records[-1]["cluster/engines"] == 1
    assert not _descendants(os.getpid())
    # The killed node is a loss, and said so; the ones that shut down at the end only left.
    membership = [r for r in caplog.records if r.name == "rlasync.runtime.membership"]
    dead = [r for r in membership if "declared dead" in r.getMessage()]
    assert dead and all(
        r.levelno == logging.WARNING and r.getMessage().startswith("node-1 ") for r in dead
    ), [(r.levelname, r.getMessage()) for r in membership]
    assert any(
        r.levelno == logging.INFO and r.getMessage() == "node-2 left the cluster (it shut down)"
        for r in membership
    ), [(r.levelname, r.getMessage()) for r in membership]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
async def test_a_killed_node_holding_a_trainer_rank_stops_the_run_with_rank_lost(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    """node-1 hosts engine-0 and trainer rank 1 (in a process it supervises): killed, its rank's
    process dies with it and the run stops within the call deadline, leaving nothing behind."""
    config = _config(
        tmp_path,
        nano_model_dir,
        f"train.mode={mode}",
        "train.steps=200",
        "trainer.operation_timeout_s=60",
        "async_training.staleness_threshold=1",
    )
    killed: list[float] = []

    def on_step(run: Run, record: dict[str, Any]) -> None:
        if record["step"] == 2:
            _kill(run, 1)
            killed.append(time.monotonic())

    with pytest.raises(RankLostError, match="trainer rank 1"):
        await _run(config, train_sync if mode == "sync" else train_fully_async, on_step)
    assert (
        time.monotonic() - killed[0] < 60
    )  # trainer.operation_timeout_s: here the node deadline (2 s), not a hang
    assert not _descendants(os.getpid())  # node-2, both rank processes: all gone
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending  # the rollouter and its samples were stopped


@pytest.mark.timeout(300)
async def test_with_every_engine_node_dead_the_async_run_stops_with_a_typed_error(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.mode=fully_async",
        "train.steps=200",
        "cluster.trainer=[0]",
        "trainer.world_size=1",
        "async_training.staleness_threshold=1",
        "weights.timeout_s=10",
    )
    killed: list[float] = []

    def on_step(run: Run, record: dict[str, Any]) -> None:
        if record["step"] == 2:
            _kill(run, 1, 2)
            killed.append(time.monotonic())

    with pytest.raises((NoEngineError, NoWorkerError, SyncError), match="engine"):
        await _run(config, train_fully_async, on_step)
    assert time.monotonic() - killed[0] < 30  # the node deadline (2 s) and the sync's, not a hang
    assert not _descendants(os.getpid())
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending


async def test_one_step_off_on_the_cluster_placement_trains_one_version_behind(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = _config(tmp_path, nano_model_dir, "train.mode=one_step_off", "train.steps=4")
    records: list[dict[str, Any]] = []
    await _run(config, train_one_step_off, lambda run, record: records.append(record))
    assert records[0]["async/staleness_token_hist"] == [
        records[0]["response_tokens"]
    ]  # the first step is on-policy
    for r in records[1:]:
        assert r["async/staleness_token_hist"] == [0, r["response_tokens"]] and r["cluster/engines"] == 2


@pytest.mark.gpu
@pytest.mark.timeout(600)
async def test_on_gpus_the_cluster_placement_trains_with_nccl(tmp_path: Path, nano_model_dir: Path) -> None:
    """The real GPU path: the engine on node-1's GPU, trainer ranks on GPUs, NCCL between the
    ranks and to the engine. With one GPU the engine and rank 0 share it, which NCCL refuses:
    they colocate (``cluster.colocate``), the engine asleep through each step and the weights
    copied through host shared memory."""
    import torch

    ranks = 2 if torch.cuda.device_count() >= 2 else 1
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.steps=3",
        "cluster.engines=[1]",
        f"cluster.trainer={list(range(ranks))}",
        f"trainer.world_size={ranks}",
        "trainer.device=cuda",
        "engine.device=cuda",
        "engine.offload_weights=true",
        "weights.backend=auto",
        f"cluster.colocate={str(ranks == 1).lower()}",
    )
    records: list[dict[str, Any]] = []
    run, result = await _run(config, train_sync, lambda run, record: records.append(record))
    assert (
        result.steps == 3
        and run.trainer.info["backend"] == "nccl"
        and run.trainer.info["device"].startswith("cuda")
    )
    if ranks == 1:
        assert all(r["colocate/engines_asleep"] == 1 for r in records if r["step"])
    assert all(r["weights/transfer_s"] > 0 for r in records)
