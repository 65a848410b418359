"""Synchronous GRPO, the baseline the asynchronous modes are measured against.

Each step, in order:

1. sample ``prompts_per_step`` training rows (``data.*``: files, or the synthetic task), each
   ``group_size`` times;
2. roll them out with the agent loops on the engine (the policy's current weights);
   with ``train.dynamic_sampling``, drop groups whose rewards are all equal and roll out more;
3. score them (the task's reward; ``train.overlong_buffer`` docks long responses), and turn
   rewards into group-relative advantages;
4. one optimiser step on the batch (on-policy: the PPO ratio starts at 1); with
   ``cluster.colocate`` the engines sleep through it (their KV cache freed) and wake after;
5. push the new weights to the engine (``rlasync.weights``: a bucketed broadcast from the
   trainer's rank 0 into a staging copy, then a swap);
6. every ``validate_every`` steps, score held-out problems greedily;
7. every ``checkpoint_every`` steps (and after the last), save a checkpoint to resume from.

The trainer is a ``TrainerActor``: ``trainer.world_size`` data-parallel rank processes.

    result = await train_sync(load_config("configs/quickstart.yaml"))
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ..compose.result import RunInterrupted, TrainResult
from ..compose.run import Run, off_loop
from ..compose.schedule import Schedule, Steps
from ..metrics import Colocation, Staleness, StepRecord
from .offpolicy import weights_of


@Schedule
async def train_sync(run: Run, steps: Steps, resume_from: Path | None) -> None:
    """Run the schedule above; with ``resume``, continue from the newest checkpoint in
    ``train.run_dir`` exactly as if the run had not stopped. ``run``: parts made elsewhere
    (``Run.open``, e.g. the simulation's), else they are built from ``config``. ``stop``:
    set, the run ends the step in progress and raises ``RunInterrupted``.

    Shutdown order, after the last step or on an error: close the metrics file, drop the
    weight group, stop the trainer's ranks, then the engine."""
    cfg = run.config.train
    await steps.begin(resume_from)
    for step in steps:
        t0 = time.perf_counter()
        uses, rows = run.draw(cfg.prompts_per_step)
        trajectories = await run.rollout(rows, name=f"step{step}")
        if cfg.dynamic_sampling:  # only groups with signal, refilled
            uses, trajectories, sampling = await run.with_signal(uses, trajectories, name=f"step{step}")
            run.sampled(sampling)
        t1 = time.perf_counter()
        batch, train_batch = await run.train_batch(trajectories)
        groups = [trajectories[i : i + cfg.group_size] for i in range(0, len(trajectories), cfg.group_size)]
        run.learned(uses, groups)
        if run.config.cluster.colocate:
            train_metrics, colocation = await _step_colocated(run, train_batch, cfg.temperature)
        else:
            train_metrics, colocation = await run.trainer.step(train_batch, temperature=cfg.temperature), None
        synced = await run.synchronizer.sync(step)
        t2 = time.perf_counter()
        record = StepRecord(
            step=step,
            reward=float(batch.rewards.mean()),
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            response_tokens=int(batch.response_mask.sum()),
            response_len_max=int(batch.response_mask.sum(-1).max()),
            train=train_metrics,
            weights=weights_of(synced, transfer_s=synced.transfer_s, pause_s=synced.pause_s),
            colocation=colocation,
            data_rows=uses,
            # Measured as the asynchronous modes measure them: 0 versions behind (trained at
            # the version that generated them); the trainer waits out the rollout, the
            # engine waits out training and the weight sync.
            staleness=await off_loop(Staleness.of, groups, step - 1),
            trainer_idle_ratio=(t1 - t0) / (t2 - t0),
            rollouter_idle_ratio=(t2 - t1) / (t2 - t0),
        )
        if steps.validating(step):
            await steps.validate(record)
        await steps.end(record, version=step)


async def _step_colocated(run: Run, batch: Any, temperature: float) -> tuple[dict[str, float], Colocation]:
    """The train step with every engine asleep (``cluster.colocate``): they give up their KV cache
    (and with ``engine.offload_weights`` their device's copy of the weights) before it, and are
    woken after it, before the new weights are copied in. The engines' KV bytes are read once
    asleep and again while the step runs."""
    started = time.perf_counter()
    asleep = await run.engine.sleep(run.config.engine.offload_weights)
    slept = time.perf_counter()
    step = asyncio.ensure_future(run.trainer.step(batch, temperature=temperature))
    try:
        during = await run.engine.stats()
        metrics = await step
    finally:
        step.cancel()
        woken = time.perf_counter()
        await run.engine.wake_up()
    colocation = Colocation(
        kv_bytes_training=max(asleep, sum(s.kv_cache_bytes for s in during)),
        engines_asleep=sum(s.sleeping for s in during),
        sleep_s=slept - started,
        wake_s=time.perf_counter() - woken,
    )
    return metrics, colocation


__all__ = ["RunInterrupted", "TrainResult", "train_sync"]
