"""A node's place in the cluster: joining the head, heartbeating it, and who it knows is in.

``Roster`` is a node's view of the membership the head keeps (``membership.Membership``): the
live members by node id, every process heard of, and the processes declared dead, brought up
to date by the answers to its heartbeats (other nodes) or by the membership itself (the head).
A node other than the head joins within ``runtime.join_timeout_s``, then heartbeats; it stops
with ``EX_TEMPFAIL`` when the head declares it dead (fenced) or is gone (its connection closed
and it answers no heartbeat); a head that answers late while its connection lives is only
busy, and is waited for. When a process is declared dead, the calls to it fail and its own
calls here are served no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from .calls import Calls
from .context import NodeView
from .errors import CallTimeout, JoinError, NodeLostError, RuntimeErrorBase, not_started
from .membership import HEAD, membership_at
from .ref import ActorRef
from .server import Server
from .types import JoinReply, NodeInfo, process_claim

log = logging.getLogger(__name__)

EX_TEMPFAIL = 75  # exit code of a node fenced or cut off from its head: a supervisor restarts it
EX_ENDED_EARLY = 3  # of a node whose head ended its run before the last step: torchrun restarts the group


class JoiningHost(NodeView, Protocol):
    """What joining needs of its node besides a ``NodeView``: where the head is, this process
    as the cluster knows it, and how to stop it and say why (``exit_code``)."""

    head_address: str | None
    exit_code: int

    @property
    def info(self) -> NodeInfo: ...

    def request_stop(self) -> None: ...

    async def stop(self) -> None: ...


class Roster:
    """The members ``node`` knows of; ``calls`` are its calls (failed when a process dies) and
    ``tasks`` its background tasks (the heartbeat joins them)."""

    def __init__(self, node: JoiningHost, calls: Calls, tasks: list[asyncio.Task[Any]]) -> None:
        self._node = node
        self._calls = calls
        self._tasks = tasks
        self.members: dict[str, NodeInfo] = {}
        self.epoch = -1
        self.known: dict[str, NodeInfo] = {}  # every process heard of, live or dead, by incarnation
        self.dead: dict[str, str] = {}  # node id -> reason, for ranks with no live process
        self.dead_callers: set[str] = set()  # keys (TCP) and claims (ipc) of processes declared dead
        self.fenced = False  # the head declared this process dead: it must not speak for its rank
        self.heard = 0.0  # loop time of the head's last answer to a heartbeat (other nodes)
        self.membership: ActorRef | None = None  # the head's Membership (a local actor on the head)
        self.server: Server | None = None  # this node's, once it serves: it forgets the dead
        # Set once the head's join reply is applied (``Node._enter``; at once on the head): the
        # head counts a node as joined when it answers, and may call it (start a child there)
        # before the reply arrives; such a call waits, else the head is not yet a member here.
        self.joined = asyncio.Event()

    async def until_joined(self, timeout: float) -> None:
        """Until ``joined`` (within ``timeout``); then the caller checks membership as it stands."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.joined.wait(), timeout)

    def head_ref(self) -> ActorRef:
        """The ref to the head's ``Membership`` (the node's ``start`` makes it)."""
        if self.membership is None:
            raise not_started(self._node.node_id)
        return self.membership

    async def join(self) -> None:
        """Join the head at its address (``runtime.join_timeout_s``), then heartbeat it."""
        node = self._node
        timeout = node.config.join_timeout_s
        deadline = node.loop.time() + timeout
        try:
            while True:
                reply: JoinReply = await self.head_ref().join.options(
                    timeout=max(deadline - node.loop.time(), 0.1)
                )(node.info)
                if not reply.retry:
                    break
                if node.loop.time() + 0.2 > deadline:
                    await node.stop()
                    raise JoinError(
                        f"{node.node_id} could not join within runtime.join_timeout_s={timeout:g}s: {reply.retry}"
                    )
                log.info("%s waits to join: %s", node.node_id, reply.retry)
                await asyncio.sleep(0.2)
        except CallTimeout:
            await node.stop()
            raise JoinError(
                f"{node.node_id} could not join the head at {node.head_address} within "
                f"runtime.join_timeout_s={timeout:g}s: check that the head runs at that address and that "
                "every node has the same cluster secret (RLASYNC_CLUSTER_SECRET)"
            ) from None
        except RuntimeErrorBase as exc:
            await node.stop()
            if isinstance(exc, JoinError):
                raise
            raise JoinError(f"{node.node_id} was refused by the head: {exc}") from None
        # The connection made for the join now knows whom it reaches.
        self._calls.adopt("unknown", reply.head)
        self.membership = membership_at(node.context, reply.head)
        self.apply_members(reply.epoch, reply.members, [])
        self._tasks.append(node.loop.create_task(self._heartbeat(), name=f"rlasync-heartbeat-{node.node_id}"))

    async def _heartbeat(self) -> None:
        """Tell the head this node lives, bring back its news, and stop when the head is gone.
        The head is gone when its connection is (libzmq's heartbeats drop it within
        ``runtime.link_timeout_s`` of a stopped process or a cut link); a head that answers
        late, its connection alive, is only busy (a script blocking its loop), and is waited for."""
        node, config = self._node, self._node.config
        membership = self.head_ref()
        beat = membership.heartbeat.options(timeout=config.node_dead_after_s)
        head = self._calls.peer(membership.info.node)
        head.watch_link()  # after the join's answer came over it: it starts up
        busy_since: float | None = None
        while True:
            try:
                reply = await beat(node.node_id, node.info.incarnation, self.epoch)
            except CallTimeout as exc:
                if head.link_up:
                    if busy_since is None:
                        busy_since = node.loop.time() - config.node_dead_after_s
                        log.info(
                            "%s: the head has answered no heartbeat for %.1fs, but its connection is alive: its "
                            "event loop is busy; waiting",
                            node.node_id,
                            config.node_dead_after_s,
                        )
                    continue
                self._lose_the_head(f"its connection is gone and it answered no heartbeat ({exc})")
                return
            except NodeLostError as exc:
                self._lose_the_head(str(exc))
                return
            except Exception:  # anything else is a bug; a node that cannot heartbeat must not linger
                log.exception("%s: heartbeat failed; stopping", node.node_id)
                node.request_stop()
                return
            if reply.fenced:
                log.error("%s was declared dead by the head; stopping", node.node_id)
                self.fenced = True
                node.exit_code = EX_TEMPFAIL
                node.request_stop()
                return
            self.heard = node.loop.time()
            if busy_since is not None:
                log.info("%s: the head answers again, after %.1fs", node.node_id, self.heard - busy_since)
                busy_since = None
            if reply.members is not None:
                self.apply_members(reply.epoch, reply.members, reply.dead)
            await asyncio.sleep(config.heartbeat_interval_s)

    async def leave(self, timeout: float) -> None:
        """Tell the head this node leaves (a node that joined and still speaks for its rank)."""
        node = self._node
        if self.epoch < 0 or HEAD in self.dead or self.fenced:
            return
        # A call, not a one-way message: closing with linger 0 could drop the message,
        # and the head would then wait node_dead_after_s to notice the departure.
        try:
            await self.head_ref().leave.options(timeout=timeout)(node.node_id, node.info.incarnation)
        except RuntimeErrorBase as exc:
            log.info("%s could not tell the head it leaves: %s", node.node_id, exc)

    def _lose_the_head(self, why: str) -> None:
        log.error("%s lost the head (%s); stopping", self._node.node_id, why)
        self._node.exit_code = EX_TEMPFAIL
        self.on_node_dead(HEAD, f"the head is gone: {why}")
        self._node.request_stop()

    # -- the members ------------------------------------------------------------------------
    def set_members(self, epoch: int, members: list[NodeInfo]) -> None:
        """The head's membership changed (called by ``Membership`` on the head itself)."""
        self.epoch = epoch
        self.members = {m.node_id: m for m in members}
        self.known.update((m.incarnation, m) for m in members)

    def apply_members(self, epoch: int, members: list[NodeInfo], dead: list[NodeInfo]) -> None:
        """The head's news (other nodes): the members now, and the processes declared dead."""
        self.epoch = epoch
        self.members = {m.node_id: m for m in members}
        self.known.update((m.incarnation, m) for m in (*members, *dead))
        for gone in dead:
            if gone.incarnation not in self._calls.dead:
                self.on_node_dead(gone.node_id, "declared dead by the head", gone.incarnation)

    async def refresh(self, timeout: float | None = None) -> None:
        """Ask the head who the members are now (``timeout``: None, ``runtime.call_timeout_s``)."""
        epoch = self.epoch
        members = await self.head_ref().members_list.options(timeout=timeout)()
        self.apply_members(epoch, members, [])

    async def member(self, node_id: str) -> NodeInfo:
        """The live member ``node_id``, asking the head if this node has not heard of it;
        ``ValueError`` if there is none."""
        info = self.members.get(node_id)
        if info is None:
            await self.refresh()
            info = self.members.get(node_id)
            if info is None:
                known = ", ".join(sorted(self.members))
                raise ValueError(f"no live node {node_id!r} in the cluster (members: {known})")
        return info

    def on_node_dead(
        self, node_id: str, reason: str, incarnation: str | None = None, *, graceful: bool = False
    ) -> None:
        """Fail every call to that process of ``node_id`` and stop serving its calls.

        ``incarnation`` names the process; None means every process of that rank (only used
        when the head is lost, after which this node stops). ``graceful``: it shut down
        cleanly (the calls' ``NodeLostError`` says so). Safe to call repeatedly.
        """
        node = self._node
        if node_id == node.node_id:
            if incarnation in (None, node.info.incarnation):
                if node.stopping:  # it left: the head's news of it, heard back, is no failure
                    return
                log.error("%s was declared dead (%s); stopping", node_id, reason)
                self.fenced = True
                node.exit_code = EX_TEMPFAIL
                node.request_stop()
            return
        if incarnation is not None:
            self._calls.forget(incarnation, reason, graceful)
            info = self.known.get(incarnation)
            if info is not None:
                # Its calls come back under its CURVE key over TCP, under its claim over ipc (no
                # handshake there, though the node has a key): a connection dropped before this
                # news and opened again after it is refused either way.
                self.dead_callers.update(
                    p for p in (info.key, process_claim(info.node_id, info.incarnation)) if p
                )
                if self.server is not None:
                    self.server.forget(info)
        member = self.members.get(node_id)
        if member is not None and incarnation in (None, member.incarnation):
            self.dead[node_id] = reason
            del self.members[node_id]
        elif incarnation is None:
            self.dead[node_id] = reason
        self._calls.lost(node_id, incarnation, reason, graceful)
