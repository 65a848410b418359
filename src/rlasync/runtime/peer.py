"""The calls one node has outstanding to another: a DEALER socket and its pending table.

Each pending call holds a future and a deadline (checked by one sweep per peer). A call
ends in exactly one of: reply, remote error, ``CallTimeout`` (the callee is told to stop),
cancellation by the caller (the callee is told to stop), or ``NodeLostError`` when the
membership declares the peer dead. Nothing waits without a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq

from ..transport import Call, Cancel, DecodeError, Error, Reply, StreamAck, StreamEnd, StreamItem
from ..transport.auth import monitor_event
from ..transport.codec import NeedsTorch, OversizedBody
from ..transport.zmq_io import SocketPump, keep_alive
from .context import NodeContext
from .errors import CallRefused, CallTimeout, NodeLostError, lost_again, remote_error
from .types import NodeInfo, ipc_routing_id

log = logging.getLogger(__name__)

_ITEM, _END, _FAIL = 0, 1, 2
_CONNECTIONS = itertools.count()  # numbers this process's ipc connections (their routing ids)


class CallTask(asyncio.Task):
    """A call that needs a task (a call to an actor of this node)."""


class CallFuture(asyncio.Future):
    """The answer to one remote call. Cancelling it (or the task awaiting it) tells the callee.

    A subclass rather than a done-callback: the hot path then schedules nothing extra.
    """

    def __init__(self, peer: Peer, call_id: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.peer = peer
        self.call_id = call_id

    def cancel(self, msg: Any = None) -> bool:
        if not asyncio.Future.cancel(self, msg):
            return False
        self.peer.cancel_call(self.call_id)
        return True


# Deadlines are checked by one sweep per peer this often, not by a timer per call: a call
# times out at most this much after its deadline, and the hot path arms no timer.
_SWEEP_S = 0.025


class _Pending:
    __slots__ = ("future", "deadline", "convert", "actor", "method", "timeout", "frames", "started")

    def __init__(self, future: CallFuture, actor: str, method: str, timeout: float, convert: Any) -> None:
        self.future = future
        self.actor = actor
        self.method = method
        self.timeout = timeout
        self.convert = convert
        self.deadline = future.get_loop().time() + timeout
        self.frames: list[Any] | None = None  # the encoded call while it waits for a slot
        self.started = 0.0  # perf_counter() when made (metrics on: its round trip is observed)


class Peer:
    """Outgoing calls from this node (``context``) to one other node's process (``info``)."""

    def __init__(self, context: NodeContext, info: NodeInfo) -> None:
        self.context = context
        self.info = info
        self.loop = context.loop
        self.codec = context.codec
        self.stats = context.stats
        self.round_trips = context.round_trips
        config = context.config
        self.max_inflight = config.max_inflight_per_peer
        sock = context.sockets.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        if info.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # ZeroMQ dials IPv6 only when told
        keep_alive(sock, config.heartbeat_interval_s, config.link_timeout_s)
        if info.address.startswith("tcp://"):
            # Over TCP this process is its CURVE key (caller.Caller); the callee names the
            # connection itself, so no peer can pick another's routing id and take its replies.
            context.require_keys().make_client(sock)
        else:
            # Over ipc (a folder only this user can enter) the identity names this process and
            # this connection (``types.ipc_routing_id``).
            ident = ipc_routing_id(context.node_id, context.incarnation, next(_CONNECTIONS))
            sock.setsockopt(zmq.IDENTITY, ident)
        sock.connect(info.address)
        self.pump = SocketPump(
            sock,
            self._on_message,
            recheck_s=config.io_recheck_s,
            loop=self.loop,
            max_outbox_bytes=config.max_outbox_bytes,
        )
        self.pump.max_batch_bytes = config.max_body_bytes
        self.max_queued = config.max_queued_calls
        self.pending: dict[int, _Pending] = {}
        self.streams: dict[int, tuple[asyncio.Queue[tuple[int, Any]], str, str]] = {}
        self.waiting: collections.deque[int] = collections.deque()  # queued call ids, oldest first
        self.inflight = 0  # calls sent and not yet answered, at most max_inflight
        self.next_id = 0
        self.lost: NodeLostError | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._link: SocketPump | None = None  # watch_link's monitor
        self.link_up = False  # watch_link: the connection is up (its handshake done, not dropped since)

    # -- unary calls ------------------------------------------------------------------------
    def call(
        self, actor: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float, convert: Any
    ) -> asyncio.Future[Any]:
        """Send a call now, or queue it until one of ``max_inflight_per_peer`` slots frees up.

        Either way the caller gets its future at once and the deadline runs from now; the
        arguments are encoded now, so later changes to them do not leak into the call.
        """
        self.next_id += 1
        call_id = self.next_id
        future = CallFuture(self, call_id, self.loop)
        if self.lost is not None:
            future.set_exception(lost_again(self.lost))
            return future
        send_now = (self.inflight < self.max_inflight and not self.waiting) or actor[:1] == "_"
        if not send_now and len(self.waiting) >= self.max_queued:
            self.stats.calls_refused += 1
            future.set_exception(
                CallRefused(
                    f"call to {actor}.{method} on {self.info.node_id}: {len(self.waiting)} calls already wait for one of "
                    f"runtime.max_inflight_per_peer={self.max_inflight} slots (runtime.max_queued_calls={self.max_queued}); "
                    "the callee is far slower than its callers: await some calls before making more"
                )
            )
            return future
        frames = self.codec.encode(
            Call(call_id, actor, method, self.codec.lift(args), kwargs, to=self.to, timeout=timeout)
        )
        pending = _Pending(future, actor, method, timeout, convert)
        if self.round_trips is not None:  # the loop's clock is too coarse for calls (uvloop: 1 ms)
            pending.started = time.perf_counter()
        self.pending[call_id] = pending
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)
        if send_now:
            # The runtime's own actors (heartbeats, membership) never queue behind user calls:
            # a node busy with slow calls must not be declared dead for it.
            self._send_call(frames)
        else:  # backpressure: the callee is behind, so this call waits its turn here
            pending.frames = frames
            self.waiting.append(call_id)
        return future

    def _send_call(self, frames: list[Any]) -> None:
        self.inflight += 1
        self.pump.send(frames, copy=False)
        self.stats.calls_sent += 1

    def _send_waiting(self) -> None:
        now = self.loop.time()
        while self.waiting and self.inflight < self.max_inflight:
            call_id = self.waiting.popleft()
            pending = self.pending.get(call_id)
            if pending is None or pending.frames is None:  # it timed out or was cancelled
                continue
            if pending.deadline <= now:  # expired while it waited: fail it here, never send it
                self.stats.calls_expired_unsent += 1
                self._expire(call_id)
                continue
            frames, pending.frames = pending.frames, None
            self._send_call(frames)

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.loop.time()
        for call_id in [i for i, p in self.pending.items() if p.deadline <= now]:
            self._expire(call_id)
        if self.pending and self.lost is None:
            self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    def _expire(self, call_id: int) -> None:
        pending = self._end(call_id, tell_callee=True)
        if pending is None or pending.future.done():
            return
        where = f"call to {pending.actor}.{pending.method} on {self.info.node_id}"
        if pending.frames is not None:
            message = (
                f"{where} waited {pending.timeout:.3g}s for one of runtime.max_inflight_per_peer="
                f"{self.max_inflight} call slots without being sent: the callee is slower than its "
                "callers; raise that setting or runtime.call_timeout_s"
            )
        else:
            message = f"{where} got no answer within {pending.timeout:.3g}s; raise runtime.call_timeout_s or pass .options(timeout=...)"
        pending.future.set_exception(CallTimeout(message))

    def cancel_call(self, call_id: int) -> None:
        """The caller cancelled call ``call_id``: forget it, tell the callee, free its slot."""
        self._end(call_id, tell_callee=True)

    def _end(self, call_id: int, tell_callee: bool = False) -> _Pending | None:
        """Forget a call (answered, timed out or cancelled); if it was sent, free its slot."""
        pending = self.pending.pop(call_id, None)
        if pending is None or pending.frames is not None:  # unknown, or never sent: no slot held
            return pending
        self.inflight -= 1
        if tell_callee and self.lost is None:
            self.pump.send(self.codec.encode(Cancel(call_id)))  # the callee stops working on it
        if self.waiting:
            self._send_waiting()
        return pending

    # -- streaming calls --------------------------------------------------------------------
    async def stream(
        self, actor: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float, convert: Any
    ) -> AsyncIterator[Any]:
        if self.lost is not None:
            raise lost_again(self.lost)
        self.next_id += 1
        call_id = self.next_id
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.streams[call_id] = (queue, actor, method)
        self.pump.send(
            self.codec.encode(
                Call(call_id, actor, method, self.codec.lift(args), kwargs, stream=True, to=self.to)
            ),
            copy=False,
        )
        self.stats.calls_sent += 1
        ack_every = max(1, self.context.config.stream_window // 2)
        unacked = 0
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        kind, value = await queue.get()
                except TimeoutError:
                    raise CallTimeout(
                        f"stream {actor}.{method} on {self.info.node_id} sent no item for {timeout:.3g}s; "
                        "raise runtime.call_timeout_s or pass .options(timeout=...)"
                    ) from None
                if kind == _ITEM:
                    unacked += 1
                    if unacked >= ack_every:
                        self.pump.send(self.codec.encode(StreamAck(call_id, unacked)))
                        unacked = 0
                    yield convert(value) if convert is not None else value
                elif kind == _END:
                    finished = True
                    return
                else:
                    finished = True
                    raise value
        finally:
            self.streams.pop(call_id, None)
            if not finished and self.lost is None:
                self.pump.send(self.codec.encode(Cancel(call_id)))

    # -- input ------------------------------------------------------------------------------
    def _on_message(self, frames: list[Any]) -> None:
        if self.context.deferred is not None:  # torch is loading for an earlier message: keep order
            self.context.defer_until_torch(self._on_message, frames)
            return
        try:
            msg = self.codec.decode(frames)
        except NeedsTorch:
            self.context.defer_until_torch(self._on_message, frames)
            return
        except OversizedBody as exc:
            self.stats.oversized_bodies += 1
            log.warning("refused a message from %s: %s", self.info.node_id, exc)
            return
        except DecodeError as exc:
            self.stats.malformed_frames += 1
            log.debug("dropped malformed message from %s: %s", self.info.node_id, exc)
            return
        if isinstance(msg, Reply):
            pending = self._end(msg.id)
            if pending is None:
                self.stats.unknown_replies += 1
                return
            if self.round_trips is not None:
                self.round_trips.observe(time.perf_counter() - pending.started)
            if not pending.future.done():
                value = msg.value
                if pending.convert is not None:
                    try:
                        value = pending.convert(value)
                    except Exception as exc:
                        pending.future.set_exception(
                            TypeError(f"{pending.actor}.{pending.method} returned {exc}")
                        )
                        return
                pending.future.set_result(value)
        elif isinstance(msg, StreamItem):
            entry = self.streams.get(msg.id)
            if entry is not None:
                entry[0].put_nowait((_ITEM, msg.value))
        elif isinstance(msg, StreamEnd):
            entry = self.streams.get(msg.id)
            if entry is not None:
                entry[0].put_nowait((_END, None))
        elif isinstance(msg, Error):
            pending = self._end(msg.id)
            if pending is not None:
                if not pending.future.done():
                    pending.future.set_exception(self._remote_error(msg, pending.actor, pending.method))
                return
            entry = self.streams.get(msg.id)
            if entry is not None:
                entry[0].put_nowait((_FAIL, self._remote_error(msg, entry[1], entry[2])))
            else:
                self.stats.unknown_replies += 1
        else:  # a Call, Cancel or StreamAck has no business on a DEALER
            self.stats.malformed_frames += 1

    @property
    def to(self) -> str:
        """The incarnation every call names, so a restarted process at the address refuses it."""
        incarnation = self.info.incarnation
        return "" if incarnation == "unknown" else incarnation

    def _remote_error(self, msg: Error, actor: str, method: str) -> Exception:
        if msg.code == "fenced":  # the head declared *this* process dead: the callee lives on
            node, incarnation = self.context.node_id, self.context.incarnation
            self.loop.call_soon(self.context.on_node_dead, node, msg.message, incarnation)
            return NodeLostError(
                node,
                f"this process was declared dead, so {self.info.node_id} refused the call ({msg.message})",
            )
        error = remote_error(msg, actor, method, self.info.node_id)
        if msg.code == "gone":  # the process we meant no longer listens there: all its calls are lost
            self.loop.call_soon(
                self.context.on_node_dead, self.info.node_id, msg.message, self.info.incarnation
            )
        return error

    # -- the link ---------------------------------------------------------------------------
    def watch_link(self) -> None:
        """Follow this connection in libzmq's events (``link_up``). ZeroMQ's
        heartbeats hold it up while the peer's process lives and the link holds, whatever the
        peer's event loop is doing, and drop it ``runtime.link_timeout_s`` after a PING went
        unanswered (a stopped process, a dead host, a cut link)."""
        if self._link is not None or self.lost is not None:
            return
        self.link_up = True  # called once an answer came over it: its handshake is behind it
        monitor = self.pump.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)

        def on_event(frames: list[Any]) -> None:
            event, _ = monitor_event(frames)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.link_up = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.link_up = False

        self._link = SocketPump(
            monitor, on_event, recheck_s=self.context.config.io_recheck_s, loop=self.loop, batch=False
        )

    # -- failure ----------------------------------------------------------------------------
    def mark_lost(self, error: NodeLostError) -> None:
        """Fail every pending call and stream with ``error``, refuse new ones, close the socket."""
        if self.lost is not None:
            return
        self.lost = error
        self.waiting.clear()  # queued calls fail below with the rest; none may be sent now
        if self._sweeper is not None:
            self._sweeper.cancel()
        for call_id in list(self.pending):
            pending = self._end(call_id)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(lost_again(error))
        for queue, _, _ in list(self.streams.values()):
            queue.put_nowait((_FAIL, lost_again(error)))
        if self._link is not None:  # the monitor first: it is a socket of the one it watches
            self._link.close()
        self.pump.close()

    def send_oneway(self, actor: str, method: str, args: list[Any]) -> None:
        if self.lost is None:
            self.pump.send(
                self.codec.encode(Call(0, actor, method, self.codec.lift(args), to=self.to)), copy=False
            )


def accept_calls_as_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Let ``loop.create_task`` (so ``asyncio.create_task`` and ``TaskGroup``) take a call's
    future as it takes a coroutine: the task awaits it. A call is a future, not a coroutine
    (``asyncio.wait`` and ``gather`` take it as it is), and ``Task`` accepts only coroutines.
    A task factory already set on the loop still makes every task."""
    previous = loop.get_task_factory()
    if getattr(previous, "accepts_calls", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if isinstance(coro, asyncio.Future):
            coro = _awaiting(coro)
        if previous is not None:
            return previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    factory.accepts_calls = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


async def _awaiting(future: asyncio.Future[Any]) -> Any:
    return await future
