"""Spreading rows: ``AgentLoopManager`` gives each unit of rows (one prompt's GRPO group, kept
together so the engine reuses its prefix) to the agent-loop worker (``rlasync.agents.worker``)
with the fewest rows outstanding, in one call per worker; a worker whose node dies has its units
run again on the others, so no row is lost.

    manager = AgentLoopManager(workers, local={"worker-1": ["engine-1"]})
    trajectories = await manager.trajectories(rows, SamplingParams(temperature=1.0, seed=step), group=8)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from ..engines.types import SamplingParams
from ..runtime import ActorError, ActorNotFound, ActorRef, NodeLostError
from .batch import RolloutBatch, collate
from .loops import LoopState
from .trajectory import Trajectory

log = logging.getLogger(__name__)


class AgentLoopManager:
    """Spreads rows over agent-loop workers on any nodes and collects their trajectories in order.

    ``local``: worker name -> the engines on its node. A worker none of whose engines is in
    rotation any more (``engine_removed``) gets new rows only when no other worker is left.
    ``timeout_s``: the deadline of one worker call (``agent.rollout_timeout_s``)."""

    def __init__(
        self,
        workers: Sequence[ActorRef],
        *,
        local: dict[str, list[str]] | None = None,
        pad_token_id: int = 0,
        timeout_s: float = 3600.0,
    ) -> None:
        if not workers:
            raise ValueError("AgentLoopManager needs at least one AgentLoopWorker")
        self.workers = list(workers)
        self.local = {name: set(engines) for name, engines in (local or {}).items()}
        self.pad_token_id = pad_token_id
        self.timeout_s = timeout_s
        self.outstanding: dict[str, int] = {w.name: 0 for w in self.workers}
        self.removed: set[str] = set()  # engines out of rotation
        self.retried = 0  # rows run again after their worker was lost
        self._tells: set[asyncio.Task[Any]] = set()

    async def generate(
        self, rows: Sequence[dict[str, Any]], params: SamplingParams, *, group: int = 1
    ) -> RolloutBatch:
        return collate(await self.trajectories(rows, params, group=group), self.pad_token_id)

    async def trajectories(
        self,
        rows: Sequence[dict[str, Any]],
        params: SamplingParams,
        *,
        group: int = 1,
        states: dict[str, LoopState] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per row, in order. Every ``group`` consecutive rows go to one worker.
        ``states``: trajectories to go on with, by row ``uid`` (from ``loop_states``)."""
        rows = [
            row if row.get("uid") else dict(row, uid=uuid.uuid4().hex) for row in rows
        ]  # stable ids across retries
        units = [list(range(i, min(i + group, len(rows)))) for i in range(0, len(rows), group)]
        results: list[Trajectory | None] = [None] * len(rows)
        while units:
            plan = self._assign(units)
            calls = [
                asyncio.ensure_future(
                    self._call(worker, [rows[i] for unit in assigned for i in unit], params, states, group)
                )
                for worker, assigned in plan
            ]
            try:
                replies = await asyncio.gather(*calls, return_exceptions=True)
            except BaseException:
                for call in calls:
                    call.cancel()
                raise
            units = []
            for (worker, assigned), reply in zip(plan, replies):
                if isinstance(reply, (NodeLostError, ActorNotFound)):
                    lost = sum(len(unit) for unit in assigned)
                    graceful = getattr(reply, "graceful", False)  # its node shut down cleanly: nobody to warn
                    log.log(
                        logging.INFO if graceful else logging.WARNING,
                        "agent-loop worker %s %s (%s); its %d rows run again on another",
                        worker.name,
                        "left" if graceful else "was lost",
                        reply,
                        lost,
                    )
                    self.retried += lost
                    if worker in self.workers:
                        self.workers.remove(worker)
                    units += assigned
                elif isinstance(reply, BaseException):
                    raise reply
                else:
                    for i, trajectory in zip((i for unit in assigned for i in unit), reply):
                        results[i] = trajectory
            if units and not self.workers:
                raise NoWorkerError(
                    f"every agent-loop worker was lost (their nodes died, engines with them); {sum(map(len, units))} rows were not rolled out"
                )
            units.sort()
        return [t for t in results if t is not None]

    def _assign(self, units: list[list[int]]) -> list[tuple[ActorRef, list[list[int]]]]:
        """Each unit to the worker with the fewest rows outstanding (counting this call's), among
        those that still have an engine of their own in rotation."""
        serving = [
            w for w in self.workers if not self.local.get(w.name) or self.local[w.name] - self.removed
        ] or self.workers
        if not serving:
            raise NoWorkerError(
                "every agent-loop worker was lost (their nodes died, engines with them); nothing is left to roll out with"
            )
        load = {w.name: self.outstanding.get(w.name, 0) for w in serving}
        plan: dict[str, list[list[int]]] = {}
        for unit in units:
            name = min(load, key=lambda n: load[n])
            load[name] += len(unit)
            plan.setdefault(name, []).append(unit)
        by_name = {w.name: w for w in serving}
        return [(by_name[name], assigned) for name, assigned in plan.items()]

    async def loop_states(self, uids: Sequence[str], *, timeout_s: float = 30.0) -> dict[str, LoopState]:
        """The states of these trajectories in progress, from every worker (a checkpoint's partial
        trajectories). One that no worker holds (not started, just finished, or on a worker that
        does not answer within ``timeout_s``) is left out: resumed, it starts again."""
        wanted = list(uids)
        replies = await asyncio.gather(
            *[w.loop_states.options(timeout=timeout_s)(wanted) for w in self.workers], return_exceptions=True
        )
        states: dict[str, LoopState] = {}
        for worker, reply in zip(self.workers, replies):
            if isinstance(reply, BaseException):
                if not isinstance(reply, (ActorError, NodeLostError, ActorNotFound, TimeoutError)):
                    raise reply
                log.warning(
                    "agent-loop worker %s did not give its trajectories' states (%s): they start again on resume",
                    worker.name,
                    reply,
                )
                continue
            states.update(msgspec.msgpack.decode(reply, type=dict[str, LoopState]))
        return states

    async def _call(
        self,
        worker: ActorRef,
        rows: list[dict[str, Any]],
        params: SamplingParams,
        states: dict[str, LoopState] | None,
        group: int,
    ) -> list[Trajectory]:
        self.outstanding[worker.name] = self.outstanding.get(worker.name, 0) + len(rows)
        mine = {uid: states[uid] for row in rows if states and (uid := str(row["uid"])) in states} or None
        try:
            reply = await worker.generate.options(timeout=self.timeout_s)(rows, params, mine, group)
        finally:
            self.outstanding[worker.name] -= len(rows)
        return [t if isinstance(t, Trajectory) else msgspec.convert(t, Trajectory) for t in reply]

    def add_worker(self, worker: ActorRef, local: list[str] | None = None) -> None:
        """Take a worker (back) in, e.g. one restarted on a node that rejoined; it replaces any
        worker of its name. ``local``: the engines on its node."""
        self.workers = [w for w in self.workers if w.name != worker.name] + [worker]
        self.outstanding.setdefault(worker.name, 0)
        if local is not None:
            self.local[worker.name] = set(local)

    # -- rotation: the synchroniser takes engines out (and brings them back) --------------------
    def engine_removed(self, name: str) -> None:
        self.removed.add(name)
        self._tell(lambda w: w.remove_engine.options(timeout=10.0)(name))

    def engine_added(self, engine: ActorRef) -> None:
        self.removed.discard(engine.name)
        self._tell(lambda w: w.add_engine.options(timeout=10.0)(engine))

    def _tell(self, call: Any) -> None:
        for worker in self.workers:
            task = asyncio.ensure_future(_quietly(call(worker), worker.name))
            self._tells.add(task)
            task.add_done_callback(self._tells.discard)

    async def close(self) -> None:
        for task in list(self._tells):
            task.cancel()
        if self._tells:
            await asyncio.wait(self._tells)


class NoWorkerError(RuntimeError):
    """Every agent-loop worker was lost (their nodes died): nothing is left to roll out with."""


async def _quietly(call: Any, worker: str) -> None:
    try:
        await call
    except (ActorError, NodeLostError, ActorNotFound, TimeoutError) as exc:  # a lost worker needs no news
        log.info("agent-loop worker %s: rotation update not delivered: %s", worker, exc)
