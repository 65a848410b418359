"""``NodeContext``: what the parts of a node need of it, and nothing more.

A ``Node`` owns its actors, sockets and membership. The parts it is built of (``peer.Peer``
for its calls out, ``server.Server`` for the calls it serves) and the refs it hands out
(``ref.ActorRef``) get this context instead of the node: the event loop, codec, config and
counters, which process this is, the actors it hosts, the processes declared dead, and the
node's hooks for what only it decides (a peer's process is gone; where a call goes). The node
builds its context when it starts, once all of that exists, and the context never changes
after; only the node changes what its collections hold.

Messages that carry a tensor wait here while torch is imported (``defer_until_torch``): the
peers and the server share that wait, so that messages are handled in the order they came.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Set
from typing import Any, Protocol

import zmq

from ..config import RuntimeConfig
from ..metrics.timings import Timings
from ..transport import Codec
from ..transport.auth import CurveKeys
from .actor import Actor
from .errors import missing_secret
from .types import ActorInfo, NodeStats

log = logging.getLogger(__name__)

Convert = Callable[[Any], Any] | None
"""Turns a decoded result into the endpoint's annotated return type (None: as it came)."""

CallRoute = Callable[[ActorInfo, str, list[Any], dict[str, Any], float | None, Convert], asyncio.Future[Any]]
"""Sends a unary call: ``(actor, method, args, kwargs, timeout, convert)`` -> its answer."""

StreamRoute = Callable[[ActorInfo, str, list[Any], dict[str, Any], float | None, Convert], AsyncIterator[Any]]
"""Opens a streaming call: ``(actor, method, args, kwargs, timeout, convert)`` -> its items."""

Handler = Callable[[list[Any]], None]
"""Handles one incoming message (its frames)."""


class NodeContext:
    """One started node, as its peers, its server and its actor refs see it.

    ``node_id`` and ``incarnation`` name this process; ``loop``, ``codec``, ``config`` and
    ``stats`` (the node's counters) are the node's own; ``sockets`` is its ZeroMQ context and
    ``keys`` its CURVE keys (None without a cluster secret). ``actors`` are the actors it
    hosts, by name, and ``dead_callers`` the keys (TCP) and claims (ipc) of the processes the
    head declared dead: both read-only here, kept current by the node. The hooks:
    ``on_node_dead(node_id, reason, incarnation)`` says that process is gone (its calls fail),
    ``call`` and ``stream`` send a call wherever the actor lives (this node included).
    ``round_trips``: where answered calls' seconds go when metrics are on.
    """

    __slots__ = (
        "node_id",
        "incarnation",
        "loop",
        "config",
        "codec",
        "stats",
        "sockets",
        "keys",
        "actors",
        "dead_callers",
        "on_node_dead",
        "call",
        "stream",
        "deferred",
        "round_trips",
        "_tasks",
    )

    def __init__(
        self,
        *,
        node_id: str,
        incarnation: str,
        loop: asyncio.AbstractEventLoop,
        config: RuntimeConfig,
        codec: Codec,
        stats: NodeStats,
        sockets: zmq.Context[Any],
        keys: CurveKeys | None,
        actors: Mapping[str, Actor],
        dead_callers: Set[str],
        on_node_dead: Callable[[str, str, str | None], None],
        call: CallRoute,
        stream: StreamRoute,
        tasks: list[asyncio.Task[Any]],
        round_trips: Timings | None = None,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.loop = loop
        self.config = config
        self.codec = codec
        self.stats = stats
        self.sockets = sockets
        self.keys = keys
        self.actors = actors
        self.dead_callers = dead_callers
        self.on_node_dead = on_node_dead
        self.call = call
        self.stream = stream
        # Messages waiting for torch to load, in the order they came (None: none wait).
        self.deferred: list[tuple[Handler, list[Any]]] | None = None
        self._tasks = tasks  # the node's background tasks, cancelled when it stops
        # Round trips of unary calls, observed as they are answered (None: metrics are off).
        self.round_trips = round_trips

    def require_keys(self) -> CurveKeys:
        """This node's CURVE keys; ``ValueError`` (how to set a secret) without them."""
        if self.keys is None:
            raise missing_secret()
        return self.keys

    def defer_until_torch(self, handler: Handler, frames: list[Any]) -> None:
        """Hold ``frames`` (they carry a tensor) and every later message until torch is
        imported, in a thread: importing it takes seconds that the loop (heartbeats) cannot
        spare. Then hand them to their handlers in the order they came."""
        self.stats.held_for_torch += 1
        if self.deferred is not None:
            self.deferred.append((handler, frames))
            return
        self.deferred = [(handler, frames)]

        async def load() -> None:
            try:
                await asyncio.to_thread(importlib.import_module, "torch")
            except ImportError as exc:  # without torch, a tensor cannot be decoded here: drop them
                log.error(
                    "messages carry tensors and torch cannot be imported on %s (%s): %d dropped",
                    self.node_id,
                    exc,
                    len(self.deferred or []),
                )
                self.stats.malformed_frames += len(self.deferred or [])
                self.deferred = None
                return
            waiting, self.deferred = self.deferred or [], None
            for handle, held in waiting:  # torch is loaded now: none of them is held again
                try:
                    handle(held)
                except Exception:
                    log.exception("message handler failed; message dropped")

        self._tasks.append(self.loop.create_task(load(), name="rlasync-import-torch"))


class HasContext(Protocol):
    """What hands out a ``NodeContext``: a started ``Node``."""

    @property
    def context(self) -> NodeContext: ...


class NodeView(HasContext, Protocol):
    """A node as each part it is made of (``calls``, ``joining``, ``children``) sees it at the
    least: which node it is, its settings, its loop and context, and whether it is stopping
    (it starts nothing new then). Each part's protocol adds what that part needs besides."""

    node_id: str
    config: RuntimeConfig

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def stopping(self) -> bool: ...
