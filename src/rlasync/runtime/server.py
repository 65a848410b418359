"""Calls other nodes make to this node's actors: the ROUTER socket and the calls in progress.

A call runs its endpoint eagerly up to the first real wait (an endpoint that answers at once
costs no task), then as a task that the caller can cancel (``Cancel``) and that stops when
the caller's node is declared dead, its connection closes, or the caller's deadline passes.
A streaming endpoint sends at most ``runtime.stream_window`` items ahead of the caller's
acknowledgements, whatever credit the caller claims. One caller runs at most
``runtime.max_calls_per_caller`` calls at once; the rest are refused (``busy``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import traceback
from typing import Any

import zmq

from ..transport import Call, Cancel, DecodeError, Error, Reply, StreamAck, StreamEnd, StreamItem
from ..transport.codec import NeedsTorch, OversizedBody
from ..transport.zmq_io import SocketPump
from .actor import Actor, endpoints_of
from .caller import Caller, current_caller
from .context import NodeContext
from .errors import (
    ActorNotFound,
    CallRefused,
    CallTimeout,
    NodeLostError,
    NotAnEndpoint,
    cancelled_from_outside,
    error_reply,
    wire_name,
)
from .types import NodeInfo, claim_of

log = logging.getLogger(__name__)


class _Serving:
    """A call this node is running for a peer; streaming calls also track send credit."""

    __slots__ = ("task", "credit", "more", "caller", "deadline")

    def __init__(self, credit: int, caller: Caller, deadline: float) -> None:
        self.task: asyncio.Task[None] | None = None
        self.credit = credit
        self.more: asyncio.Event | None = None
        self.caller = caller
        self.deadline = deadline


_SWEEP_S = 1.0  # calls past their caller's deadline are cancelled by a sweep this often


class Server:
    """Serves the calls that reach the ROUTER socket of the node ``context`` describes."""

    def __init__(self, context: NodeContext, router: zmq.Socket[Any]) -> None:
        self.context = context
        self.loop = context.loop
        self.codec = context.codec
        self.config = context.config
        self.stats = context.stats
        self.serving: dict[tuple[bytes, int], _Serving] = {}
        self.oneway: set[asyncio.Task[None]] = set()
        self.callers: dict[bytes, Caller] = {}  # routing id (one per connection over TCP) -> who it is
        self._principals: dict[str, Caller] = {}  # key or claim -> its Caller, while it has a connection
        self._by_fd: dict[int, list[bytes]] = {}  # connection descriptor -> its routing ids
        self.pump = SocketPump(
            router,
            self._on_request,
            recheck_s=self.config.io_recheck_s,
            loop=self.loop,
            routed=True,
            peers=self.callers,
            new_peer=self._identify,
            max_outbox_bytes=self.config.max_outbox_bytes,
        )
        self.pump.max_batch_bytes = self.config.max_body_bytes
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    # -- who calls ------------------------------------------------------------------------
    def _identify(self, ident: bytes, frame: zmq.Frame) -> None:
        try:
            key = frame.get("User-Id")
        except zmq.ZMQError:  # no handshake (ipc): no key
            key = ""
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):
            fd = -1
        key, claim = str(key or ""), "" if key else claim_of(ident)
        caller = self._principals.get(key or claim)
        if caller is None:  # its first connection (a member opening many shares one limit)
            caller = self._principals[key or claim] = Caller(key, claim)
            dead = self.context.dead_callers
            caller.dead = bool(dead) and (key or claim) in dead
        caller.connections += 1
        self.callers[ident] = caller
        if fd >= 0:
            self._by_fd.setdefault(fd, []).append(ident)

    def disconnected(self, fd: int) -> None:
        """A connection closed: its callers are gone, and so is any point in their calls.
        (Should the descriptor be reused by a new connection before this news arrives, that
        connection's first calls end too; its caller then times out. Rare, and bounded.)"""
        for ident in self._by_fd.pop(fd, ()):
            caller = self.callers.pop(ident, None)
            if caller is not None:
                self._cancel_calls(lambda key, ident=ident: key[0] == ident)
                caller.connections -= 1
                if not caller.connections:
                    self._principals.pop(caller.key or caller.claim, None)

    def connected(self, info: NodeInfo) -> bool:
        """Whether the process ``info`` describes holds a connection to this node now. libzmq's
        heartbeats keep one up while that process lives and its link holds, whatever its event
        loop does, and drop it ``runtime.link_timeout_s`` after a PING goes unanswered."""
        return any(caller.is_node(info) and caller.connections for caller in self._principals.values())

    def forget(self, info: NodeInfo) -> None:
        """The process ``info`` was declared dead: stop serving its calls and refuse new ones."""
        for caller in self.callers.values():
            if caller.is_node(info):
                caller.dead = True
        self._cancel_calls(lambda key: self.callers.get(key[0]) is None or self.callers[key[0]].dead)

    def _cancel_calls(self, which: Any) -> None:
        for key, serving in list(self.serving.items()):
            if which(key) and serving.task is not None:
                serving.task.cancel()

    def _sweep(self) -> None:
        """Cancel calls past their caller's deadline: the caller gave up, or is gone without a word."""
        now = self.loop.time()
        for serving in [s for s in self.serving.values() if s.deadline <= now and s.task is not None]:
            assert serving.task is not None
            serving.task.cancel()
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    async def stop(self, timeout: float) -> None:
        """Cancel every call in progress and wait up to ``timeout`` s for them to unwind."""
        self._sweeper.cancel()
        tasks = [s.task for s in self.serving.values() if s.task is not None] + list(self.oneway)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    # -- input ----------------------------------------------------------------------------
    def _on_request(self, frames: list[Any]) -> None:
        stats = self.stats
        if len(frames) < 2:
            stats.malformed_frames += 1
            return
        ident = frames[0]
        if self.context.deferred is not None:  # torch is loading for an earlier message: keep order
            self.context.defer_until_torch(self._on_request, frames)
            return
        try:
            msg = self.codec.decode(frames[1:])
        except NeedsTorch:
            self.context.defer_until_torch(self._on_request, frames)
            return
        except OversizedBody as exc:
            stats.oversized_bodies += 1
            log.warning("refused a message from %s: %s", self.callers.get(ident), exc)
            return
        except DecodeError as exc:
            stats.malformed_frames += 1
            log.debug("dropped malformed request from %r: %s", ident[:32], exc)
            return
        caller = self.callers.get(ident)
        if caller is None:  # its connection closed while torch loaded for this message: nobody to answer
            return
        if isinstance(msg, Call):
            self._serve(ident, caller, msg)
        elif isinstance(msg, Cancel):
            serving = self.serving.get((ident, msg.id))
            if serving is not None and serving.task is not None:
                serving.task.cancel()
        elif isinstance(msg, StreamAck):
            serving = self.serving.get((ident, msg.id))
            if serving is not None:
                unacked = self.config.stream_window - serving.credit  # items sent and not yet acknowledged
                if not 0 <= msg.n <= unacked:
                    stats.credit_refused += 1  # more than it was sent: forged, or a bug
                serving.credit += min(max(msg.n, 0), unacked)
                if serving.more is not None:
                    serving.more.set()
        else:
            stats.malformed_frames += 1

    def _serve(self, ident: bytes, caller: Caller, call: Call) -> None:
        stats = self.stats
        if caller.dead:
            stats.calls_fenced += 1
            message = (
                f"{self.context.node_id} serves no calls from {caller}: the head declared that process dead"
            )
            # "fenced", not "gone": the caller is the one lost, not this node it called.
            return self._fail(ident, call.id, "fenced", NodeLostError, message)
        if call.to and call.to != self.context.incarnation:
            # The caller means a process that used to listen at this address (same rank,
            # restarted): that process is gone, whatever actor of the same name lives here now.
            message = f"the process of {self.context.node_id} that was called ({call.to}) is gone; {self.context.incarnation} listens there now"
            return self._fail(ident, call.id, "gone", NodeLostError, message)
        if caller.running >= self.config.max_calls_per_caller:
            stats.calls_refused += 1
            message = (
                f"{self.context.node_id} is already running runtime.max_calls_per_caller={self.config.max_calls_per_caller} "
                f"calls for this caller; keep runtime.max_inflight_per_peer below it"
            )
            return self._fail(ident, call.id, "busy", CallRefused, message)
        actor = self.context.actors.get(call.actor)
        if actor is None:
            detail = "it was never spawned here, or it stopped"
            return self._fail(
                ident,
                call.id,
                "no_actor",
                ActorNotFound,
                f"no actor named {call.actor!r} on {self.context.node_id} ({detail})",
            )
        ep = endpoints_of(type(actor)).get(call.method)
        if ep is None or ep.streaming != call.stream:
            what = "a streaming" if call.stream else "a unary"
            return self._fail(
                ident,
                call.id,
                "no_endpoint",
                NotAnEndpoint,
                f"{call.method!r} is not {what} endpoint of actor {call.actor!r}",
            )
        stats.calls_served += 1
        timeout = call.timeout if call.timeout > 0 else self.config.call_timeout_s
        serving = _Serving(self.config.stream_window, caller, self.loop.time() + timeout + _SWEEP_S)
        if call.id:  # registered first: on 3.12+ the task may run (and end) before _task returns
            self.serving[(ident, call.id)] = serving
        caller.running += 1
        run = (
            self._run_stream(ident, call, ep, actor, serving)
            if call.stream
            else self._run_unary(ident, call, ep, actor, caller)
        )
        # Every endpoint runs in a task of its own, so asyncio.timeout, TaskGroup and
        # contextvars behave as in any coroutine; on 3.12+ the task starts eagerly, and an
        # endpoint that answers without waiting finishes before this returns.
        token = current_caller.set(caller)  # the task's context is a copy of this one
        try:
            serving.task = task = _task(self.loop, run)
        finally:
            current_caller.reset(token)
        if not call.id and not task.done():  # one-way: nobody waits, but stop() must cancel it
            self.oneway.add(task)
            task.add_done_callback(self.oneway.discard)

    def _fail(self, ident: bytes, call_id: int, code: str, kind: type, message: str) -> None:
        if call_id:
            self._send(ident, Error(call_id, code, wire_name(kind), message))

    def _send(self, ident: bytes, msg: Any) -> bool:
        """Send ``msg``; if it cannot be encoded, send that error instead and return False."""
        ok = True
        try:
            frames = self.codec.encode(msg)
        except Exception as exc:  # an unencodable result (a type, an int past 64 bits, ...): say why
            kind = type(exc).__qualname__
            frames = self.codec.encode(
                Error(msg.id, "raised", kind, f"cannot send the result: {exc}", traceback.format_exc())
            )
            ok = False
        self.pump.send([ident, *frames], copy=False)  # a caller that is gone: counted by the pump
        return ok

    async def _run_unary(self, ident: bytes, call: Call, ep: Any, actor: Actor, caller: Caller) -> None:
        call_id = call.id
        try:
            args, kwargs = ep.convert_args(call.args, call.kwargs)
            result = await ep.fn(actor, *args, **kwargs)
        except asyncio.CancelledError as exc:
            if cancelled_from_outside():
                return  # the caller cancelled or timed out, or this node is stopping: no reply wanted
            if call_id:  # the endpoint itself let a CancelledError out: that is its answer
                self._send(ident, error_reply(call_id, exc))
            return
        except Exception as exc:
            if call_id:
                self._send(ident, error_reply(call_id, exc))
            return
        finally:
            caller.running -= 1
            if call_id:
                self.serving.pop((ident, call_id), None)
        if call_id:
            self._send(ident, Reply(call_id, self.codec.lift_one(result)))

    async def _run_stream(self, ident: bytes, call: Call, ep: Any, actor: Actor, serving: _Serving) -> None:
        key = (ident, call.id)
        timeout = self.config.call_timeout_s
        try:
            args, kwargs = ep.convert_args(call.args, call.kwargs)
            items = ep.fn(actor, *args, **kwargs)
            try:
                async for item in items:
                    while serving.credit <= 0:  # the caller has not consumed enough: wait for its ack
                        serving.more = asyncio.Event()
                        try:
                            async with asyncio.timeout(timeout):
                                await serving.more.wait()
                        except TimeoutError:
                            raise CallTimeout(
                                f"the caller consumed nothing for {timeout:g}s (runtime.call_timeout_s)"
                            ) from None
                    serving.credit -= 1
                    if not self._send(ident, StreamItem(call.id, self.codec.lift_one(item))):
                        return  # the caller got the error and ended the stream: stop the generator
            finally:
                await items.aclose()
        except asyncio.CancelledError as exc:
            if not cancelled_from_outside():
                self._send(ident, error_reply(call.id, exc))
            return
        except Exception as exc:
            self._send(ident, error_reply(call.id, exc))
        else:
            self._send(ident, StreamEnd(call.id))
        finally:
            serving.caller.running -= 1
            self.serving.pop(key, None)


def _task(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[None]:
    """A task for ``coro`` that runs its first step now (eager start), when no task is current.

    Eager start spares an endpoint that answers at once the task scheduling and a loop
    iteration (measured: about half the pipelined throughput on 3.11 without it).
    """
    if asyncio.current_task(loop) is not None:
        return loop.create_task(coro)
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return _EagerTask(coro, loop)


class _EagerTask(asyncio.tasks._PyTask):  # type: ignore[name-defined]
    """Python 3.11's pure-Python Task, started as 3.12's ``eager_start=True`` does.

    (Being the pure-Python class, it is not an instance of the C ``asyncio.Task`` that
    ``isinstance`` checks see, and it ignores a loop's task factory.)

    The first step runs inside ``__init__``, with this task current (so ``asyncio.timeout``,
    ``TaskGroup`` and ``current_task`` work from the first line); what is left, if anything,
    continues as an ordinary task. Uses two private names of CPython 3.11's asyncio, which
    3.12 replaced with the public ``eager_start``; only 3.11 takes this path.
    """

    def __init__(self, coro: Any, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.futures._PyFuture.__init__(self, loop=loop)  # type: ignore[attr-defined]
        self._name = "rlasync-endpoint"
        self._num_cancels_requested = 0
        self._must_cancel = False
        self._fut_waiter = None
        self._coro = coro
        self._context = contextvars.copy_context()
        self._context.run(self._Task__step)
        if not self.done():
            asyncio.tasks._register_task(self)
