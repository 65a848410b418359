"""The asynchronous schedules end to end on the tiny model: the staleness bound and the
on-policy setting hold for every trained token, one-step-off trains one version behind,
partial rollouts happen, and a run stops cleanly on Ctrl-C and when a trainer rank dies."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from numerics import step_rtol
from transformers import AutoConfig
from waiting import wait_until_sync

from rlasync.config import load_config
from rlasync.modes import train
from rlasync.runtime.spawner import COMMANDS_ENV
from rlasync.trainer import RankLostError
from rlasync.trainer.checkpoint import CheckpointError

uvloop = pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop `rlasync train` runs on
CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _config(tmp_path: Path, model_dir: Path, *overrides: str) -> Any:
    base = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={model_dir}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=24",
        "train.val_size=8",
        "train.validate_every=100",
        "trainer.lr=1e-3",
    ]
    return load_config(CONFIG, [*base, *overrides])


async def _records(config: Any) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    await train(config, on_step=records.append)
    return records


@uvloop
async def test_the_on_policy_setting_trains_only_tokens_of_the_version_being_trained(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.mode=fully_async",
        "train.steps=5",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=0",
    )
    records = await _records(config)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:  # index 0 of the histogram: tokens 0 versions old; nothing anywhere else
        assert r["async/staleness_token_hist"] == [r["response_tokens"]] and r["async/partial_samples"] == 0
        assert r["async/version"] == r["step"]  # one sync per step
    _assert_ends_with_its_model(records, 5)


@uvloop
async def test_a_fully_async_run_keeps_the_staleness_bound_with_partial_rollouts(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.mode=fully_async",
        "train.steps=8",
        "async_training.trigger_parameter_sync_step=2",
        "async_training.staleness_threshold=0.5",
        "async_training.require_batches=2",
        "train.prompts_per_step=2",
    )
    records = await _records(config)
    assert max(r["async/staleness_max"] for r in records) <= 1  # ceil(0.5)
    assert all(len(r["async/staleness_token_hist"]) <= 2 for r in records) and all(
        r["updates"] == 2 for r in records
    )
    # Syncs cut the generations in flight, which go on under the next version: a sample's tokens
    # may span two versions, never more (how many are cut depends on timing; the cut-and-resume
    # itself is tested exactly in test_partial_rollout.py).
    assert max(r["async/partial_span_max"] for r in records) <= 1
    last = records[-1]
    assert last["async/consumed"] == 8 * 4 and last["async/admitted"] >= last["async/consumed"]


@uvloop
async def test_one_step_off_trains_on_data_exactly_one_version_old(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    records = await _records(
        _config(
            tmp_path, nano_model_dir, "train.mode=one_step_off", "train.steps=4", "train.validate_every=2"
        )
    )
    assert records[0]["async/staleness_token_hist"] == [
        records[0]["response_tokens"]
    ]  # the first step is on-policy
    for r in records[1:]:
        assert (
            r["async/staleness_token_hist"] == [0, r["response_tokens"]] and r["async/partial_samples"] == 0
        )
    assert [r["step"] for r in records if "val_accuracy" in r] == [2, 4]
    _assert_ends_with_its_model(records, 4)


async def test_one_step_off_resumes_with_the_batch_that_was_in_flight(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    """Cut after step 2's checkpoint and resumed: step 3 trains the batch that was in flight
    (from the checkpoint, not generated again), step 4 what the uninterrupted run generated."""
    more = (
        "train.mode=one_step_off",
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.validate_every=100",
        "train.group_size=8",
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    await train(_config(whole, nano_model_dir, *more))
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000004")
    assert (cut / "checkpoints" / "step_000002" / "in_flight.msgpack").is_file()
    await train(_config(cut, nano_model_dir, *more), resume=True)
    expected, resumed = (
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (whole, cut)
    )
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    # The same samples, but step 4's were generated by engines batching them as they came: their
    # behaviour logprobs, and so the loss, may differ by a training step's rounding.
    rtol = step_rtol(AutoConfig.from_pretrained(nano_model_dir), tokens=32 * 48, sequence=48)
    for step in (3, 4):  # the same samples trained, the same versions behind
        for key in ("reward", "response_tokens", "async/staleness_token_hist"):
            assert resumed[step][key] == expected[step][key], (step, key)
        assert resumed[step]["train/loss"] == pytest.approx(expected[step]["train/loss"], rel=rtol, abs=rtol)
    with pytest.raises(CheckpointError, match="written by train.mode=one_step_off: resume it with that mode"):
        await train(_config(cut, nano_model_dir, "train.mode=fully_async"), resume=True)
    with pytest.raises(CheckpointError, match="written by train.mode=one_step_off: resume it with that mode"):
        await train(
            _config(cut, nano_model_dir, "train.mode=sync"), resume=True
        )  # it would drop the batch in flight


def _assert_ends_with_its_model(records: list[dict[str, Any]], steps: int) -> None:
    """Every mode ends with a sealed checkpoint whose model folder loads (it had none)."""
    from rlasync.models import load_pretrained_dir
    from rlasync.trainer.checkpoint import read_state, verify

    folder = Path(records[-1]["checkpoint"])
    assert folder.name == f"step_{steps:06d}" and not verify(folder)
    assert read_state(folder)["weight_version"] == records[-1].get("async/version", steps)
    load_pretrained_dir(folder / "model")


def _rank_pids(parent: int) -> list[int]:
    """The trainer rank processes among ``parent``'s descendants (the head's supervised processes,
    forked by its spawner: their parent is the spawner, and ps shows their worker command)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\x00", b" ")
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    pids, todo = [], list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        # A trainer rank runs in a node process its node supervises: "--node-id node-0.<k>".
        if b"rlasync.runtime.worker --node-id node-0." in commands.get(pid, b""):
            pids.append(pid)
    return pids


@uvloop
async def test_a_dead_trainer_rank_stops_the_async_run_cleanly(tmp_path: Path, nano_model_dir: Path) -> None:
    config = _config(
        tmp_path,
        nano_model_dir,
        "train.mode=fully_async",
        "train.steps=200",
        "async_training.staleness_threshold=1",
        "trainer.operation_timeout_s=60",
    )
    killed: list[float] = []

    def on_step(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            for pid in _rank_pids(os.getpid()):
                os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(RankLostError):
        await train(config, on_step=on_step)
    assert time.monotonic() - killed[0] < 20  # an error at once, not a wait for the call deadline
    assert not _rank_pids(os.getpid())
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending  # the rollouter and its samples were stopped


def test_ctrl_c_stops_an_async_run_cleanly(tmp_path: Path, nano_model_dir: Path) -> None:
    overrides = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={nano_model_dir}",
        "train.mode=fully_async",
        "train.steps=500",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.val_size=8",
        "async_training.staleness_threshold=1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlasync", "train", str(CONFIG), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # exec'd, not forked by the test's spawner: its trainer ranks are then this process's descendants
        env={k: v for k, v in os.environ.items() if k != COMMANDS_ENV},
    )
    metrics = tmp_path / "metrics.jsonl"

    def a_few_steps_in() -> bool:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            return True
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        return False

    wait_until_sync(a_few_steps_in, timeout_s=120, interval_s=0.2, what="3 steps are in metrics.jsonl")
    ranks = _rank_pids(proc.pid)
    assert ranks
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output, output
    wait_until_sync(  # within 1.5 s of the controller's exit: it stops its ranks itself
        lambda: (
            not [
                pid
                for pid in ranks
                if Path(f"/proc/{pid}").exists()
                and "Z" not in (Path(f"/proc/{pid}") / "stat").read_text().split()[2]
            ]
        ),
        timeout_s=1.5,
        interval_s=0.05,
        what=f"no trainer rank of {ranks} is left",
    )
