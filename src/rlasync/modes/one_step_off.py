"""One-step off-policy GRPO: generating the next batch while training on this one.

    rollout(1) at v0 ─┐
                      ├─ train step 1 on batch 1 (v0: on-policy) ─ sync v1 ─┐
    rollout(2) at v0 ─┘                                                     │
                      rollout(3) at v1 ─────────── train step 2 on batch 2 ─┴─ sync v2 ...

Each iteration waits for the batch in flight, pushes the weights of the last step to the
engine (no generation is running then, so a batch never mixes versions), starts generating
the next batch, and trains on the one it has meanwhile. Every update after the first trains
on data exactly one version old (verl's ``one_step_off_policy``). Engine and trainer are
busy at once: the engine in this process, the trainer's ranks in theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import msgspec

from ..agents.trajectory import Trajectory
from ..compose.run import Run
from ..compose.schedule import Schedule, Steps
from ..config import Config, ConfigError
from ..metrics import StepRecord
from .offpolicy import train_step, weights_of

IN_FLIGHT = "in_flight.msgpack"  # a checkpoint's batch in flight: its rows' uses and samples


class InFlightBatch(msgspec.Struct, kw_only=True):
    """The batch generated during a step, saved with that step's checkpoint."""

    uses: list[tuple[int, int]]  # (epoch, row index) of each sample, as ``data/rows`` records them
    samples: list[list[Trajectory]]
    sampling: dict[str, int] = {}  # train.dynamic_sampling's rounds and dropped groups


def _syncs_every_step(config: Config) -> None:
    """The schedule pushes the weights after every step: a config asking otherwise is refused
    before anything starts."""
    if config.async_training.trigger_parameter_sync_step != 1:
        raise ConfigError(
            "train.mode=one_step_off syncs after every step: async_training.trigger_parameter_sync_step must be 1"
        )


@Schedule.checking(_syncs_every_step)
async def train_one_step_off(run: Run, steps: Steps, resume_from: Path | None) -> None:
    """Run the schedule above; with ``resume``, continue from the newest checkpoint in
    ``train.run_dir`` as if the run had not stopped: a checkpoint holds the batch that was in
    flight (finished first, ``in_flight.msgpack``), so nothing generated is lost or trained twice.
    ``stop``: set, the run ends the step in progress and raises ``RunInterrupted``."""
    config, state = run.config, steps.state
    cfg = config.train
    batch_rows = cfg.prompts_per_step * config.async_training.require_batches
    pending: asyncio.Future[InFlightBatch] | None = None

    def generate(step: int) -> asyncio.Future[InFlightBatch]:
        uses, rows = run.draw(batch_rows)
        return asyncio.ensure_future(_groups(run, uses, rows, f"step{step}"))

    async def save(record: StepRecord, version: int, stopping: bool) -> None:
        """Checkpoint with the batch in flight, finished first: it is trained next on resume."""
        files: dict[str, Any] = {}
        if pending is not None:
            await asyncio.wait([pending])
            files[IN_FLIGHT] = msgspec.msgpack.encode(pending.result())
        await steps.save(record, version, stopping, files=files)

    try:
        await steps.begin(resume_from)
        if resume_from is not None:
            served = state["weight_version"]
            if (
                resume_from / IN_FLIGHT
            ).is_file():  # the batch that was in flight: trained next, as it would have been
                pending = asyncio.get_running_loop().create_future()
                pending.set_result(
                    msgspec.msgpack.decode((resume_from / IN_FLIGHT).read_bytes(), type=InFlightBatch)
                )
            elif state["step"] < cfg.steps:  # the run's last checkpoint, and more steps asked for now
                pending = generate(state["step"] + 1)
        else:
            pending = generate(1)
            served = 0  # the version the engine serves
        for step in steps:
            t0 = time.perf_counter()
            assert pending is not None
            batch = await pending
            waited = time.perf_counter() - t0
            synced = None
            if served < step - 1:  # the engine is idle now: push the last step's weights
                synced = await run.synchronizer.sync(step - 1)
                served = step - 1
            pending = generate(step + 1) if step < cfg.steps else None  # generated at version step - 1
            run.sampled(batch.sampling)
            record = await train_step(run, step, batch.samples, version=step - 1)
            record.data_rows = batch.uses
            run.learned(batch.uses, batch.samples)
            took = time.perf_counter() - t0
            record.rollout_s, record.train_s, record.trainer_idle_ratio = waited, took - waited, waited / took
            if synced is not None:
                record.weights = weights_of(synced, transfer_s=synced.transfer_s, pause_s=synced.pause_s)
            if steps.validating(step):
                if pending is not None:  # validate this step's weights: once the batch in flight is done
                    await asyncio.wait([pending])
                await run.synchronizer.sync(step)
                served = step
                await steps.validate(record)
            await steps.end(record, version=step, save=save)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


async def _groups(run: Run, uses: list[tuple[int, int]], rows: list[Any], name: str) -> InFlightBatch:
    """Roll out ``rows`` as samples: one group of ``train.group_size`` trajectories per row;
    with ``train.dynamic_sampling``, only groups whose rewards differ, refilled (every round at
    the same weight version: the engine is synced only once this batch is done)."""
    trajectories = await run.rollout(rows, name)
    sampling: dict[str, int] = {}
    if run.config.train.dynamic_sampling:
        uses, trajectories, sampling = await run.with_signal(uses, trajectories, name)
    size = run.config.train.group_size
    return InFlightBatch(
        uses=uses,
        samples=[trajectories[i : i + size] for i in range(0, len(trajectories), size)],
        sampling=sampling,
    )


__all__ = ["train_one_step_off"]
