"""ZeroMQ sockets driven by an asyncio event loop without ``zmq.asyncio``.

Awaiting every message on ``zmq.asyncio`` reaches 8-13k messages/s on 2 cores; draining a
socket in batches from the loop's reader callback reaches 50-64k/s, about what synchronous
pyzmq does. ``SocketPump`` does the latter, and goes one step further on output: the small messages one loop iteration
sends to one destination leave as a single ZeroMQ frame (a *batch*: byte 0, then a msgpack
list of message bodies), so a burst of calls or replies costs one ZeroMQ send and one
receive instead of one per message. Messages with side frames, and large ones, go alone,
after whatever was batched before them, so order is kept.

The hazard of the drain design: ZeroMQ's file descriptor is edge-triggered and any socket
operation (a send included) may consume the edge, so a reader that trusts the descriptor
alone can sleep for ever with messages queued. The pump closes that hole three ways:
it drains until ``EAGAIN``; after each flush of output it re-reads ``zmq.EVENTS`` and drains
if input is waiting; and a timer re-checks every ``io_recheck_s`` and counts each wake-up
it had to rescue (``rescued``), which should stay 0.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

BATCH_MARK = b"\x00"  # first byte of a batch frame; message kinds start at 1
_BATCH_MAX_BODY = 16384  # bodies at least this large go alone (copying them into a batch costs more)
_BATCH_MAX_COUNT = 256  # bodies per batch: at most 4 MiB, far below runtime.max_body_bytes
_DRAIN_LIMIT = 512  # ZeroMQ messages handled per reader callback before yielding to the loop
_DRAIN_BYTES = 32 * 2**20  # ... and bodies decoded per callback (decoding holds the loop)
_OUTBOX_LIMIT = 100_000  # messages waiting for one destination before the oldest are dropped
_OUTBOX_BYTES = 512 * 2**20  # bytes waiting for all destinations (runtime.max_outbox_bytes)
# pyzmq's constants are enums: passing and combining them builds enum objects on every call
# (measured 2.7 against 1.4 us for one EVENTS check, several per call). Plain ints here.
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)
# pyzmq types every getsockopt as ``int | bytes``; EVENTS and FD are ints. The drain loop calls it
# per message, so the few reads below say so to the type checker instead of converting at run time.


# Liveness comes from ZeroMQ's own heartbeats (ZMTP PING/PONG), which libzmq's I/O threads send
# and answer whatever the process's Python does: an event loop blocked for a minute keeps its
# connections, while a stopped process, a dead host or a cut link loses them within the timeout
# (the membership then declares the node dead). libzmq resets the timeout only between whole
# frames (libzmq #2709), so one frame must cross the link within it; the application heartbeats
# this replaces had the same bound (they queued behind that frame).
def keep_alive(sock: zmq.Socket, interval_s: float, timeout_s: float) -> None:
    """PING the peer every ``interval_s``; drop the connection when nothing arrives within
    ``timeout_s`` of a PING (and ask the peer to do the same: the TTL)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(int(interval_s * 1000), 1))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(int(timeout_s * 1000), 1))
    # The TTL travels in deciseconds, at most 6553.5 s; 0 would turn it off.
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(max(int(timeout_s * 1000), 100), 6_553_500))


class SocketPump:
    """Owns one ZeroMQ socket on one event loop: reads in batches, sends without blocking.

    ``on_message(frames)`` runs synchronously inside the drain and must not block: it
    resolves futures or starts tasks. ``routed`` means a ROUTER socket: every message
    starts with the peer's identity frame. ``batch=False`` turns batching off both ways
    (for ZAP and monitor sockets, whose frames are not ours). ``peers`` and ``new_peer``
    (ROUTER only): the first message from a routing id not in ``peers`` calls
    ``new_peer(routing_id, frame)`` with ZeroMQ's frame, whose metadata says who sent it
    (``User-Id``, the connection's descriptor) before ``on_message`` sees the message.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        on_message: Callable[[list[Any]], None],
        *,
        recheck_s: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
        routed: bool = False,
        batch: bool = True,
        peers: dict[bytes, Any] | None = None,
        new_peer: Callable[[bytes, zmq.Frame], None] | None = None,
        max_outbox_bytes: int = _OUTBOX_BYTES,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop or asyncio.get_running_loop()
        self.routed = routed
        self.batch = batch
        self.rescued = 0  # wake-ups the safety timer found lost while the loop ran on time
        self.unroutable = 0  # messages ZeroMQ refused for an unknown peer (a ROUTER's caller is gone)
        # Messages ZeroMQ could not take yet (its queue to that peer is full), per destination:
        # one peer that stops reading must not hold up the replies owed to the others.
        self._outboxes: dict[Any, collections.deque[tuple[list[Any], bool]]] = {}
        self.dropped = 0  # messages dropped because the outboxes passed their limits
        self._outbox_bytes = 0
        self._max_outbox_bytes = max_outbox_bytes
        self._peers = peers
        self.max_batch_bytes = 2**62  # batches past this are refused like an oversized body
        self._new_peer = new_peer
        self._batches: dict[Any, list[Any]] = {}  # destination -> bodies waiting for the flush
        self._batch_encoder = msgspec.msgpack.Encoder()
        self._batch_decoder = msgspec.msgpack.Decoder(list[bytes])
        self._closed = False
        self._drain_scheduled = False
        self._flush_scheduled = False
        self._fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        self.loop.add_reader(self._fd, self._drain)
        self._timer: asyncio.TimerHandle | None = None
        self._recheck_s = recheck_s
        self._last_drain = self._last_send = 0.0  # loop times, for the rescue diagnostics
        if recheck_s is not None:
            self._arm_recheck()
        # A message may already be queued (the edge fired before we registered).
        self._schedule_drain()

    # -- input ----------------------------------------------------------------------------
    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._last_drain = self.loop.time()
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self.sock
        if self._outboxes:
            self._flush_outbox()
        body_at = 1 if self.routed else 0
        peers = self._peers
        budget = _DRAIN_BYTES
        for handled in range(_DRAIN_LIMIT):
            try:
                # Most wake-ups find zero or one message: asking ZeroMQ first spares the EAGAIN
                # exception that would end them (measured on the round-trip path). Long drains
                # skip the question and stop at EAGAIN instead (measured on the pipelined path).
                if handled < 2 and not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                    return
                # Part by part as Frames, each copied out once (a large tensor is still decoded
                # without a second copy): measured 1.3 us per message against recv_multipart's
                # 2.0, which asks ZeroMQ for RCVMORE after every part. The first part's metadata
                # names the sender (on a ROUTER, the first part is its routing id).
                first = sock.recv(_NOBLOCK, copy=False)
                frames = [first.bytes]
                part = first
                while part.more:
                    part = sock.recv(_NOBLOCK, copy=False)
                    frames.append(part.bytes)
                if peers is not None and frames[0] not in peers and self._new_peer is not None:
                    self._new_peer(frames[0], first)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if self._closed or exc.errno == zmq.ENOTSOCK:
                    return
                raise
            if len(frames) > body_at:
                budget -= len(frames[body_at])
            try:
                if self.batch and len(frames) == body_at + 1 and frames[body_at][:1] == BATCH_MARK:
                    self._unbatch(frames, body_at)
                else:
                    self.on_message(frames)
            except Exception:  # a handler bug must not kill the pump
                log.exception("message handler failed; message dropped")
            if budget <= 0:
                break
        # Limit reached: the socket may still hold messages and no new edge will come for them.
        self._schedule_drain()

    def _unbatch(self, frames: list[Any], body_at: int) -> None:
        if len(frames[body_at]) > self.max_batch_bytes:  # ours never are: let the handler count it
            self.on_message(frames)
            return
        try:
            bodies = self._batch_decoder.decode(memoryview(frames[body_at])[1:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.on_message(frames)  # not a batch after all: let the handler count it as malformed
            return
        for body in bodies:  # one bad message must not take the rest of its batch with it
            try:
                self.on_message([frames[0], body] if self.routed else [body])
            except Exception:
                log.exception("message handler failed; message dropped")

    def _arm_recheck(self) -> None:
        assert self._recheck_s is not None
        self._timer = self.loop.call_later(self._recheck_s, self._recheck)

    def _recheck(self) -> None:
        if self._closed:
            return
        try:
            # Asked first, because reading ZMQ_EVENTS below takes the signal: is the descriptor
            # still signalled, so that the loop will (or in this very iteration does) call the reader?
            signalled = bool(select.select((self._fd,), (), (), 0)[0])
            events: int = self.sock.getsockopt(_EVENTS)  # type: ignore[assignment]
            if events & _POLLIN and not self._drain_scheduled and not self._flush_scheduled:
                if not signalled:
                    # Input waits and nothing will wake the reader for it: some socket operation
                    # took the edge without draining. (An arrival in the microseconds between the
                    # two questions above looks the same; that is the count's only false alarm.)
                    self.rescued += 1
                    now = self.loop.time()
                    log.info(
                        "lost wake-up rescued by the safety timer (router=%s, last drain %.1f ms ago, last send %.1f ms ago)",
                        self.routed,
                        (now - self._last_drain) * 1e3,
                        (now - self._last_send) * 1e3,
                    )
                # Either way our read of ZMQ_EVENTS has taken the signal: drain here.
                self._schedule_drain()
            elif self._outboxes:  # even without POLLOUT: sends to a vanished peer fail fast and free memory
                self._flush_outbox()
                self._schedule_drain()  # the flush may have consumed an input edge
        except Exception:  # the safety net itself must never stop
            log.exception("socket re-check failed")
        finally:
            if not self._closed and self._recheck_s is not None:
                self._arm_recheck()

    # -- output ---------------------------------------------------------------------------
    def send(self, frames: list[Any], copy: bool = True) -> None:
        """Send ``frames`` as one message (``[identity, ...]`` on a ROUTER), in order, never blocking.

        Small single-body messages wait for the end of this loop iteration and leave in one
        batch per destination; a message for a peer that is gone is dropped and counted.
        """
        if self._closed:
            return
        body_at = 1 if self.routed else 0
        if self.batch and len(frames) == body_at + 1 and len(frames[body_at]) < _BATCH_MAX_BODY:
            if not self._flush_scheduled:
                # The first message of an iteration leaves at once (latency); the ones that
                # follow it in the same iteration are batched (throughput).
                self._send_now(frames, copy)
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
                return
            dest = frames[0] if self.routed else None
            queued = self._batches.get(dest)
            if queued is None:
                self._batches[dest] = [frames[body_at]]
            else:
                queued.append(frames[body_at])
                if len(queued) >= _BATCH_MAX_COUNT:  # a batch stays far below any receiver's body limit
                    frame = self._batch_frame(self._batches.pop(dest))
                    self._send_now([dest, frame] if self.routed else [frame], True)
            return
        if self._batches:
            self._flush_batches()  # what was batched before this message leaves before it
        self._send_now(frames, copy)
        if not self._flush_scheduled:  # still re-check input once this iteration is over
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        if self._batches:
            self._flush_batches()
        # A send can consume the descriptor's edge: look for input it may have hidden, and
        # for room to flush the outbox (reading EVENTS consumes the edge that would say so).
        if not self._drain_scheduled:
            try:
                events: int = self.sock.getsockopt(_EVENTS)  # type: ignore[assignment]
            except zmq.ZMQError:
                return
            if self._outboxes and events & _POLLOUT:
                self._flush_outbox()
                self._schedule_drain()
            elif events & _POLLIN:
                self._drain()

    def _flush_batches(self) -> None:
        batches, self._batches = self._batches, {}
        for dest, bodies in batches.items():
            frame = self._batch_frame(bodies)
            self._send_now([dest, frame] if self.routed else [frame], True)

    def _batch_frame(self, bodies: list[Any]) -> Any:
        if len(bodies) == 1:
            return bodies[0]
        frame = bytearray(BATCH_MARK)
        self._batch_encoder.encode_into(bodies, frame, 1)
        return frame

    def _send_now(self, frames: list[Any], copy: bool) -> None:
        dest = frames[0] if self.routed else None
        waiting = self._outboxes.get(dest)
        if waiting is not None:  # keep order behind what already waits for this destination
            self._park(dest, waiting, frames, copy)
            return
        self._last_send = self.loop.time()
        try:
            self.sock.send_multipart(frames, _NOBLOCK, copy=copy)
        except zmq.Again:
            self._park(dest, self._outboxes.setdefault(dest, collections.deque()), frames, copy)
        except zmq.ZMQError as exc:  # EHOSTUNREACH (ROUTER_MANDATORY): the peer is gone
            self.unroutable += 1
            log.debug("dropping message for a peer that is gone: %s", exc)

    def _park(
        self, dest: Any, waiting: collections.deque[tuple[list[Any], bool]], frames: list[Any], copy: bool
    ) -> None:
        size = _size(frames)
        # A peer that reads nothing while this much piles up is stuck (or asks for more than it
        # reads: forged stream credit): its oldest messages go, never the process's memory.
        while waiting and (
            len(waiting) >= _OUTBOX_LIMIT or self._outbox_bytes + size > self._max_outbox_bytes
        ):
            self._outbox_bytes -= _size(waiting.popleft()[0])
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.error("peer %r reads too slowly: dropped %d queued messages", dest, self.dropped)
        if (
            self._outbox_bytes + size > self._max_outbox_bytes
        ):  # other peers hold the room: this one waits no more
            self.dropped += 1
            if not waiting:
                del self._outboxes[dest]
            return
        self._outbox_bytes += size
        waiting.append((frames, copy))

    def _flush_outbox(self) -> None:
        sock = self.sock
        for dest, waiting in list(self._outboxes.items()):
            while waiting:
                frames, copy = waiting[0]
                try:
                    sock.send_multipart(frames, _NOBLOCK, copy=copy)
                except zmq.Again:
                    break  # this peer is still full; the others go on
                except zmq.ZMQError as exc:
                    self.unroutable += 1
                    log.debug("dropping queued message: %s", exc)
                self._outbox_bytes -= _size(frames)
                waiting.popleft()
            if not waiting:
                del self._outboxes[dest]

    @property
    def outbox_bytes(self) -> int:
        """Bytes waiting for peers that read too slowly."""
        return self._outbox_bytes

    def close(self) -> None:
        """Stop reading and close the socket at once (linger 0). Idempotent.

        Messages still batched for this iteration are handed to ZeroMQ first, but with linger
        0 it may drop what it has not written yet: whatever must arrive (a node leaving the
        cluster) is a call whose answer is awaited before closing.
        """
        if self._closed:
            return
        if self._batches:
            self._flush_batches()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        try:
            self.loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):  # loop already closed
            pass
        self.sock.close(linger=0)


def _size(frames: list[Any]) -> int:
    """Bytes in a message's frames (bytes, bytearray, memoryview or numpy arrays)."""
    return sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)
