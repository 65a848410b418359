"""``Node``: one process's share of the cluster: its actors, its sockets, its membership.

One node per process, all on one event loop. A node listens on one ROUTER socket for
calls to its actors (``server.Server``; ``listen.Listener`` owns the sockets) and keeps one
DEALER per peer for its own calls (``calls.Calls``). Calls between actors of the same node
skip sockets and serialisation. The server, the peers and the actor refs see the node only
through its ``context.NodeContext``, its actors through ``host.Host``, and the parts it is
made of (``calls``, ``joining``, ``children``) each through a protocol of what that part needs.

Start-up is a handshake: a node binds, joins the head (``join_timeout_s``), then
heartbeats (``joining.Roster``). Shutdown order (``stop``): stop the processes it supervises;
the head tells every node the cluster ends, any other node leaves the head; run each actor's
``on_stop``; cancel the calls still being served; fail this node's own pending calls; close
every socket with linger 0. ``stop`` is idempotent. ``exit_code`` says how it ended for its
process: 0, or 75 (``joining.EX_TEMPFAIL``) when the head declared it dead or it lost the head
(``runtime.worker`` rejoins).

What a peer can make a node spend is bounded by ``runtime.*`` (see ``server`` and
``transport.zmq_io``); who a peer is comes from the key it authenticated with (``caller.Caller``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from ..config import RuntimeConfig
from ..metrics.timings import Timings
from ..plugins import load as load_plugin
from ..transport import Codec
from ..transport.auth import AuthCounters, CurveKeys
from .actor import Actor
from .address import host_of, tcp_address
from .caller import Caller
from .calls import EXT_ACTOR_REF, Calls
from .children import Children
from .context import NodeContext
from .errors import (
    ActorNotFound,
    JoinError,
    NodeLostError,
    cancelled_from_outside,
    missing_secret,
    not_started,
)
from .joining import Roster
from .listen import Listener, export_metrics
from .membership import HEAD, Membership, NodeService, importing_script, membership_at, service_at
from .peer import accept_calls_as_tasks
from .ref import ActorRef, actor_info
from .server import Server
from .stall import unwatch as unwatch_stalls
from .stall import watch as watch_stalls
from .types import VERSION, ActorInfo, NodeInfo, NodeStats

if TYPE_CHECKING:  # prometheus-client is imported only where metrics are on (~75 ms)
    from ..metrics.exporter import Exporter

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Actor)


class Node:
    """Hosts actors in this process and reaches the actors of every other node.

    ``rank`` 0 is the head; other ranks join the head at ``head`` (its address). ``listen``
    is this node's address: ``ipc:///path`` or ``tcp://host:port`` (port 0 picks one).
    ``secret`` authenticates TCP peers (CURVE); it is required when any address is TCP.
    """

    def __init__(
        self,
        rank: int,
        listen: str,
        *,
        head: str | None = None,
        config: RuntimeConfig | None = None,
        secret: str | bytes | None = None,
        node_id: str | None = None,
        member: bool = True,
    ) -> None:
        self.rank = rank
        self.member = member  # False: a client that calls actors without joining (``rlasync status``)
        self.node_id = node_id or f"node-{rank}"  # a supervised child: "node-<rank>.<index>"
        if self.node_id != HEAD and head is None:
            raise ValueError(f"{self.node_id} needs the head's address (head=...); only node-0 is the head")
        # ZeroMQ spells "any free port" as "*"; accept the usual ":0" too.
        self.listen = listen[:-2] + ":*" if listen.startswith("tcp://") and listen.endswith(":0") else listen
        self.head_address = head
        self.config = config or RuntimeConfig()
        self._keys = CurveKeys.from_secret(secret) if secret else None
        self.codec = Codec(self.config.zero_copy_threshold, self.config.max_body_bytes)
        self.stats_ = NodeStats(self.node_id)
        self.auth = AuthCounters()
        self._actors: dict[str, Actor] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        # The parts of a node, each seeing it through a protocol of what that part needs:
        self._calls = Calls(self)  # where its calls go, and its connections to other processes
        self._roster = Roster(self, self._calls, self._tasks)  # its membership: joining, heartbeats
        self._children = Children(  # the processes it supervises (handed the secret as text)
            self,
            self._roster,
            self._calls,
            tasks=self._tasks,
            actors=self._actors,
            secret=secret.decode() if isinstance(secret, bytes) else secret,
        )
        self.codec.register(ActorRef, EXT_ACTOR_REF, Calls.ref_to_wire, self._calls.ref_from_wire)
        self._started = False
        self._stopping = False
        # Made by ``start`` (None until then, and after a start that failed before them):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Listener | None = None  # its sockets
        self._info: NodeInfo | None = None  # this process: its address, incarnation, key
        self._context: NodeContext | None = None  # what the peers, the server and the refs see of it
        self._server: Server | None = None
        self.exit_code = 0  # for the process: 75 (EX_TEMPFAIL) when fenced or cut off from the head
        self.nodes_exit_code = 0  # on the head: the exit code of the nodes it stops (EX_ENDED_EARLY)
        # On the head: called with each node that joins (a rejoining node is a new incarnation),
        # e.g. to place its roles on it again. Must not block.
        self.join_listeners: list[Any] = []
        self.stopped = asyncio.Event()
        self.address = ""
        self.metrics: Exporter | None = None  # /metrics (runtime.metrics_port), made by ``start``
        self._watching = False  # this node counts among its loop's watchdog's users (runtime.stall)
        self._round_trips: Timings | None = None  # answered calls' seconds (metrics on)

    @property
    def is_running(self) -> bool:
        """Started (joined, for a node other than the head) and not stopping."""
        return self._started and not self._stopping and self._roster.membership is not None

    @property
    def stopping(self) -> bool:
        """``stop`` has begun (or a start failed): no new actor, process or connection."""
        return self._stopping

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this node runs on (``start`` sets it)."""
        if self._loop is None:
            raise not_started(self.node_id)
        return self._loop

    @property
    def info(self) -> NodeInfo:
        """This process as the cluster knows it (``start`` makes it)."""
        if self._info is None:
            raise not_started(self.node_id)
        return self._info

    @property
    def context(self) -> NodeContext:
        """What this node's peers, server and actor refs see of it (``start`` makes it)."""
        if self._context is None:
            raise not_started(self.node_id)
        return self._context

    @property
    def membership(self) -> ActorRef:
        """A ref to the head's ``Membership``: who is in the cluster, where each named actor
        lives, and each node's status. ``start`` makes it."""
        return self._roster.head_ref()

    @property
    def is_head(self) -> bool:
        return self.node_id == HEAD

    def require_keys(self) -> CurveKeys:
        """This node's CURVE keys; ``ValueError`` (how to set a secret) without them."""
        if self._keys is None:
            raise missing_secret()
        return self._keys

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> Node:
        """Bind, join the head (or become it), start heartbeating. Returns self."""
        if self._started:
            return self
        script = importing_script()
        if script:  # a node importing the running script for its actor classes ran the script's work
            raise RuntimeError(
                f'{script} starts rlasync when imported: put its work under `if __name__ == "__main__":`'
            )
        self._started = True
        loop = self._loop = asyncio.get_running_loop()
        accept_calls_as_tasks(loop)
        watch_stalls(loop, self.config.loop_stall_warn_s)
        self._watching = True
        self._export_metrics(loop)  # first: a port in use fails the start before any socket
        for module in self.config.preload_modules:
            # Before joining, when nobody waits for our heartbeats: loading a large C
            # extension (torch) holds the GIL for seconds and would starve them later.
            # A user's plugin file (``plugins: [./x.py]``) is imported by its path.
            load_plugin(module)
        router = self._bind(loop)
        self._info = self._describe()
        self._serve(router)
        await self._enter()
        return self

    def _export_metrics(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``/metrics`` (``runtime.metrics_port``; None: off) with the runtime's families."""
        role = "head" if self.is_head else "child" if "." in self.node_id else "node"
        try:
            exporter = export_metrics(loop, self.config, self.node_id, role)
        except JoinError:
            self._stopping = True
            self.stopped.set()
            raise
        if exporter is not None:
            self._round_trips = Timings()
            exporter.add(self._metric_families)
            self.metrics = exporter

    def _bind(self, loop: asyncio.AbstractEventLoop) -> zmq.Socket[Any]:
        """Open this node's sockets and bind its ROUTER (``address``); a failed bind stops it."""
        listener = self._listener = Listener(self.listen, self.config, loop, self.auth)
        router = listener.router(self._keys)
        try:
            self.address = listener.bind(router, self.node_id, self.head_address)
        except JoinError:
            if self.metrics is not None:
                self.metrics.close()
            self._watching = False
            unwatch_stalls(loop)
            self._stopping = True
            self.stopped.set()
            raise
        return router

    def _describe(self) -> NodeInfo:
        """This process as the cluster will know it: bound, with its ``/metrics`` served."""
        metrics = self.metrics
        if metrics is not None and self.config.metrics_host in ("0.0.0.0", "::", ""):
            # Bound everywhere: others reach it at the node's own address.
            metrics.address = tcp_address(host_of(self.address), metrics.port).removeprefix("tcp://")
        return NodeInfo(
            self.node_id,
            self.address,
            uuid.uuid4().hex[:12],
            os.getpid(),
            socket.gethostname(),
            self._keys.identity if self._keys is not None else "",
            VERSION,
            metrics.address if metrics is not None else "",
        )

    def _serve(self, router: zmq.Socket[Any]) -> None:
        """Serve the calls that reach ``router``, through the context this node's parts see."""
        assert self._listener is not None
        context = self._context = NodeContext(
            node_id=self.node_id,
            incarnation=self.info.incarnation,
            loop=self.loop,
            config=self.config,
            codec=self.codec,
            stats=self.stats_,
            sockets=self._listener.sockets,
            keys=self._keys,
            actors=self._actors,
            dead_callers=self._roster.dead_callers,
            on_node_dead=self._roster.on_node_dead,
            call=self._calls.route,
            stream=functools.partial(self._calls.route, stream=True),
            tasks=self._tasks,
            round_trips=self._round_trips,
        )
        server = self._server = self._roster.server = Server(context, router)
        self._listener.serve(router, server)

    async def _enter(self) -> None:
        """Host this node's service; then host the membership (the head) or join it."""
        info, roster = self.info, self._roster
        roster.known[info.incarnation] = info
        roster.members[self.node_id] = info
        await self.spawn_here(NodeService, [], {}, "_node")
        if self.is_head:
            roster.membership = await self.spawn_here(Membership, [], {}, "_membership")
        else:
            roster.membership = membership_at(self, NodeInfo(HEAD, self.head_address or "", "unknown"))
            if self.member:
                await roster.join()
        roster.joined.set()  # the head; a node whose join reply is applied; a client (rlasync status)

    def _metric_families(self) -> list[Any]:
        """The runtime's families (``runtime.telemetry``), at a scrape."""
        from .telemetry import node_families

        now = self.loop.time()
        if self.is_head:
            membership = self._actors.get("_membership")
            seen = membership.last_seen if isinstance(membership, Membership) else {}
            heard = {node: max(time.monotonic() - t, 0.0) for node, t in seen.items()}
        else:
            heard = {HEAD: now - self._roster.heard} if self._roster.heard else {}
        assert self._round_trips is not None
        return node_families(
            self.stats(), in_flight=self._calls.in_flight(), round_trips=self._round_trips, heard_s=heard
        )

    # -- actors -----------------------------------------------------------------------------
    async def spawn(
        self, cls: type[A], *args: Any, node: int | str | None = None, name: str | None = None, **kwargs: Any
    ) -> A:
        """Start ``cls(*args, **kwargs)`` on ``node`` (a rank or node id; default: here).

        Returns an ``ActorRef`` whose endpoints type-check as ``cls``'s. The class must be
        importable on the target node (module level in an installed module, or the
        running script). ``name`` must be unique in the cluster; look it up from any node.
        """
        target = self.node_id if node is None else (f"node-{node}" if isinstance(node, int) else node)
        if name is not None and name.startswith("_"):
            raise ValueError(f"actor names starting with '_' belong to the runtime; rename {name!r}")
        name = name or f"{cls.__name__.lstrip('_') or 'Actor'}-{uuid.uuid4().hex[:8]}"
        if target == self.node_id:
            return await self.spawn_here(cls, list(args), kwargs, name)  # type: ignore[return-value]
        return await self._children.spawn_on(target, cls, list(args), kwargs, name)  # type: ignore[return-value]

    async def spawn_here(
        self, cls: type[Actor], args: list[Any], kwargs: dict[str, Any], name: str
    ) -> ActorRef:
        """Start an actor on this node and register its name with the head."""
        if self._stopping:
            raise RuntimeError(f"{self.node_id} is stopping; it spawns no more actors")
        if name in self._actors:
            raise ValueError(f"an actor named {name!r} already runs on {self.node_id}")
        actor = cls(*args, **kwargs)
        actor.node = self
        actor.name = name
        info = actor_info(name, cls, self.info)
        self._actors[name] = actor
        try:
            await actor.on_start()
            if not name.startswith("_"):
                await self.membership.register(info)
        except BaseException:
            del self._actors[name]
            raise
        self.stats_.actors = len(self._actors)
        return ActorRef(self, info, cls)

    async def lookup(self, name: str, cls: type[A] | None = None, *, timeout: float = 0.0) -> A:
        """A ref to the actor named ``name``, waiting up to ``timeout`` s for it to appear."""
        call = self.membership.lookup.options(timeout=timeout + self.config.call_timeout_s)
        info: ActorInfo = await call(name, timeout)
        return ActorRef(self, info, cls)  # type: ignore[return-value]

    async def members(self) -> list[NodeInfo]:
        """The live nodes, as the head knows them now."""
        members: list[NodeInfo] = await self.membership.members_list()
        return members

    async def start_child(self, *, preload: tuple[str, ...] = (), on: int | str | None = None) -> NodeInfo:
        """Start a node process that node ``on`` (default: this one) supervises; a trainer rank
        lives in one. It joins the cluster as ``<that node>.<k>``, dies with its parent process,
        and is stopped when its parent stops. ``preload``: modules it imports before joining
        (torch, say: see ``runtime.preload_modules``). Returns the child once it has joined
        (``runtime.join_timeout_s``)."""
        return await self._children.start_child(preload=preload, on=on)

    async def stop_nodes(self, node_ids: list[str]) -> None:
        """Ask other nodes to shut down and wait (``runtime.shutdown_timeout_s``) until they have
        left; their parents (for children) or launchers reap the processes."""
        await self._children.stop_nodes(node_ids)

    async def node_stats(self, node: int | str | None = None) -> NodeStats:
        """The counters of ``node`` (a rank or node id; default: this one)."""
        node_id = self.node_id if node is None else (f"node-{node}" if isinstance(node, int) else node)
        if node_id == self.node_id:
            return self.stats()
        info = self._roster.members.get(node_id)
        if info is None:
            raise NodeLostError(node_id, "not a live member of the cluster")
        stats: NodeStats = await service_at(self, info).stats()
        return stats

    async def until_joined(self) -> None:
        await self._roster.until_joined(self.config.join_timeout_s)

    def live_member(self, node_id: str) -> NodeInfo | None:
        """The live member ``node_id`` as this node last heard of it (None: not one); asks nobody."""
        return self._roster.members.get(node_id)

    def local_actor(self, name: str) -> Actor:
        """The actor named ``name`` on this node; ``ActorNotFound`` if none is."""
        actor = self._actors.get(name)
        if actor is None:
            raise ActorNotFound(f"no actor named {name!r} on {self.node_id}")
        return actor

    def stats(self) -> NodeStats:
        stats = self.stats_
        stats.handshakes_failed = self.auth.handshakes_failed
        stats.zap_denied = self.auth.zap_denied
        pumps = self._listener.pumps if self._listener is not None else []
        peers = self._calls.peers.values()
        stats.lost_wakeups = sum(p.rescued for p in pumps) + sum(p.pump.rescued for p in peers)
        stats.unroutable_replies = self._server.pump.unroutable if self._server is not None else 0
        stats.dropped_messages = sum(p.dropped for p in pumps) + sum(p.pump.dropped for p in peers)
        return stats

    # -- the membership's news and hooks ----------------------------------------------------------
    def tell_service(self, info: NodeInfo, method: str, args: list[Any]) -> None:
        """Send a one-way call to ``info``'s ``_node`` service (no reply, no wait)."""
        self._calls.tell_service(info, method, args)

    def set_members(self, epoch: int, members: list[NodeInfo]) -> None:
        """The head's membership changed (called by ``Membership`` on the head itself)."""
        self._roster.set_members(epoch, members)

    def on_node_dead(
        self, node_id: str, reason: str, incarnation: str | None = None, *, graceful: bool = False
    ) -> None:
        """Fail every call to that process of ``node_id`` and stop serving its calls (see
        ``joining.Roster.on_node_dead``). Safe to call repeatedly."""
        self._roster.on_node_dead(node_id, reason, incarnation, graceful=graceful)

    def connected(self, info: NodeInfo) -> bool:
        """Whether the process ``info`` describes has a connection to this node open now."""
        return self._server is not None and self._server.connected(info)

    def is_dead_caller(self, caller: Caller) -> bool:
        """Whether ``caller`` is a process the head declared dead (it is served no more)."""
        dead = self._roster.dead_callers
        return bool(dead) and (caller.key or caller.claim) in dead

    # -- stop -------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Start ``stop`` in the background (from inside a callback or an endpoint)."""
        if not self._stopping:
            self._tasks.append(self.loop.create_task(self.stop()))

    async def stop(self) -> None:
        """Stop this node in the documented order. Idempotent; safe after a failed start."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        timeout = self.config.shutdown_timeout_s
        try:
            await self._stop_politely(timeout)
        finally:  # whatever happened above (even cancellation), the sockets close and waiters wake
            self._calls.close()
            if self._listener is not None:
                self._listener.close()
            if self.metrics is not None:
                self.metrics.close()
            if self._watching:
                self._watching = False
                unwatch_stalls(self.loop)
            self._actors.clear()
            self.stopped.set()

    async def _stop_politely(self, timeout: float) -> None:
        roster = self._roster
        await self._children.stop_children(timeout)
        if self.is_head and roster.membership is not None:
            await self._children.end_cluster(min(timeout, 2.0))
        if not self.is_head:
            await roster.leave(min(timeout, 1.0))
        for name, actor in reversed(list(self._actors.items())):
            try:
                async with asyncio.timeout(timeout):
                    await actor.on_stop()
            except (Exception, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise  # stop() itself is being cancelled: the finally above still closes
                log.exception("on_stop of actor %s failed", name)
        if self._server is not None:
            await self._server.stop(timeout)

    def on_cluster_end(self, code: int = 0) -> None:
        """The head stops the cluster: stop too, with the head's ``code`` (not 75: no rejoining)."""
        self.exit_code = code
        self.request_stop()

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def rank_of(node_id: str) -> int:
    """The rank of the node a node id belongs to: ``node-2`` -> 2, its child ``node-2.0`` -> 2."""
    return int(node_id.removeprefix("node-").split(".", 1)[0])
