"""The node processes a node supervises, and what a node asks of other nodes: an actor, a stop.

A node starts a child process (``start_child``: a trainer rank lives in one) that joins the
cluster as ``<node>.<k>``, dies with its parent process (``runtime.lifeline``), and is stopped
when its parent stops; the node reaps it, and on the head one that exits unasked is declared
dead at once. A node spawns actors on other nodes through their ``NodeService``
(``spawn_on``), and can ask them to shut down (``stop_nodes``); the head, stopping,
tells every node the cluster ends (``end_cluster``) instead of leaving them to find out by
heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
import zmq

from .actor import Actor
from .address import child_address
from .calls import Calls
from .context import NodeView
from .errors import JoinError, NodeLostError, RuntimeErrorBase
from .joining import EX_ENDED_EARLY, Roster
from .membership import SCRIPT_MODULE, Membership, service_at
from .ref import ActorRef
from .types import ActorInfo, NodeInfo, SpawnSpec

log = logging.getLogger(__name__)


class ChildrenHost(NodeView, Protocol):
    """What supervising needs of its node besides a ``NodeView``: where it is and where its
    head is (a child joins the head), and whether it is the head."""

    address: str
    head_address: str | None
    nodes_exit_code: int  # on the head: the exit code the nodes it stops take

    @property
    def is_head(self) -> bool: ...


class Children:
    """The processes ``node`` supervises. ``roster`` and ``calls`` are the node's (who is a
    member; its one-way messages), ``tasks`` its background tasks (each child's reaper joins
    them), ``actors`` its actors (on the head, the membership), ``secret`` the cluster secret
    handed to each child."""

    def __init__(
        self,
        node: ChildrenHost,
        roster: Roster,
        calls: Calls,
        *,
        tasks: list[asyncio.Task[Any]],
        actors: Mapping[str, Actor],
        secret: str | None,
    ) -> None:
        self._node, self._roster, self._calls = node, roster, calls
        self._tasks, self._actors, self._secret = tasks, actors, secret
        self.processes: dict[str, asyncio.subprocess.Process] = {}  # by node id
        self._count = 0

    async def start_child(self, *, preload: tuple[str, ...] = (), on: int | str | None = None) -> NodeInfo:
        """Start a supervised process on node ``on`` (default: this one); see ``Node.start_child``."""
        from .process import start_node_process

        node = self._node
        target = node.node_id if on is None else (f"node-{on}" if isinstance(on, int) else on)
        if target != node.node_id:
            info = await self._roster.member(target)
            child: NodeInfo = await service_at(node, info).start_child.options(
                timeout=node.config.join_timeout_s + 10
            )(list(preload))
            return child
        if node.stopping:
            raise RuntimeError(f"{node.node_id} is stopping; it starts no more processes")
        child_id = f"{node.node_id}.{self._count}"
        self._count += 1
        config = msgspec.structs.replace(
            node.config, preload_modules=tuple(dict.fromkeys((*node.config.preload_modules, *preload)))
        )
        head = node.address if node.is_head else (node.head_address or "")
        proc = await start_node_process(
            child_id,
            child_address(node.address, child_id),
            head,
            config=config,
            secret=self._secret,
            parent=os.getpid(),
        )
        self.processes[child_id] = proc
        self._tasks.append(node.loop.create_task(self._reap(child_id, proc), name=f"rlasync-reap-{child_id}"))
        timeout = node.config.join_timeout_s
        joined = asyncio.ensure_future(
            self._roster.head_ref().wait_node.options(timeout=timeout + 5)(child_id, timeout)
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
            f"{child_id}, a process started by {node.node_id}, {why}; its stderr is above (raise runtime.join_timeout_s on a loaded machine)"
        )

    async def _reap(self, child_id: str, proc: asyncio.subprocess.Process) -> None:
        """Wait for a child to exit; on the head, one that exits unasked is declared dead at once
        (other nodes leave that to the head's heartbeat deadline)."""
        code = await proc.wait()
        if self._node.stopping:
            return
        log.log(
            # 0 (or its head's run ended early): it was asked to, and left first ("left the cluster")
            logging.DEBUG if code in (0, EX_ENDED_EARLY) else logging.WARNING,
            "%s (pid %d, started by %s) exited with code %s",
            child_id,
            proc.pid,
            self._node.node_id,
            code,
        )
        membership = self._actors.get("_membership") if self._node.is_head else None
        if isinstance(membership, Membership):
            membership.declare_dead(child_id, f"its process exited with code {code}")

    async def stop_children(self, timeout: float) -> None:
        """Ask each running child to shut down (terminate one not yet a member), then kill those
        still running after ``timeout`` s."""
        running = [(child_id, p) for child_id, p in self.processes.items() if p.returncode is None]
        for child_id, _ in running:
            info = self._roster.members.get(child_id)
            if info is not None:
                with contextlib.suppress(NodeLostError, zmq.ZMQError):
                    self._calls.tell_service(info, "shutdown", [])
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.processes[child_id].terminate()
        if running:
            waits = [asyncio.ensure_future(p.wait()) for _, p in running]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for _, p in running:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if pending:
                await asyncio.wait(pending, timeout=timeout)

    # -- other nodes -----------------------------------------------------------------------
    async def spawn_on(
        self, target: str, cls: type[Actor], args: list[Any], kwargs: dict[str, Any], name: str
    ) -> ActorRef:
        """Start ``cls(*args, **kwargs)`` as ``name`` on the node ``target`` (not this one) through
        its ``NodeService``; see ``Node.spawn``."""
        info = await self._roster.member(target)
        module, script = cls.__module__, ""
        if module in ("__main__", SCRIPT_MODULE):  # the running script's class, here or as imported
            script = getattr(sys.modules.get(module), "__file__", "") or ""
            module = "__main__"  # where the script runs it is __main__; elsewhere it is imported again
        spec = SpawnSpec(module, cls.__qualname__, name, args, kwargs, file=script)
        service = service_at(self._node, info)
        spawned: ActorInfo = await service.spawn.options(timeout=self._node.config.join_timeout_s)(spec)
        return ActorRef(self._node, spawned, cls)

    async def stop_nodes(self, node_ids: list[str]) -> None:
        """Ask other nodes to shut down and wait until they have left; see ``Node.stop_nodes``."""
        node, roster = self._node, self._roster
        for node_id in node_ids:
            info = roster.members.get(node_id)
            if info is not None:
                with contextlib.suppress(NodeLostError, zmq.ZMQError):
                    self._calls.tell_service(info, "shutdown", [node.nodes_exit_code])
        deadline = node.loop.time() + node.config.shutdown_timeout_s
        while any(n in roster.members for n in node_ids) and node.loop.time() < deadline:
            await asyncio.sleep(0.05)
            if not node.is_head:
                with contextlib.suppress(RuntimeErrorBase):
                    await roster.refresh(timeout=1.0)

    async def end_cluster(self, timeout: float) -> None:
        """The head stops: every node is told (and stops) instead of finding out by heartbeat."""
        node = self._node
        others = [
            m for m in self._roster.members.values() if m.node_id != node.node_id and "." not in m.node_id
        ]
        calls = []
        for info in others:
            with contextlib.suppress(NodeLostError, zmq.ZMQError):
                calls.append(
                    service_at(node, info).cluster_ends.options(timeout=timeout)(node.nodes_exit_code)
                )
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)
