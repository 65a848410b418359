"""The fully async schedule's rollouter: it starts samples (one prompt, ``train.group_size``
trajectories) as fast as the ``SampleQueue`` admits them, and keeps each admitted sample until
it is trained on, so a checkpoint can hold the work in flight (``InFlight``: the queue's
tickets, finished samples, and each partial trajectory's ``LoopState``) and a resume can go on
with it (``resume``): nothing admitted is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from ..agents import LoopState, Trajectory
from ..compose.run import Run
from .queue import QueueClosed, QueueState, SampleQueue, Ticket

log = logging.getLogger(__name__)

IN_FLIGHT = "in_flight.msgpack"  # a checkpoint's samples admitted and not yet trained on (``InFlight``)


class Admitted(msgspec.Struct, kw_only=True):
    """One admitted sample not yet trained on, as a checkpoint holds it."""

    index: int  # its ticket
    use: tuple[int, int]  # (epoch, row index), as ``data/rows`` records it
    row: dict[str, Any]
    seed: int  # its sampling seed: a resumed turn continues with the same one
    trajectories: list[Trajectory] | None = None  # finished, waiting to be trained on
    loops: dict[str, LoopState] = {}  # in progress: its loops' states (one missing starts again)


class InFlight(msgspec.Struct, kw_only=True):
    """A fully async run's work in flight at a checkpoint: the queue's tickets (versions and
    deadlines) and every admitted sample, finished or partial."""

    queue: QueueState
    samples: list[Admitted]


class Rollouter:
    """Starts samples as fast as the queue admits them (and ``max_concurrent_samples`` allows)."""

    def __init__(self, run: Run, queue: SampleQueue[list[Any]], *, max_concurrent: int = 0) -> None:
        self.run, self.queue = run, queue
        self._limit = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self.admitted: dict[int, Admitted] = {}  # by ticket index, until trained on (``trained``)
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.started = time.perf_counter()
        self.idle_s = 0.0  # with nothing generating: blocked by the staleness bound
        self._idle_since: float | None = self.started

    def start(self, resumed: Sequence[tuple[Ticket, Admitted]] = ()) -> None:
        """Admit samples from now on; ``resumed``: a checkpoint's samples still to finish (their
        loops go on from their states)."""
        for ticket, sample in resumed:
            self.admitted[ticket.index] = sample
            self._spawn(ticket, sample)
        self._main = asyncio.ensure_future(self._admit_forever())
        self._main.add_done_callback(self._check)

    def resume(self, folder: Path) -> None:
        """Admit samples from now on, after checkpoint ``folder``'s work in flight: its queue
        restored (tickets with their versions and deadlines), its finished samples ready to be
        trained on, its partial ones going on from their loops' states (``start``)."""
        saved = msgspec.msgpack.decode((folder / IN_FLIGHT).read_bytes(), type=InFlight)
        by_index = {sample.index: sample for sample in saved.samples}
        running = self.queue.restore(
            saved.queue, {s.index: s.trajectories for s in saved.samples if s.trajectories is not None}
        )
        self.admitted.update(by_index)
        self.start([(ticket, by_index[ticket.index]) for ticket in running])
        log.info(
            "resumed %d samples in flight (%d finished, %d partial) at version %d",
            len(saved.samples),
            len(saved.samples) - len(running),
            len(running),
            self.queue.version,
        )

    async def _admit_forever(self) -> None:
        while True:
            if self._limit is not None:
                await self._limit.acquire()
            try:
                ticket = await self.queue.admit()
            except QueueClosed:  # shutdown: admissions end
                return
            # No await from admission to here: a checkpoint sees the ticket with its row and seed.
            (use,), (row,) = self.run.draw(1)
            sample = Admitted(index=ticket.index, use=use, row=row, seed=self.run.sampling().seed or 0)
            self.admitted[ticket.index] = sample
            self._spawn(ticket, sample)
            # One sample a turn of the loop: a step's worth admitted at once (thousands of agent
            # loops starting, each a few hops) would otherwise hold the loop in one go.
            await asyncio.sleep(0)

    def _spawn(self, ticket: Ticket, sample: Admitted) -> None:
        if self._idle_since is not None:
            self.idle_s += time.perf_counter() - self._idle_since
            self._idle_since = None
        task = asyncio.ensure_future(self._sample(ticket, sample))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    async def _sample(self, ticket: Ticket, sample: Admitted) -> None:
        params = self.run.sampling(sample.seed)
        trajectories = await self.run.rollout(
            [sample.row], name=_name(ticket.index), params=params, states=sample.loops or None
        )
        sample.loops = {}
        await self.queue.put(ticket, trajectories)

    def trained(self, tickets: list[Ticket]) -> list[tuple[int, int]]:
        """These samples were trained on: forgotten; their uses."""
        return [self.admitted.pop(ticket.index).use for ticket in tickets]

    def capture(self) -> tuple[InFlight, dict[str, Any]]:
        """The work in flight this instant, for a checkpoint, with the data position and sampling
        RNG of the same instant (no await: a sample admitted after is admitted again on resume,
        never lost). Partial samples' loops come later (``fill_loops``)."""
        queue, finished = self.queue.state()
        position = self.run.position()
        samples = [
            msgspec.structs.replace(self.admitted[index], trajectories=finished.get(index))
            for index, *_ in queue.open
        ]
        return InFlight(queue=queue, samples=samples), position

    async def fill_loops(self, in_flight: InFlight) -> bytes:
        """The captured work with its partial samples' loop states, from the workers, encoded.
        Asked for after ``capture`` (the checkpoint's files are written in the background): a
        later state of the same trajectory is as good a place to resume from, and one no worker
        holds by then (finished meanwhile, or a resumed call still in transit) keeps the state it
        resumed from, or starts again."""
        group = self.run.config.train.group_size
        partial = {
            s.index: [f"{_name(s.index)}/{i}" for i in range(group)]
            for s in in_flight.samples
            if s.trajectories is None
        }
        states = (
            await self.run.rollouts.loop_states([uid for uids in partial.values() for uid in uids])
            if partial
            else {}
        )
        for s in in_flight.samples:
            if s.index in partial:
                s.loops = {
                    uid: state
                    for uid in partial[s.index]
                    if (state := states.get(uid) or s.loops.get(uid)) is not None
                }
        return msgspec.msgpack.encode(in_flight)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._limit is not None:
            self._limit.release()
        if not self._tasks and self._idle_since is None:
            self._idle_since = time.perf_counter()
        self._check(task)

    def _check(self, task: asyncio.Task[None]) -> None:
        """A sample that raised (a bug: the loops turn engine errors into trajectories) stops the run."""
        if task.cancelled():
            return
        error = task.exception()  # retrieved even after the first failure: each is seen once
        if error is not None and not self.failed.done():
            self.failed.set_exception(error)

    def idle_ratio(self) -> float:
        now = time.perf_counter()
        idle = self.idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return idle / max(now - self.started, 1e-9)

    async def stop(self) -> None:
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.failed.done():
            self.failed.cancel()


def _name(index: int) -> str:
    """The rollout name of the sample with ticket ``index``: its trajectories are ``<name>/<i>``."""
    return f"sample{index}"
