"""ZeroMQ sockets driven by an asyncio event loop without ``zmq.asyncio``.

Awaiting every message on ``zmq.asyncio`` reached 8-13k messages/s on our machines;
draining a socket in batches from the loop's reader callback reached 50-64k/s, about what
synchronous pyzmq does (``shared/reference/transport_measurements.md``). ``SocketPump`` does
the latter.

The hazard of that design: ZeroMQ's file descriptor is edge-triggered and any socket
operation (a send included) may consume the edge, so a reader that trusts the descriptor
alone can sleep for ever with messages queued. The pump closes that hole three ways:
it drains until ``EAGAIN``; after each send it re-reads ``zmq.EVENTS`` and schedules a drain
if input is waiting; and a timer re-checks every ``io_recheck_s`` and counts each wake-up
it had to rescue (``rescued``), which should stay 0.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable

import zmq

log = logging.getLogger(__name__)

# Messages handled per reader callback before yielding to other ready callbacks.
_BATCH = 512


class SocketPump:
    """Owns one ZeroMQ socket on one event loop: reads in batches, sends without blocking.

    ``on_message(frames)`` runs synchronously inside the drain and must not block: it
    resolves futures or starts tasks. Sends never block the loop either: if ZeroMQ's queue
    is full the frames wait in an outbox, flushed when the socket becomes writable again.
    """

    def __init__(
        self,
        sock: zmq.Socket,  # type: ignore[type-arg]
        on_message: Callable[[list[Any]], None],
        *,
        recheck_s: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop or asyncio.get_running_loop()
        self.rescued = 0  # wake-ups the safety timer found lost
        self.outbox: collections.deque[tuple[list[Any], bool]] = collections.deque()
        self._closed = False
        self._drain_scheduled = False
        self._check_scheduled = False
        self._fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._drain)
        self._timer: asyncio.TimerHandle | None = None
        self._recheck_s = recheck_s
        if recheck_s is not None:
            self._timer = self.loop.call_later(recheck_s, self._recheck)
        # A message may already be queued (the edge fired before we registered).
        self._schedule_drain()

    # -- input ----------------------------------------------------------------------------
    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self.sock
        if self.outbox:
            self._flush()
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if self._closed or exc.errno == zmq.ENOTSOCK:
                    return
                raise
            try:
                self.on_message(frames)
            except Exception:  # a handler bug must not kill the pump
                log.exception("message handler failed; message dropped")
        # Batch full: the socket may still hold messages and no new edge will come for them.
        self._schedule_drain()

    def _recheck(self) -> None:
        if self._closed:
            return
        try:
            events = self.sock.getsockopt(zmq.EVENTS)
        except zmq.ZMQError:
            return
        if events & zmq.POLLIN and not self._drain_scheduled and not self._check_scheduled:
            self.rescued += 1
            log.debug("socket had input with no wake-up; drained by the safety timer")
            self._drain()
        elif self.outbox and events & zmq.POLLOUT:
            self._flush()
        assert self._recheck_s is not None
        self._timer = self.loop.call_later(self._recheck_s, self._recheck)

    # -- output ---------------------------------------------------------------------------
    def send(self, frames: list[Any], copy: bool = True) -> None:
        """Queue ``frames`` as one message. Raises ``zmq.ZMQError`` for an unroutable peer."""
        if self._closed:
            return
        if self.outbox:
            self.outbox.append((frames, copy))  # keep order behind what is already waiting
            return
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.outbox.append((frames, copy))
        # A send can consume the descriptor's edge: look for input it may have hidden, once
        # per loop iteration however many messages this iteration sends.
        if not self._check_scheduled:
            self._check_scheduled = True
            self.loop.call_soon(self._check_after_send)

    def _check_after_send(self) -> None:
        self._check_scheduled = False
        if self._closed or self._drain_scheduled:
            return
        try:
            events = self.sock.getsockopt(zmq.EVENTS)
        except zmq.ZMQError:
            return
        if events & zmq.POLLIN:
            self._drain()
        elif self.outbox and events & zmq.POLLOUT:
            self._flush()

    def _flush(self) -> None:
        sock = self.sock
        while self.outbox:
            frames, copy = self.outbox[0]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): the reply has no reader
                log.debug("dropping queued message: %s", exc)
            self.outbox.popleft()

    def close(self) -> None:
        """Stop reading and close the socket at once (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        try:
            self.loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):  # loop already closed
            pass
        self.sock.close(linger=0)
