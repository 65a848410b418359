"""The frame every schedule shares (``rlasync.modes``: a mode is a schedule). ``Schedule``
makes a schedule's steps (its body) into what users call,

    train_sync(config, resume=False, on_step=None, run=None, stop=None) -> TrainResult

which starts it the same way for every mode (the checkpoint to resume from, the run opened
unless given), and closes the run after it, whatever happened. ``Steps`` is what every schedule
does around its steps: validation, checkpoints, the records, a stop asked for.

    @Schedule
    async def train_sync(run: Run, steps: Steps, resume_from: Path | None) -> None:
        await steps.begin(resume_from)
        for step in steps:
            ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import Config
from ..metrics import StepRecord
from .checkpoints import Resume, checkpoint_to_resume, resuming
from .record import OnStep
from .result import TrainResult
from .run import Run

# A schedule's own way to checkpoint a step (``Steps.end``): (record, weight version, stopping).
Save = Callable[[StepRecord, int, bool], Awaitable[None]]


class Steps:
    """What every schedule does around its steps: the held-out accuracy at the start (step 0's
    record), every ``train.validate_every`` steps and after the last; at the end of each step a
    checkpoint when one is due, the record written (``Run.write``), and a stop asked for obeyed;
    then the result.

        steps = Steps(run, state, on_step)  # state: the checkpoint resumed from's, else {}
        await steps.begin(resume_from)
        for step in steps:
            record = StepRecord(step=step, ...)
            if steps.validating(step):
                await steps.validate(record)
            await steps.end(record, version=step)
        return steps.result()
    """

    def __init__(self, run: Run, state: dict[str, Any], on_step: OnStep = None) -> None:
        self.run, self.state, self.on_step = run, state, on_step
        self.initial = self.accuracy = 0.0  # held-out accuracy: of the starting weights, the latest

    async def begin(self, resume_from: Path | None) -> None:
        """Restore the checkpoint ``resume_from``, or validate the starting weights (step 0)."""
        if resume_from is not None:
            self.initial, self.accuracy = await self.run.restore(resume_from, self.state)
        else:
            self.initial = self.accuracy = await self.run.validate()
            self.run.write(StepRecord(step=0, val_accuracy=self.initial))

    def __iter__(self) -> Iterator[int]:
        """The steps still to run."""
        return iter(range(self.state.get("step", 0) + 1, self.run.config.train.steps + 1))

    def validating(self, step: int) -> bool:
        """Whether step ``step`` ends with a validation: every ``train.validate_every``, and the last."""
        cfg = self.run.config.train
        return step % cfg.validate_every == 0 or step == cfg.steps

    async def validate(self, record: StepRecord) -> None:
        """The held-out accuracy of the weights the engines serve now, into ``record``."""
        self.accuracy = record.val_accuracy = await self.run.validate()

    async def save(
        self,
        record: StepRecord,
        version: int,
        stopping: bool,
        *,
        files: dict[str, Any] | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint step ``record.step`` if due, its folder into ``record``: weight ``version``,
        the accuracies, and the schedule's own ``state`` and ``files`` (``Run.checkpoint``)."""
        own = {"weight_version": version, "initial_accuracy": self.initial, "accuracy": self.accuracy}
        saved = await self.run.checkpoint(record.step, {**own, **(state or {})}, files, stopping=stopping)
        if saved:
            record.checkpoint = saved

    async def end(self, record: StepRecord, version: int, save: Save | None = None) -> None:
        """End step ``record.step``, the engines at weight ``version``: checkpoint it if due (by
        ``save``, the schedule's own way, else ``Steps.save``), write ``record``, and raise
        ``RunInterrupted`` if the run was asked to stop."""
        stopping = self.run.stopping()
        if self.run.checkpoint_due(record.step, stopping=stopping):
            await (save or self.save)(record, version, stopping)
        self.run.write(record, self.on_step)
        if record.step == self.run.config.train.steps:  # the last: the trackers get the summary
            self.run.finish(self.result())  # (while they are open: the run closes them next)
        if stopping:
            raise self.run.stopped(record)

    def result(self) -> TrainResult:
        return TrainResult(
            initial_accuracy=self.initial,
            final_accuracy=self.accuracy,
            steps=self.run.config.train.steps,
            wall_s=time.perf_counter() - self.run.started,
        )


# A schedule's steps: the run to drive, its ``Steps``, the checkpoint it resumes from (if any).
Body = Callable[[Run, Steps, Path | None], Awaitable[None]]


class Schedule:
    """A schedule's body as users call it (``__call__``); its name and docstring are the
    body's. ``check``: the schedule's own config check, before anything starts."""

    def __init__(self, body: Body, check: Callable[[Config], None] | None = None) -> None:
        self.body, self.check = body, check
        self.__name__, self.__qualname__ = body.__name__, getattr(body, "__qualname__", body.__name__)
        self.__doc__, self.__module__ = body.__doc__, body.__module__

    @classmethod
    def checking(cls, check: Callable[[Config], None]) -> Callable[[Body], Schedule]:
        """``@Schedule`` for a schedule that first checks the config (``check`` raises a
        ``ConfigError``), before a checkpoint is read or anything starts."""
        return lambda body: cls(body, check)

    async def __call__(
        self,
        config: Config,
        *,
        resume: Resume = False,
        on_step: OnStep = None,
        run: Run | None = None,
        stop: asyncio.Event | None = None,
    ) -> TrainResult:
        """Run the schedule; with ``resume``, continue from the newest checkpoint in
        ``train.run_dir`` exactly as if the run had not stopped (``"auto"``: if there is one).
        ``on_step(record)``: each line of ``metrics.jsonl`` as it is written. ``run``: parts made elsewhere (``Run.open``, e.g. the
        simulation's), else they are built from ``config``; closed at the end either way.
        ``stop``: set, the run ends the step in progress and raises ``RunInterrupted``.

        Shutdown order, after the last step or on an error: the schedule's own work (samples in
        flight), then the run's parts in reverse order of making (``Run.close``)."""
        if self.check is not None:
            self.check(config)
        resume_from, state = checkpoint_to_resume(config) if resuming(config, resume) else (None, {})
        run = run or await Run.open(config, metrics_upto=state.get("step"), stop=stop)
        steps = Steps(run, state, on_step)
        try:
            await self.body(run, steps, resume_from)
        except BaseException:
            run.ended_early()
            raise
        finally:
            await run.close()
        return steps.result()
