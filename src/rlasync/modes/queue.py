"""``SampleQueue``: between the rollouter and the trainer, with an exact staleness bound.

A *sample* is one prompt's group of trajectories. The trainer trains at a *version* ``v`` (the
weights the engines serve); every ``steps_per_version`` steps (verl's
``trigger_parameter_sync_step``) it pushes new weights and ``v`` grows by one. The bound: no
sample is trained on at a version more than ``max_staleness`` above the version it was
admitted at, and since the engines serve at least that version from then on, no token is
staler than that either.

Admission control instead of dropping. A sample admitted at version ``v`` gets the deadline
``v + max_staleness``, the last version that may train on it. The queue admits a sample only
if, after it, every deadline can still be met by the steps left before it, counting the
samples already admitted (running or finished):

    for each D in v .. v + max_staleness:
        samples with deadline <= D  <=  batch * (steps left at v + steps_per_version * (D - v))

The trainer takes finished samples earliest-deadline first and only a set that keeps that
inequality true for the steps after it, waiting for more to finish otherwise; so a deadline
is never missed and no finished sample is ever thrown away. With ``max_staleness=0`` and one
step per version this is exactly on-policy: every sample admitted at ``v`` is trained on at
``v`` before the weights change. ``capacity`` (verl: ``(1 + staleness_threshold) *
trigger_parameter_sync_step * batch``) caps the samples admitted and not yet trained on.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class StalenessError(RuntimeError):
    """A sample would be trained past its deadline: a bug in the schedule, never expected."""


class QueueClosed(Exception):
    """The queue was closed (``SampleQueue.close``, at shutdown): what ``admit`` and ``take``
    raise, then or later, instead of waiting for ever. Not a ``CancelledError``: the task that
    waited was not cancelled, and a real cancellation still propagates as one."""


class Ticket:
    """One admitted sample: its order, the version it was admitted at and its deadline."""

    __slots__ = ("index", "version", "deadline", "admitted_at", "finished_at")

    def __init__(self, index: int, version: int, deadline: int) -> None:
        self.index, self.version, self.deadline = index, version, deadline
        self.admitted_at = time.monotonic()
        self.finished_at = 0.0

    def __repr__(self) -> str:
        return f"Ticket({self.index}, v{self.version}, deadline v{self.deadline})"


class QueueState(msgspec.Struct, kw_only=True):
    """Where a queue stands, for a checkpoint: the version, the steps taken at it, and every
    ticket admitted and not yet trained on (``index, version, deadline``), finished or not.
    The samples themselves are the schedule's to save."""

    version: int
    steps_done: int
    next_index: int
    open: list[tuple[int, int, int]]
    finished: list[int]
    admitted: int = 0
    consumed: int = 0


class SampleQueue(Generic[T]):
    def __init__(
        self, batch: int, *, steps_per_version: int = 1, max_staleness: int = 0, capacity: int | None = None
    ) -> None:
        if batch < 1 or steps_per_version < 1 or max_staleness < 0:
            raise ValueError("batch and steps_per_version must be at least 1, max_staleness at least 0")
        self.batch, self.steps_per_version, self.max_staleness = batch, steps_per_version, max_staleness
        most = batch * steps_per_version * (max_staleness + 1)
        self.capacity = min(capacity, most) if capacity is not None else most
        if self.capacity < batch:
            raise ValueError(
                f"capacity {self.capacity} is less than one batch ({batch}): the trainer could never take a step"
            )
        self.version = 0
        self.steps_done = 0  # at this version
        self._engines_serve = 0  # the oldest version the engines serve, as last told (``serve``)
        self._next = 0
        self._open: dict[int, Ticket] = {}  # admitted, not yet trained on (running or finished)
        self._finished: dict[int, tuple[Ticket, T]] = {}
        self._waiters: list[asyncio.Future[None]] = []  # see _wait_until
        self._closed = False
        # Counters for metrics.
        self.admitted = 0
        self.consumed = 0
        self.admission_wait_s = 0.0

    # -- the bound ------------------------------------------------------------------------------
    def _feasible(self, deadlines: collections.Counter[int], steps_done: int) -> bool:
        """Can every deadline in ``deadlines`` still be met, ``steps_done`` steps into this version?"""
        total = 0
        for deadline in range(self.version, self.version + self.max_staleness + 1):
            total += deadlines.get(deadline, 0)
            if total > self.batch * (
                self.steps_per_version - steps_done + self.steps_per_version * (deadline - self.version)
            ):
                return False
        return sum(deadlines.values()) == total  # nothing past its deadline, nothing beyond the window

    def _deadlines(self, exclude: set[int] = frozenset()) -> collections.Counter[int]:  # type: ignore[assignment]
        return collections.Counter(t.deadline for i, t in self._open.items() if i not in exclude)

    @property
    def served(self) -> int:
        """The version a sample admitted now is admitted at: the oldest one the engines serve,
        which is the trainer's (``version``) unless the engines take versions after the trainer
        publishes them (``advance(served=False)``, then ``serve``). Its deadline counts from it,
        so a token of an engine that has not swapped yet is still within the bound; one whose
        deadline would already be behind the trainer is not admitted until they catch up."""
        return min(self._engines_serve, self.version)

    def can_admit(self) -> bool:
        if self._closed or len(self._open) >= self.capacity:
            return False
        deadlines = self._deadlines()
        deadlines[self.served + self.max_staleness] += 1
        return self._feasible(deadlines, self.steps_done)

    # -- the rollouter's side --------------------------------------------------------------------
    async def admit(self) -> Ticket:
        """Wait until one more sample fits the bound, and admit it at the current version;
        ``QueueClosed`` once the queue is closed."""
        started = time.monotonic()
        await self._wait_until(lambda: self._closed or self.can_admit())
        if self._closed:
            raise QueueClosed("the sample queue was closed")
        ticket = Ticket(self._next, self.served, self.served + self.max_staleness)
        self._next += 1
        self._open[ticket.index] = ticket
        self.admitted += 1
        self.admission_wait_s += time.monotonic() - started
        return ticket

    async def put(self, ticket: Ticket, sample: T) -> None:
        """A finished sample (it is never dropped: the trainer takes it before its deadline)."""
        if ticket.index not in self._open:
            raise KeyError(f"{ticket} was not admitted or was already put")
        ticket.finished_at = time.monotonic()
        self._finished[ticket.index] = (ticket, sample)
        self._notify()

    # -- the trainer's side --------------------------------------------------------------------
    def _pick(self) -> list[int] | None:
        """A batch of finished samples, earliest deadline first, that keeps every remaining
        deadline feasible after this step; None if there is none yet."""
        if self.steps_done >= self.steps_per_version:
            raise StalenessError(
                f"{self.steps_done} steps at version {self.version}: advance() after each weight sync"
            )
        ready = sorted(self._finished.values(), key=lambda item: (item[0].deadline, item[0].finished_at))
        if len(ready) < self.batch:
            return None
        chosen = {ticket.index for ticket, _ in ready[: self.batch]}
        return (
            sorted(chosen) if self._feasible(self._deadlines(exclude=chosen), self.steps_done + 1) else None
        )

    async def take(self) -> list[tuple[Ticket, T]]:
        """The next step's batch (waits for samples to finish); ``QueueClosed`` once the queue
        is closed."""
        chosen: list[int] | None = None

        def ready() -> bool:
            nonlocal chosen
            chosen = None if self._closed else self._pick()
            return self._closed or chosen is not None

        await self._wait_until(ready)
        if chosen is None:
            raise QueueClosed("the sample queue was closed")
        return self._remove(chosen)

    def take_nowait(self) -> list[tuple[Ticket, T]] | None:
        """The next step's batch if it is ready now, else None. Never yields to the event loop,
        so a trainer whose batch is ready sends it before anything else runs (the rollouter's
        admissions, woken by the last ``advance``, would otherwise go first)."""
        if self._closed:
            return None
        chosen = self._pick()
        return None if chosen is None else self._remove(chosen)

    def _remove(self, chosen: list[int]) -> list[tuple[Ticket, T]]:
        batch = [self._finished.pop(i) for i in chosen]
        for ticket, _ in batch:
            if ticket.deadline < self.version:
                raise StalenessError(f"{ticket} trained at version {self.version}")
            del self._open[ticket.index]
        self.steps_done += 1
        self.consumed += len(batch)
        self._notify()
        return batch

    async def advance(self, *, served: bool = True) -> None:
        """The trainer is at the next version now (after a weight sync); ``served``: the engines
        serve it too (else ``serve`` says when they do)."""
        if self.steps_done != self.steps_per_version:
            raise StalenessError(
                f"advance() after {self.steps_done} of {self.steps_per_version} steps at version {self.version}"
            )
        self.version += 1
        self.steps_done = 0
        if served:
            self._engines_serve = self.version
        self._notify()

    def serve(self, version: int) -> None:
        """Every engine in rotation serves ``version`` or newer now (the weight sync's
        ``served_listeners``): samples admitted from now on count their deadline from it."""
        if version > self._engines_serve:
            self._engines_serve = version
            self._notify()

    async def close(self) -> None:
        """Wake every waiter with ``QueueClosed`` (shutdown); later ``admit`` and ``take`` calls
        raise it at once, ``take_nowait`` returns None."""
        self._closed = True
        self._notify()

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> tuple[QueueState, dict[int, T]]:
        """Where the queue stands now, and its finished samples (by ticket index)."""
        return QueueState(
            version=self.version,
            steps_done=self.steps_done,
            next_index=self._next,
            open=[(t.index, t.version, t.deadline) for t in self._open.values()],
            finished=sorted(self._finished),
            admitted=self.admitted,
            consumed=self.consumed,
        ), {index: sample for index, (_, sample) in self._finished.items()}

    def restore(self, state: QueueState, finished: dict[int, T]) -> list[Ticket]:
        """Continue from ``state`` on a fresh queue: its tickets keep their versions and deadlines
        (the bound counts versions across a restart); ``finished`` gives the samples of its
        finished tickets. Returns the tickets still to be rolled out (``put`` them when done)."""
        if self._open or self.admitted:
            raise RuntimeError("restore() a fresh queue")
        if set(finished) != set(state.finished):
            raise ValueError(f"the finished samples {sorted(finished)} are not the state's {state.finished}")
        self.version, self.steps_done, self._next = state.version, state.steps_done, state.next_index
        self._engines_serve = state.version  # a resumed run's engines start from the trainer's weights
        self.admitted, self.consumed = state.admitted, state.consumed
        self._open = {index: Ticket(index, version, deadline) for index, version, deadline in state.open}
        for index, sample in finished.items():
            self._finished[index] = (self._open[index], sample)
        if (
            not self._feasible(self._deadlines(), self.steps_done)
            or self.steps_done >= self.steps_per_version
        ):
            raise StalenessError(
                f"the saved queue (version {self.version}, {len(self._open)} samples open) cannot keep its deadlines with batch {self.batch}, "
                f"{self.steps_per_version} step(s) per version and staleness {self.max_staleness}: resume with the settings it was saved with"
            )
        self._notify()
        return [t for i, t in sorted(self._open.items()) if i not in self._finished]

    # -- waiting --------------------------------------------------------------------------------
    # Every method changes the queue without an await in between, so one event loop needs no
    # lock: a waiter re-checks its condition whenever the queue changed.
    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(changed)
            try:
                await changed
            finally:
                if changed in self._waiters:
                    self._waiters.remove(changed)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for changed in waiters:
            if not changed.done():
                changed.set_result(None)

    # -- metrics --------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._open) - len(self._finished)

    @property
    def ready(self) -> int:
        return len(self._finished)

    def stats(self) -> dict[str, Any]:
        return {
            "async/queue_ready": self.ready,
            "async/in_flight": self.running,
            "async/admitted": self.admitted,
            "async/consumed": self.consumed,
            "async/version": self.version,
            "async/served_version": self.served,
        }
