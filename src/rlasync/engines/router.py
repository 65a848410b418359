"""The router: spreads generate requests over engine actors on every node.

    router = Router([engine_a, engine_b, engine_c], RouterConfig(max_inflight_per_engine=64))
    out = await router.generate(request, session_id="traj-17")   # every turn of traj-17: one engine

What verl's ``AsyncLLMServerManager`` does, done better:

- **Least outstanding requests, counted down.** Each request goes to the engine with the
  fewest requests outstanding, and the count drops when the request finishes (verl's
  per-worker counters only ever grow). Ties go to the engine given the fewest requests so
  far, so even one-at-a-time traffic spreads.
- **One view of the whole cluster.** Every ``load_refresh_s`` the router asks each engine
  for its running and waiting requests; what other routers (agent-loop workers on other
  nodes) placed there counts as load here too. The same poll notices dead engines early.
- **Sticky sessions.** Every turn of one conversation goes to the engine that served its
  first turn, so the engine can reuse the prefix; an LRU bounds the memory of sessions.
- **A cap per engine.** At most ``max_inflight_per_engine`` requests outstanding on one
  engine from this router; more wait (up to ``queue_timeout_s``) in arrival order.
- **Requests move.** ``migrate(request_id, engine)`` sends an outstanding request's
  conversation to another engine: the request is cut where it is (its tokens kept by the
  caller, an agent loop, which goes on from them) and the next attempt lands on ``engine``,
  which prefills what was made so far (queued turns evened out, the long tail packed:
  ``engines.repack``).
- **Dead engines leave.** When an engine's node is lost its in-flight requests are retried
  on another engine from the start (``on_engine_lost="retry"``) or fail with
  ``EngineLostError`` (``"fail"``); the engine takes no more requests. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

import msgspec

from ..config.engine import RouterConfig
from ..runtime import ActorNotFound, ActorRef, CallTimeout, NodeLostError
from .protocol import EngineError, EngineLostError
from .repack import rebalance_moves, repack_moves
from .router_index import EngineSlot, SlotIndex
from .types import EngineStats, GenerateOutput, GenerateRequest, TokenChunk

log = logging.getLogger(__name__)
# An engine is gone when its node is lost or its actor no longer exists there.
_GONE = (NodeLostError, ActorNotFound)
T = TypeVar("T")


class NoEngineError(EngineError):
    """The router has no live engine left."""


class RouterBusyError(EngineError, TimeoutError):
    """No engine had a free slot within ``router.queue_timeout_s``."""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    node: str
    outstanding: int  # this router's requests on it now
    others: int  # requests other routers have on it, as of its last report
    assigned: int  # requests this router ever gave it


class RouterStats(msgspec.Struct, frozen=True, kw_only=True):
    engines: list[EngineLoad]
    queued: int  # requests waiting for a free slot
    sessions: int  # conversations remembered for stickiness
    retries: int  # requests moved to another engine after a loss
    engines_lost: int
    migrations: int = 0  # requests moved on purpose (``migrate``)


class Router:
    """``prefer``: names of engines to use while any of them is in rotation (an agent-loop
    worker's own node's engines); the others take over only when none of these is left."""

    def __init__(
        self, engines: Iterable[ActorRef], config: RouterConfig | None = None, *, prefer: Iterable[str] = ()
    ) -> None:
        self.config = config or RouterConfig()
        self.prefer = frozenset(prefer)
        self._slots: dict[str, EngineSlot] = {}
        self._sessions: collections.OrderedDict[str, EngineSlot] = collections.OrderedDict()
        self._queue: collections.deque[tuple[asyncio.Future[EngineSlot], str | None]] = collections.deque()
        self._where: dict[str, EngineSlot] = {}  # request id -> engine, while outstanding
        self._session_of: dict[str, str] = {}  # request id -> its session, while outstanding
        # session -> where its next request must go (migrate); bounded like the sessions
        self._moving: collections.OrderedDict[str, EngineSlot] = collections.OrderedDict()
        self._migrations = 0
        self._index = SlotIndex(self._slots)  # the engines by load, to pick among many quickly
        self._joined = 0
        self._retries = 0
        self._lost = 0
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False
        for ref in engines:
            self.add_engine(ref)

    # -- engines ------------------------------------------------------------------------------
    def add_engine(self, ref: ActorRef) -> None:
        """Start sending requests to ``ref`` (an ``EngineActor``)."""
        if ref.name in self._slots:
            raise ValueError(f"engine {ref.name!r} is already in the router")
        self._joined += 1
        self._slots[ref.name] = slot = EngineSlot(ref, self._joined)
        self._index.touch(slot)
        self._dispatch()

    def engine_lost(self, name: str, error: BaseException) -> bool:
        """Take ``name`` out of rotation if ``error`` (from a call to it made elsewhere, e.g. a
        pause) says it is gone; its sessions move on. True if it was gone."""
        slot = self._slots.get(name)
        if not isinstance(error, _GONE):
            return False
        if slot is not None:
            self._engine_lost(slot, error)
        return True

    def remove_engine(self, name: str) -> None:
        """Send no new requests to ``name``; requests outstanding there finish normally."""
        slot = self._slots.pop(name, None)
        if slot is not None:
            slot.alive = False
            self._dispatch()

    @property
    def engines(self) -> list[ActorRef]:
        """The live engines, e.g. to pause them all or update their weights."""
        return [slot.ref for slot in self._slots.values()]

    def stats(self) -> RouterStats:
        return RouterStats(
            engines=[
                EngineLoad(
                    name=name,
                    node=s.ref.node_id,
                    outstanding=s.outstanding,
                    others=s.others,
                    assigned=s.assigned,
                )
                for name, s in self._slots.items()
            ],
            queued=self._queued(),
            sessions=len(self._sessions),
            retries=self._retries,
            engines_lost=self._lost,
            migrations=self._migrations,
        )

    def outstanding(self, name: str) -> list[str]:
        """Ids of this router's requests outstanding on engine ``name``."""
        slot = self._slots.get(name)
        return [] if slot is None else list(slot.requests)

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest, *, session_id: str | None = None) -> GenerateOutput:
        """Run ``request`` on an engine; turns with the same ``session_id`` share one engine."""
        moves = 0
        while True:
            slot = await self._acquire(session_id, request.request_id)
            call = slot.ref.generate.options(timeout=self.config.request_timeout_s)
            try:
                return _typed(await call(request), GenerateOutput)
            except _GONE as exc:
                self._engine_lost(slot, exc)
                self._check_move(slot, request, moves, exc)
                moves += 1
            finally:
                self._release(slot, request.request_id)

    async def generate_stream(
        self, request: GenerateRequest, *, session_id: str | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Stream ``request``'s tokens. A loss before the first chunk moves the request like
        ``generate``; a loss after it raises ``EngineLostError`` (its tokens were seen)."""
        moves = 0
        while True:
            slot = await self._acquire(session_id, request.request_id)
            stream = slot.ref.generate_stream.options(timeout=self.config.request_timeout_s)(request)
            started = False
            try:
                async for chunk in stream:
                    started = True
                    yield _typed(chunk, TokenChunk)
                return
            except _GONE as exc:
                self._engine_lost(slot, exc)
                if started:
                    raise EngineLostError(
                        f"engine {slot.ref.name!r} on {slot.ref.node_id} was lost in the middle of streaming request "
                        f"{request.request_id!r}; the tokens already streamed cannot be taken back, so it was not moved"
                    ) from exc
                self._check_move(slot, request, moves, exc)
                moves += 1
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()
                self._release(slot, request.request_id)

    async def migrate(self, request_id: str, target: str) -> bool:
        """Move outstanding request ``request_id`` to engine ``target``: its session's next
        request goes there (past the cap: a migrated turn is not new work), and the request is
        aborted where it runs. Its caller must go on from the partial turn (the agent loops do:
        an aborted turn is re-submitted with the tokens it made, so ``target`` prefills them and
        the trajectory keeps every token and its version). False (nothing done) where the
        request is not outstanding here, has no session, already runs on ``target``, or
        ``target`` is not a live engine."""
        slot, session_id = self._where.get(request_id), self._session_of.get(request_id)
        destination = self._slots.get(target)
        if slot is None or session_id is None or destination is None or destination is slot:
            return False
        self._moving[session_id] = destination
        while len(self._moving) > max(1024, self.config.sticky_sessions):
            self._moving.popitem(last=False)
        if not await self.abort(request_id):
            self._moving.pop(session_id, None)  # it ended meanwhile: nothing moved
            return False
        self._migrations += 1
        return True

    async def abort(self, request_id: str) -> bool:
        """Abort an outstanding request on its engine (its caller gets finish reason "abort")."""
        slot = self._where.get(request_id)
        if slot is None or not slot.alive:
            return False
        try:
            aborted: bool = await slot.ref.abort.options(timeout=self.config.queue_timeout_s)(request_id)
        except _GONE as exc:
            self._engine_lost(slot, exc)
            return False
        return aborted

    async def close(self) -> None:
        """Stop the load poll and fail queued requests; outstanding ones finish on their own."""
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        while self._queue:
            fut, _ = self._queue.popleft()
            if not fut.done():
                fut.set_exception(NoEngineError("the router was closed"))

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _queued(self) -> int:
        """Requests waiting here for a slot (at the cap)."""
        return sum(1 for fut, _ in self._queue if not fut.done())

    # -- choosing an engine -----------------------------------------------------------------------
    def _pick(self, session_id: str | None) -> EngineSlot | None:
        """The engine for this request now, or None if it must wait for a slot."""
        if not self._slots:
            raise NoEngineError(
                "the router has no live engine (every engine was removed or its node was lost); "
                "spawn EngineActors and add them with router.add_engine"
            )
        cap = self.config.max_inflight_per_engine or None
        if session_id is not None:
            moved = self._moving.pop(session_id, None)
            if moved is not None and moved.alive:
                return moved
            sticky = self._sessions.get(session_id)
            if sticky is not None and sticky.alive:
                return sticky if cap is None or sticky.outstanding < cap else None
        if not self.prefer:
            return self._index.least(cap)
        candidates: Iterable[EngineSlot] = self._slots.values()
        preferred = [slot for slot in candidates if slot.ref.name in self.prefer]
        candidates = preferred or candidates
        best: EngineSlot | None = None
        for slot in candidates:
            if cap is not None and slot.outstanding >= cap:
                continue
            if best is None or slot.key() < best.key():
                best = slot
        return best

    def _take(
        self, slot: EngineSlot, session_id: str | None, request_id: str, *, reserved: bool = False
    ) -> EngineSlot:
        if not reserved:
            slot.outstanding += 1
        slot.assigned += 1
        self._index.touch(slot)
        slot.requests[request_id] = None
        self._where[request_id] = slot
        if session_id is not None:
            self._session_of[request_id] = session_id
        if session_id is not None and self.config.sticky_sessions:
            self._sessions[session_id] = slot
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.config.sticky_sessions:
                self._sessions.popitem(last=False)
        return slot

    async def _acquire(self, session_id: str | None, request_id: str) -> EngineSlot:
        if self._closed:
            raise NoEngineError("the router was closed")
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh(), name="rlasync-router-refresh"
            )
        if not self._queue:  # nobody waits ahead of us: take a slot now if there is one
            slot = self._pick(session_id)
            if slot is not None:
                return self._take(slot, session_id, request_id)
        waiter: asyncio.Future[EngineSlot] = asyncio.get_running_loop().create_future()
        self._queue.append((waiter, session_id))
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                slot = await waiter
        except TimeoutError:
            raise RouterBusyError(
                f"request {request_id!r} found no free engine slot within router.queue_timeout_s="
                f"{self.config.queue_timeout_s:g}s ({len(self._slots)} engines, router.max_inflight_per_engine="
                f"{self.config.max_inflight_per_engine}); add engines, raise the cap or the timeout"
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result(), None)  # granted a slot just as we gave up: give it back
            raise
        return self._take(slot, session_id, request_id, reserved=True)

    def _release(self, slot: EngineSlot, request_id: str | None) -> None:
        slot.outstanding -= 1
        self._index.touch(slot)
        if request_id is not None:
            slot.requests.pop(request_id, None)
            if self._where.get(request_id) is slot:
                del self._where[request_id]
                self._session_of.pop(request_id, None)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand freed slots to queued requests, in arrival order."""
        if not self._queue:
            return
        waiting: collections.deque[tuple[asyncio.Future[EngineSlot], str | None]] = collections.deque()
        while self._queue:
            waiter, session_id = self._queue.popleft()
            if waiter.done():
                continue
            try:
                slot = self._pick(session_id)
            except NoEngineError as exc:
                waiter.set_exception(exc)
                continue
            if slot is None:
                waiting.append((waiter, session_id))
                if session_id is None or session_id not in self._sessions:
                    break  # no free slot anywhere: later requests cannot be served either
                continue  # only its sticky engine is full; others may still be served
            # Reserve the slot now, so the next waiter sees it taken; the woken request
            # records itself there (_take with reserved=True).
            slot.outstanding += 1
            self._index.touch(slot)
            waiter.set_result(slot)
        waiting.extend(self._queue)
        self._queue = waiting

    # -- failures and load ----------------------------------------------------------------------
    def _engine_lost(self, slot: EngineSlot, exc: BaseException) -> None:
        if not slot.alive:
            return
        slot.alive = False
        self._lost += 1
        self._slots.pop(slot.ref.name, None)
        for session_id in [s for s, where in self._sessions.items() if where is slot]:
            del self._sessions[session_id]
        if getattr(exc, "graceful", False):  # its node shut down cleanly (the cluster is closing)
            log.info(
                "engine %s on %s left (%s); it gets no more requests", slot.ref.name, slot.ref.node_id, exc
            )
        else:
            log.warning(
                "engine %s on %s was lost (%s); it gets no more requests",
                slot.ref.name,
                slot.ref.node_id,
                exc,
            )
        self._dispatch()

    def _check_move(self, slot: EngineSlot, request: GenerateRequest, moves: int, exc: BaseException) -> None:
        """Raise unless the request lost with ``slot`` may be retried elsewhere."""
        where = f"engine {slot.ref.name!r} on {slot.ref.node_id} was lost while serving request {request.request_id!r}"
        if self.config.on_engine_lost == "fail":
            raise EngineLostError(
                f"{where} (router.on_engine_lost='fail'; 'retry' would move it to another engine)"
            ) from exc
        if moves >= self.config.max_retries:
            raise EngineLostError(
                f"{where}, after {moves} moves already (router.max_retries={self.config.max_retries})"
            ) from exc
        self._retries += 1
        log.info("%s; retrying it on another engine", where)

    async def _refresh(self) -> None:
        """Poll every engine's load (what other routers put there) and liveness."""
        while not self._closed:
            await asyncio.sleep(self.config.load_refresh_s)
            slots = list(self._slots.values())
            before = [(s.outstanding, s.assigned) for s in slots]
            timeout = max(5 * self.config.load_refresh_s, 5.0)
            replies = await asyncio.gather(
                *[s.ref.stats.options(timeout=timeout)() for s in slots], return_exceptions=True
            )
            for slot, reply, (outstanding, assigned) in zip(slots, replies, before):
                if isinstance(reply, _GONE):
                    self._engine_lost(slot, reply)
                elif isinstance(reply, CallTimeout):
                    log.warning(
                        "engine %s did not report its load in time; keeping its last figure", slot.ref.name
                    )
                elif isinstance(reply, BaseException):
                    log.warning("engine %s: load report failed: %r", slot.ref.name, reply)
                else:
                    # The engine counted ours too: at most what was outstanding when we asked
                    # plus what we sent since. Subtracting that bound never overstates the
                    # others' load (a stale overstatement would steer requests away for nothing).
                    stats = _typed(reply, EngineStats)
                    ours = outstanding + (slot.assigned - assigned)
                    slot.others = max(0, stats.running + stats.waiting - ours)
                    self._index.touch(slot)
                    slot.waiting = stats.waiting
            self._dispatch()
            if self.config.rebalance_queued or self.config.repack_below:
                await self._move_turns()

    async def _move_turns(self) -> None:
        """The moves ``engines.repack``'s policies pick (queued turns evened out, then the long
        tail packed), made at once."""
        moves: list[tuple[str, str]] = []
        if self.config.rebalance_queued:
            queued = {  # our newest turns there, as many as wait in its queue
                name: list(itertools.islice(reversed(slot.requests), slot.waiting))
                for name, slot in self._slots.items()
                if slot.waiting and slot.requests
            }
            if queued:
                moves += rebalance_moves({name: slot.load for name, slot in self._slots.items()}, queued)
        if self.config.repack_below and not moves:
            waiting = self._queued() + sum(s.waiting for s in self._slots.values())
            moves = repack_moves(
                {name: list(slot.requests) for name, slot in self._slots.items()},
                waiting,
                below=self.config.repack_below,
                target_max=self.config.repack_target_max,
            )
        results = await asyncio.gather(
            *[self.migrate(request_id, target) for request_id, target in moves], return_exceptions=True
        )
        for (request_id, target), result in zip(moves, results):
            if isinstance(result, Exception):  # the load poll goes on: the turn stays where it is
                log.warning("moving request %s onto %s failed: %r", request_id, target, result)


def _typed(value: Any, kind: type[T]) -> T:
    # A ref whose actor class is not imported here returns plain data: decode it.
    return value if isinstance(value, kind) else msgspec.convert(value, kind)
