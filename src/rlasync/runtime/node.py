"""``Node``: one process's share of the cluster: its actors, its sockets, its membership.

One node per process, all on one event loop. A node listens on one ROUTER socket for
calls to its actors (``server.Server``) and keeps one DEALER per peer for its own calls
(``peer.Peer``). Calls between actors of the same node skip sockets and serialisation.
The server, the peers and the actor refs see the node only through its ``context.NodeContext``.

Start-up is a handshake: a node binds, joins the head (``join_timeout_s``), then
heartbeats. Shutdown order (``stop``): stop the processes it supervises; the head tells every
node the cluster ends, any other node leaves the head; run each actor's ``on_stop``; cancel
the calls still being served; fail this node's own pending calls; close every socket with
linger 0. ``stop`` is idempotent. ``exit_code`` says how it ended for its process: 0, or 75
(EX_TEMPFAIL) when the head declared it dead or it lost the head (``runtime.worker`` rejoins).

What a peer can make a node spend is bounded by ``runtime.*`` (see ``server`` and
``transport.zmq_io``); who a peer is comes from the key it authenticated with (``server.Caller``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from .. import plugins
from ..config import RuntimeConfig
from ..metrics.timings import Timings
from ..transport import Codec
from ..transport.auth import ZAP_ENDPOINT, AuthCounters, CurveKeys, monitor_events
from ..transport.zmq_io import SocketPump, keep_alive
from . import stall
from .actor import Actor, endpoints_of
from .address import advertised, child_address, host_of, tcp_address
from .context import NodeContext
from .errors import (
    ActorNotFound,
    CallTimeout,
    JoinError,
    NodeLostError,
    NotAnEndpoint,
    RuntimeErrorBase,
    actor_error,
    cancelled_from_outside,
    missing_secret,
    not_started,
)
from .membership import SCRIPT_MODULE, Membership, NodeService, importing_script
from .peer import CallTask, Peer, accept_calls_as_tasks
from .ref import ActorRef
from .server import Caller, Server, current_caller
from .types import VERSION, ActorInfo, JoinReply, NodeInfo, NodeStats, SpawnSpec, process_claim

if TYPE_CHECKING:  # prometheus-client is imported only where metrics are on (~75 ms)
    from ..metrics.exporter import Exporter

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Actor)
EXT_ACTOR_REF = 16
HEAD_ID = "node-0"


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
        if self.node_id != HEAD_ID and head is None:
            raise ValueError(f"{self.node_id} needs the head's address (head=...); only node-0 is the head")
        # ZeroMQ spells "any free port" as "*"; accept the usual ":0" too.
        self.listen = listen[:-2] + ":*" if listen.startswith("tcp://") and listen.endswith(":0") else listen
        self.head_address = head
        self.config = config or RuntimeConfig()
        self._keys = CurveKeys.from_secret(secret) if secret else None
        self._secret = secret.decode() if isinstance(secret, bytes) else secret  # handed to child processes
        self.codec = Codec(self.config.zero_copy_threshold, self.config.max_body_bytes)
        self.codec.register(ActorRef, EXT_ACTOR_REF, self._ref_to_wire, self._ref_from_wire)
        self.stats_ = NodeStats(self.node_id)
        self.auth = AuthCounters()
        self._actors: dict[str, Actor] = {}
        self._peers: dict[str, Peer] = {}  # by incarnation: one connection per process
        self._dead: dict[str, str] = {}  # node id -> reason, for ranks with no live process
        self._dead_incarnations: dict[str, str] = {}  # process (incarnation) -> why it is dead
        self._left: set[str] = set()  # processes (incarnations) that shut down cleanly
        self._members: dict[str, NodeInfo] = {}
        self._epoch = -1
        self._pumps: list[SocketPump] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._children: dict[str, asyncio.subprocess.Process] = {}  # node processes this one supervises
        self._child_count = 0
        self._started = False
        self._stopping = False
        self._fenced = False  # the head declared this process dead: it must not speak for its rank
        self._known: dict[str, NodeInfo] = {}  # every process heard of, live or dead, by incarnation
        self._dead_callers: set[str] = set()  # keys (TCP) and claims (ipc) of processes declared dead
        # Made by ``start`` (None until then, and after a start that failed before them):
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ctx: zmq.Context[Any] | None = None  # this process's ZeroMQ context
        self._info: NodeInfo | None = None  # this process: its address, incarnation, key
        self._context: NodeContext | None = None  # what the peers, the server and the refs see of it
        self._server: Server | None = None
        self._membership: ActorRef | None = None  # the head's Membership (a local actor on the head)
        self.exit_code = 0  # for the process: 75 (EX_TEMPFAIL) when fenced or cut off from the head
        # On the head: called with each node that joins (a rejoining node is a new incarnation),
        # e.g. to place its roles on it again. Must not block.
        self.join_listeners: list[Any] = []
        self.stopped = asyncio.Event()
        self.address = ""
        self.metrics: Exporter | None = None  # /metrics (runtime.metrics_port), made by ``start``
        self._heard = 0.0  # loop time of the head's last answer to a heartbeat (other nodes)
        self._watching = False  # this node counts among its loop's watchdog's users (runtime.stall)
        self._round_trips: Timings | None = None  # answered calls' seconds (metrics on)

    @property
    def is_running(self) -> bool:
        """Started (joined, for a node other than the head) and not stopping."""
        return self._started and not self._stopping and self._membership is not None

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
        """A ref to the head's ``Membership`` (``_membership``): who is in the cluster, where each
        named actor lives, and each node's status. ``start`` makes it."""
        if self._membership is None:
            raise not_started(self.node_id)
        return self._membership

    @property
    def is_head(self) -> bool:
        return self.node_id == HEAD_ID

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
        stall.watch(loop, self.config.loop_stall_warn_s)
        self._watching = True
        metrics = self._export_metrics(loop)  # first: a port in use fails the start before any socket
        for module in self.config.preload_modules:
            # Before joining, when nobody waits for our heartbeats: loading a large C
            # extension (torch) holds the GIL for seconds and would starve them later.
            # A user's plugin file (``plugins: [./x.py]``) is imported by its path.
            plugins.load(module)
        sockets = self.ctx = zmq.Context()
        router = sockets.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        # No ROUTER_HANDOVER: a connection's routing id is never handed to another connection
        # (with it, a peer reusing a member's id took that member's replies, and libzmq aborted).
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(self.config.handshake_timeout_s * 1000))
        if self.listen.startswith("tcp://["):  # IPv6 (and "[::]", both families); not for IPv4, whose
            router.setsockopt(zmq.IPV6, 1)  # endpoint would then read back as [::ffff:a.b.c.d]
        keep_alive(router, self.config.heartbeat_interval_s, self.config.link_timeout_s)
        keys = self.require_keys() if self.listen.startswith("tcp://") else self._keys
        if self.listen.startswith("tcp://"):
            self._secure(sockets, router)
            _raise_descriptor_limit(self.config.max_connections)
        elif self.listen.startswith("ipc://"):
            _private_ipc_folder(self.listen)
        try:
            router.bind(self.listen)
        except zmq.ZMQError as exc:
            # The pumps first (the ZAP socket's is on the loop): a context destroyed under a
            # socket a pump still polls makes libzmq abort the process.
            for pump in self._pumps:
                pump.close()
            self._pumps.clear()
            router.close(linger=0)
            sockets.destroy(linger=0)
            if self.metrics is not None:
                self.metrics.close()
            self._watching = False
            stall.unwatch(loop)
            self._stopping = True
            self.stopped.set()
            raise JoinError(f"{self.node_id} cannot listen on {self.listen}: {exc}") from None
        if self.listen.startswith("ipc://"):
            os.chmod(self.listen.removeprefix("ipc://"), 0o600)
        self.address = advertised(router.getsockopt_string(zmq.LAST_ENDPOINT), self.head_address)
        key = keys.identity if keys is not None else ""
        if metrics is not None and self.config.metrics_host in ("0.0.0.0", "::", ""):
            # Bound everywhere: others reach it at the node's own address.
            metrics.address = tcp_address(host_of(self.address), metrics.port).removeprefix("tcp://")
        info = self._info = NodeInfo(
            self.node_id,
            self.address,
            uuid.uuid4().hex[:12],
            os.getpid(),
            socket.gethostname(),
            key,
            VERSION,
            metrics.address if metrics is not None else "",
        )
        context = self._context = NodeContext(
            node_id=self.node_id,
            incarnation=info.incarnation,
            loop=loop,
            config=self.config,
            codec=self.codec,
            stats=self.stats_,
            sockets=sockets,
            keys=self._keys,
            actors=self._actors,
            dead_callers=self._dead_callers,
            on_node_dead=self.on_node_dead,
            call=self._call,
            stream=self._stream,
            tasks=self._tasks,
            round_trips=self._round_trips,
        )
        server = self._server = Server(context, router)
        self._pumps.append(server.pump)
        self._watch_connections(router, server)
        self._known[info.incarnation] = info
        self._members[self.node_id] = info
        await self.spawn_here(NodeService, [], {}, "_node")
        if self.is_head:
            self._membership = await self.spawn_here(Membership, [], {}, "_membership")
        else:
            head_info = NodeInfo(HEAD_ID, self.head_address or "", "unknown")
            self._membership = ActorRef(self, _service_info("_membership", Membership, head_info), Membership)
            if self.member:
                await self._join()
        return self

    def _export_metrics(self, loop: asyncio.AbstractEventLoop) -> Exporter | None:
        """Serve ``/metrics`` (``runtime.metrics_port``; None: off) with the runtime's families."""
        port = self.config.metrics_port
        if port is None:
            return None
        from ..metrics.exporter import Exporter

        role = "head" if self.is_head else "child" if "." in self.node_id else "node"
        exporter = Exporter(loop, labels={"node": self.node_id, "role": role})
        try:
            exporter.start(port, self.config.metrics_host)
        except OSError as exc:
            self._stopping = True
            self.stopped.set()
            raise JoinError(
                f"{self.node_id} cannot serve /metrics on {self.config.metrics_host}:{port}: {exc}; "
                "choose another runtime.metrics_port (0: any free one)"
            ) from None
        self._round_trips = Timings()
        exporter.add(self._metric_families)
        self.metrics = exporter
        return exporter

    def _metric_families(self) -> list[Any]:
        """The runtime's families (``runtime.telemetry``), at a scrape."""
        from .telemetry import node_families

        now = self.loop.time()
        if self.is_head:
            membership = self._actors.get("_membership")
            seen = membership.last_seen if isinstance(membership, Membership) else {}
            heard = {node: max(time.monotonic() - t, 0.0) for node, t in seen.items()}
        else:
            heard = {HEAD_ID: now - self._heard} if self._heard else {}
        in_flight: dict[str, int] = {}
        for peer in self._peers.values():
            in_flight[peer.info.node_id] = in_flight.get(peer.info.node_id, 0) + peer.inflight
        assert self._round_trips is not None
        return node_families(self.stats(), in_flight=in_flight, round_trips=self._round_trips, heard_s=heard)

    def _secure(self, sockets: zmq.Context[Any], router: zmq.Socket[Any]) -> None:
        keys = self.require_keys()
        zap = sockets.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)

        def on_zap(frames: list[Any]) -> None:
            zap_pump.send(self.auth.on_zap_request(frames))

        zap_pump = SocketPump(zap, on_zap, recheck_s=self.config.io_recheck_s, loop=self.loop, batch=False)
        self._pumps.append(zap_pump)
        keys.make_server(router)

    def _watch_connections(self, router: zmq.Socket[Any], server: Server) -> None:
        """Count connections, close those past ``runtime.max_connections``, and tell the server
        when one closes (its callers' calls stop) and when a handshake fails (counted)."""
        monitor = router.get_monitor_socket(monitor_events() | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        stats = self.stats_
        limit = self.config.max_connections
        open_fds: set[int] = set()

        def on_event(frames: list[Any]) -> None:
            event, fd = self.auth.on_monitor_event(frames)
            if event == zmq.EVENT_ACCEPTED:
                if len(open_fds) >= limit:
                    stats.connections_refused += 1
                    _shut_down(fd)  # libzmq sees the connection end and closes it itself
                    return
                open_fds.add(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                open_fds.discard(fd)
                server.disconnected(fd)
            stats.connections = len(open_fds)

        self._pumps.append(
            SocketPump(monitor, on_event, recheck_s=self.config.io_recheck_s, loop=self.loop, batch=False)
        )

    async def _join(self) -> None:
        timeout = self.config.join_timeout_s
        deadline = self.loop.time() + timeout
        try:
            while True:
                reply: JoinReply = await self.membership.join.options(
                    timeout=max(deadline - self.loop.time(), 0.1)
                )(self.info)
                if not reply.retry:
                    break
                if self.loop.time() + 0.2 > deadline:
                    await self.stop()
                    raise JoinError(
                        f"{self.node_id} could not join within runtime.join_timeout_s={timeout:g}s: {reply.retry}"
                    )
                log.info("%s waits to join: %s", self.node_id, reply.retry)
                await asyncio.sleep(0.2)
        except CallTimeout:
            await self.stop()
            raise JoinError(
                f"{self.node_id} could not join the head at {self.head_address} within "
                f"runtime.join_timeout_s={timeout:g}s: check that the head runs at that address and that "
                "every node has the same cluster secret (RLASYNC_CLUSTER_SECRET)"
            ) from None
        except RuntimeErrorBase as exc:
            await self.stop()
            if isinstance(exc, JoinError):
                raise
            raise JoinError(f"{self.node_id} was refused by the head: {exc}") from None
        placeholder = self._peers.pop("unknown", None)
        if placeholder is not None:  # the connection made for the join now knows whom it reaches
            placeholder.info = reply.head
            self._peers[reply.head.incarnation] = placeholder
        self._membership = ActorRef(self, _service_info("_membership", Membership, reply.head), Membership)
        self._apply_members(reply.epoch, reply.members, [])
        self._tasks.append(self.loop.create_task(self._heartbeat(), name=f"rlasync-heartbeat-{self.node_id}"))

    async def _heartbeat(self) -> None:
        """Tell the head this node lives, bring back its news, and stop when the head is gone.
        The head is gone when its connection is (libzmq's heartbeats drop it within
        ``runtime.link_timeout_s`` of a stopped process or a cut link); a head that answers
        late, its connection alive, is only busy (a script blocking its loop), and is waited for."""
        config = self.config
        beat = self.membership.heartbeat.options(timeout=config.node_dead_after_s)
        head = self._peer(self.membership.info.node)
        head.watch_link()  # after the join's answer came over it: it starts up
        busy_since: float | None = None
        while True:
            try:
                reply = await beat(self.node_id, self.info.incarnation, self._epoch)
            except CallTimeout as exc:
                if head.link_up:
                    if busy_since is None:
                        busy_since = self.loop.time() - config.node_dead_after_s
                        log.info(
                            "%s: the head has answered no heartbeat for %.1fs, but its connection is alive: its "
                            "event loop is busy; waiting",
                            self.node_id,
                            config.node_dead_after_s,
                        )
                    continue
                self._lose_the_head(f"its connection is gone and it answered no heartbeat ({exc})")
                return
            except NodeLostError as exc:
                self._lose_the_head(str(exc))
                return
            except Exception:  # anything else is a bug; a node that cannot heartbeat must not linger
                log.exception("%s: heartbeat failed; stopping", self.node_id)
                self.request_stop()
                return
            if reply.fenced:
                log.error("%s was declared dead by the head; stopping", self.node_id)
                self._fenced = True
                self.exit_code = EX_TEMPFAIL
                self.request_stop()
                return
            self._heard = self.loop.time()
            if busy_since is not None:
                log.info("%s: the head answers again, after %.1fs", self.node_id, self._heard - busy_since)
                busy_since = None
            if reply.members is not None:
                self._apply_members(reply.epoch, reply.members, reply.dead)
            await asyncio.sleep(config.heartbeat_interval_s)

    def _lose_the_head(self, why: str) -> None:
        log.error("%s lost the head (%s); stopping", self.node_id, why)
        self.exit_code = EX_TEMPFAIL
        self.on_node_dead(HEAD_ID, f"the head is gone: {why}")
        self.request_stop()

    def set_members(self, epoch: int, members: list[NodeInfo]) -> None:
        """The head's membership changed (called by ``Membership`` on the head itself)."""
        self._epoch = epoch
        self._members = {m.node_id: m for m in members}
        self._known.update((m.incarnation, m) for m in members)

    def _apply_members(self, epoch: int, members: list[NodeInfo], dead: list[NodeInfo]) -> None:
        self._epoch = epoch
        self._members = {m.node_id: m for m in members}
        self._known.update((m.incarnation, m) for m in (*members, *dead))
        for gone in dead:
            if gone.incarnation not in self._dead_incarnations:
                self.on_node_dead(gone.node_id, "declared dead by the head", gone.incarnation)

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
        info = await self._member(target)
        module, script = cls.__module__, ""
        if module in ("__main__", SCRIPT_MODULE):  # the running script's class, here or as imported
            script = getattr(sys.modules.get(module), "__file__", "") or ""
            module = "__main__"  # where the script runs it is __main__; elsewhere it is imported again
        spec = SpawnSpec(module, cls.__qualname__, name, list(args), kwargs, file=script)
        service = ActorRef(self, _service_info("_node", NodeService, info), NodeService)
        actor_info: ActorInfo = await service.spawn.options(timeout=self.config.join_timeout_s)(spec)
        return ActorRef(self, actor_info, cls)  # type: ignore[return-value]

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
        info = _service_info(name, cls, self.info)
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

    # -- supervised child processes ------------------------------------------------------------
    async def start_child(self, *, preload: tuple[str, ...] = (), on: int | str | None = None) -> NodeInfo:
        """Start a node process that node ``on`` (default: this one) supervises; a trainer rank
        lives in one. It joins the cluster as ``<that node>.<k>``, dies with its parent process,
        and is stopped when its parent stops. ``preload``: modules it imports before joining
        (torch, say: see ``runtime.preload_modules``). Returns the child once it has joined
        (``runtime.join_timeout_s``)."""
        from .process import start_node_process

        target = self.node_id if on is None else (f"node-{on}" if isinstance(on, int) else on)
        if target != self.node_id:
            info = await self._member(target)
            service = ActorRef(self, _service_info("_node", NodeService, info), NodeService)
            child: NodeInfo = await service.start_child.options(timeout=self.config.join_timeout_s + 10)(
                list(preload)
            )
            return child
        if self._stopping:
            raise RuntimeError(f"{self.node_id} is stopping; it starts no more processes")
        child_id = f"{self.node_id}.{self._child_count}"
        self._child_count += 1
        config = msgspec.structs.replace(
            self.config, preload_modules=tuple(dict.fromkeys((*self.config.preload_modules, *preload)))
        )
        head = self.address if self.is_head else (self.head_address or "")
        proc = await start_node_process(
            child_id,
            child_address(self.address, child_id),
            head,
            config=config,
            secret=self._secret,
            parent=os.getpid(),
        )
        self._children[child_id] = proc
        self._tasks.append(self.loop.create_task(self._reap(child_id, proc), name=f"rlasync-reap-{child_id}"))
        timeout = self.config.join_timeout_s
        joined = asyncio.ensure_future(
            self.membership.wait_node.options(timeout=timeout + 5)(child_id, timeout)
        )
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait([joined, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if joined.done() and joined.exception() is None:
            return joined.result()
        joined.cancel()
        if proc.returncode is None:
            proc.kill()
        error = joined.exception() if joined.done() and not joined.cancelled() else None
        why = (
            f"exited with code {proc.returncode}"
            if proc.returncode is not None
            else f"did not join ({error})"
        )
        raise JoinError(
            f"{child_id}, a process started by {self.node_id}, {why}; its stderr is above (raise runtime.join_timeout_s on a loaded machine)"
        )

    async def stop_nodes(self, node_ids: list[str]) -> None:
        """Ask other nodes to shut down and wait (``runtime.shutdown_timeout_s``) until they have
        left; their parents (for children) or launchers reap the processes."""
        for node_id in node_ids:
            info = self._members.get(node_id)
            if info is not None:
                with contextlib.suppress(NodeLostError, zmq.ZMQError):
                    self.tell_service(info, "shutdown", [])
        deadline = self.loop.time() + self.config.shutdown_timeout_s
        while any(n in self._members for n in node_ids) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
            if not self.is_head:
                with contextlib.suppress(RuntimeErrorBase):
                    self._apply_members(
                        self._epoch, await self.membership.members_list.options(timeout=1.0)(), []
                    )

    async def _member(self, node_id: str) -> NodeInfo:
        info = self._members.get(node_id)
        if info is None:
            self._apply_members(self._epoch, await self.membership.members_list(), [])
            info = self._members.get(node_id)
            if info is None:
                known = ", ".join(sorted(self._members))
                raise ValueError(f"no live node {node_id!r} in the cluster (members: {known})")
        return info

    async def _reap(self, child_id: str, proc: asyncio.subprocess.Process) -> None:
        """Wait for a child to exit; on the head, one that exits unasked is declared dead at once
        (other nodes leave that to the head's heartbeat deadline)."""
        code = await proc.wait()
        if self._stopping:
            return
        log.log(
            logging.DEBUG if code == 0 else logging.WARNING,  # 0: it left first ("left the cluster")
            "%s (pid %d, started by %s) exited with code %s",
            child_id,
            proc.pid,
            self.node_id,
            code,
        )
        membership = self._actors.get("_membership") if self.is_head else None
        if isinstance(membership, Membership):
            membership.declare_dead(child_id, f"its process exited with code {code}")

    async def _stop_children(self, timeout: float) -> None:
        running = [(child_id, p) for child_id, p in self._children.items() if p.returncode is None]
        for child_id, _ in running:
            info = self._members.get(child_id)
            if info is not None:
                with contextlib.suppress(NodeLostError, zmq.ZMQError):
                    self.tell_service(info, "shutdown", [])
            else:
                with contextlib.suppress(ProcessLookupError):
                    self._children[child_id].terminate()
        if running:
            waits = [asyncio.ensure_future(p.wait()) for _, p in running]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for _, p in running:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if pending:
                await asyncio.wait(pending, timeout=timeout)

    async def node_stats(self, node: int | str | None = None) -> NodeStats:
        """The counters of ``node`` (a rank or node id; default: this one)."""
        node_id = self.node_id if node is None else (f"node-{node}" if isinstance(node, int) else node)
        if node_id == self.node_id:
            return self.stats()
        info = self._members.get(node_id)
        if info is None:
            raise NodeLostError(node_id, "not a live member of the cluster")
        stats: NodeStats = await ActorRef(
            self, _service_info("_node", NodeService, info), NodeService
        ).stats()
        return stats

    def live_member(self, node_id: str) -> NodeInfo | None:
        """The live member ``node_id`` as this node last heard of it (None: not one); asks nobody."""
        return self._members.get(node_id)

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
        stats.lost_wakeups = sum(p.rescued for p in self._pumps) + sum(
            p.pump.rescued for p in self._peers.values()
        )
        stats.unroutable_replies = self._server.pump.unroutable if self._server is not None else 0
        stats.dropped_messages = sum(p.dropped for p in self._pumps) + sum(
            p.pump.dropped for p in self._peers.values()
        )
        return stats

    # -- calls out ------------------------------------------------------------------------------
    def _peer(self, info: NodeInfo) -> Peer:
        """The connection to ``info``'s process, made on first use.

        A process the head declared dead fails fast. Any other call names the process it
        means (``Call.to``), so a restarted process at the same address refuses it instead
        of answering for its predecessor.
        """
        reason = self._dead_incarnations.get(info.incarnation)
        if reason is not None:
            raise NodeLostError(
                info.node_id,
                f"{reason} (that process is gone; look its actors up again)",
                graceful=info.incarnation in self._left,
            )
        peer = self._peers.get(info.incarnation)
        if peer is not None:
            return peer
        if self._stopping:
            raise NodeLostError(self.node_id, "this node is stopping")
        peer = self._peers[info.incarnation] = Peer(self.context, info)
        return peer

    def _call(
        self,
        actor: ActorInfo,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None,
        convert: Any,
    ) -> asyncio.Future[Any]:
        """Route a unary call (``NodeContext.call``): to an actor here, or through its node's peer."""
        timeout = timeout or self.config.call_timeout_s
        where = actor.node
        if where.node_id == self.node_id:
            return CallTask(self._call_local(actor.name, method, args, kwargs, timeout), loop=self.loop)
        try:
            peer = self._peer(where)
        except NodeLostError as exc:
            task = CallTask(_raise(exc), loop=self.loop)
            return task
        return peer.call(actor.name, method, args, kwargs, timeout, convert)

    def _stream(
        self,
        actor: ActorInfo,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None,
        convert: Any,
    ) -> AsyncIterator[Any]:
        """Open a streaming call (``NodeContext.stream``): to an actor here, or through a peer."""
        timeout = timeout or self.config.call_timeout_s
        where = actor.node
        if where.node_id == self.node_id:
            return self._stream_local(actor.name, method, args, kwargs, timeout)
        return self._peer(where).stream(actor.name, method, args, kwargs, timeout, convert)

    async def _call_local(
        self, name: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        # A call to an actor of this node is made by this process, whoever this task serves
        # (the head spawning for node-1 registers its actor as the head, not as node-1). The call
        # runs in a task of its own (``_call``), so this does not leak into the caller's.
        current_caller.set(None)
        actor = self.local_actor(name)
        ep = endpoints_of(type(actor)).get(method)
        if ep is None or ep.streaming:
            raise NotAnEndpoint(f"{method!r} is not a unary endpoint of actor {name!r}")
        try:
            async with asyncio.timeout(timeout) as deadline:
                # The checks a remote call's arguments get on arrival, so that a wrong argument is
                # the same error wherever the actor lives (and the callee gets what it annotated).
                args, kwargs = ep.convert_args(args, kwargs)
                return await ep.fn(actor, *args, **kwargs)
        except TimeoutError as exc:
            if deadline.expired():
                raise CallTimeout(
                    f"call to {name}.{method} on {self.node_id} got no answer within {timeout:.3g}s; "
                    "raise runtime.call_timeout_s or pass .options(timeout=...)"
                ) from None
            raise actor_error(exc, name, method, self.node_id) from None
        except RuntimeErrorBase:
            raise
        except Exception as exc:
            raise actor_error(exc, name, method, self.node_id) from exc

    async def _stream_local(
        self, name: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float
    ) -> AsyncIterator[Any]:
        actor = self.local_actor(name)
        ep = endpoints_of(type(actor)).get(method)
        if ep is None or not ep.streaming:
            raise NotAnEndpoint(f"{method!r} is not a streaming endpoint of actor {name!r}")
        try:
            args, kwargs = ep.convert_args(args, kwargs)  # as a remote stream's arguments are checked
        except Exception as exc:
            raise actor_error(exc, name, method, self.node_id) from exc
        items = ep.fn(actor, *args, **kwargs)
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        item = await items.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise CallTimeout(
                        f"stream {name}.{method} sent no item for {timeout:.3g}s; raise runtime.call_timeout_s"
                    ) from None
                except RuntimeErrorBase:
                    raise
                except Exception as exc:
                    raise actor_error(exc, name, method, self.node_id) from exc
                yield item
        finally:
            await items.aclose()

    def tell_service(self, info: NodeInfo, method: str, args: list[Any]) -> None:
        """Send a one-way call to ``info``'s ``_node`` service (no reply, no wait)."""
        if info.node_id != self.node_id and not self._stopping:
            self._peer(info).send_oneway("_node", method, args)

    # -- failure and stop -------------------------------------------------------------------
    def on_node_dead(
        self, node_id: str, reason: str, incarnation: str | None = None, *, graceful: bool = False
    ) -> None:
        """Fail every call to that process of ``node_id`` and stop serving its calls.

        ``incarnation`` names the process; None means every process of that rank (only used
        when the head is lost, after which this node stops). ``graceful``: it shut down
        cleanly (the calls' ``NodeLostError`` says so). Safe to call repeatedly.
        """
        if node_id == self.node_id:
            if incarnation in (None, self.info.incarnation):
                if self._stopping:  # it left: the head's news of it, heard back, is no failure
                    return
                log.error("%s was declared dead (%s); stopping", node_id, reason)
                self._fenced = True
                self.exit_code = EX_TEMPFAIL
                self.request_stop()
            return
        if incarnation is not None:
            self._dead_incarnations[incarnation] = reason
            if graceful:
                self._left.add(incarnation)
            info = self._known.get(incarnation)
            if info is not None:
                self._dead_callers.add(info.key or process_claim(info.node_id, info.incarnation))
                if self._server is not None:
                    self._server.forget(info)
        member = self._members.get(node_id)
        if member is not None and incarnation in (None, member.incarnation):
            self._dead[node_id] = reason
            del self._members[node_id]
        elif incarnation is None:
            self._dead[node_id] = reason
        for peer in list(self._peers.values()):
            if peer.info.node_id == node_id and incarnation in (None, peer.info.incarnation, peer.to or None):
                peer.mark_lost(NodeLostError(node_id, reason, graceful=graceful))

    def connected(self, info: NodeInfo) -> bool:
        """Whether the process ``info`` describes has a connection to this node open now."""
        return self._server is not None and self._server.connected(info)

    def is_dead_caller(self, caller: Caller) -> bool:
        """Whether ``caller`` is a process the head declared dead (it is served no more)."""
        return bool(self._dead_callers) and (caller.key or caller.claim) in self._dead_callers

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
            for peer in self._peers.values():
                peer.mark_lost(NodeLostError(peer.info.node_id, f"{self.node_id} stopped", graceful=True))
            for pump in self._pumps:
                pump.close()
            if self.ctx is not None:
                self.ctx.destroy(linger=0)
            if self.metrics is not None:
                self.metrics.close()
            if self._watching:
                self._watching = False
                stall.unwatch(self.loop)
            self._actors.clear()
            self.stopped.set()

    async def _stop_politely(self, timeout: float) -> None:
        await self._stop_children(timeout)
        if self.is_head and self._membership is not None:
            await self._tell_members_the_cluster_ends(min(timeout, 2.0))
        if not self.is_head and self._epoch >= 0 and HEAD_ID not in self._dead and not self._fenced:
            # A call, not a one-way message: closing with linger 0 could drop the message,
            # and the head would then wait node_dead_after_s to notice the departure.
            try:
                await self.membership.leave.options(timeout=min(timeout, 1.0))(
                    self.node_id, self.info.incarnation
                )
            except RuntimeErrorBase as exc:
                log.info("%s could not tell the head it leaves: %s", self.node_id, exc)
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

    async def _tell_members_the_cluster_ends(self, timeout: float) -> None:
        """The head stops: every node is told (and stops) instead of finding out by heartbeat."""
        others = [m for m in self._members.values() if m.node_id != self.node_id and "." not in m.node_id]
        calls = []
        for info in others:
            with contextlib.suppress(NodeLostError, zmq.ZMQError):
                service = ActorRef(self, _service_info("_node", NodeService, info), NodeService)
                calls.append(service.cluster_ends.options(timeout=timeout)())
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)

    def on_cluster_end(self) -> None:
        """The head stops the cluster: stop too (exit code 0: nothing to rejoin)."""
        self.exit_code = 0
        self.request_stop()

    # -- actor refs on the wire -------------------------------------------------------------
    @staticmethod
    def _ref_to_wire(ref: ActorRef) -> Any:
        return ref.info

    def _ref_from_wire(self, data: Any) -> ActorRef:
        import msgspec

        info = msgspec.convert(data, ActorInfo)
        return ActorRef(self, info, _loaded_class(info.cls))

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


EX_TEMPFAIL = 75  # exit code of a node fenced or cut off from its head: a supervisor restarts it


def _private_ipc_folder(address: str) -> None:
    """An ``ipc://`` socket lives in a folder only this user can enter: anyone who can connect
    to it is a member (there is no handshake on ipc). Creates the folder if missing."""
    folder = os.path.dirname(os.path.abspath(address.removeprefix("ipc://")))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise JoinError(
            f"ipc socket folder {folder} can be entered by other users (mode {st.st_mode & 0o777:o}, owner uid "
            f"{st.st_uid}): whoever connects to the socket can call every actor. Use a folder only you can enter "
            f"(chmod 700 {folder}), or tcp:// with a cluster secret"
        )


def _raise_descriptor_limit(connections: int) -> None:
    """Let this process hold ``runtime.max_connections`` connections plus its own files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning(
                "open-file limit %d is below runtime.max_connections=%d + 1024: raise `ulimit -n`",
                new,
                connections,
            )


def _shut_down(fd: int) -> None:
    """End the TCP connection on ``fd`` without closing libzmq's descriptor (it closes it itself)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def rank_of(node_id: str) -> int:
    """The rank of the node a node id belongs to: ``node-2`` -> 2, its child ``node-2.0`` -> 2."""
    return int(node_id.removeprefix("node-").split(".", 1)[0])


async def _raise(exc: BaseException) -> Any:
    raise exc


def _loaded_class(path: str) -> type | None:
    """The actor class ``module:QualName`` if its module is loaded here (a ref that arrived as an
    argument then decodes results into their annotated types, like one from ``spawn``)."""
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if obj is not None and qualname else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _service_info(name: str, cls: type[Actor], node: NodeInfo) -> ActorInfo:
    endpoints = {n: ep.streaming for n, ep in endpoints_of(cls).items()}
    return ActorInfo(name, node, endpoints, f"{cls.__module__}:{cls.__qualname__}")
