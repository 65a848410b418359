"""The head's membership and name registry, and the service actor every node runs.

The head (node-0) hosts ``Membership`` as ``_membership``: nodes join through it, heartbeat
to it, register actor names with it, and relay the termination signals they get (the run
stops). A node silent for ``runtime.node_dead_after_s``
is declared dead: the head pushes that news to every live node at once (and repeats it in
heartbeat replies), and each node fails its pending calls to the dead one with
``NodeLostError``. Every node hosts a ``NodeService`` as ``_node`` for spawning, stats and
shutdown. Both see their node as a ``ServiceHost``: an actor's ``Host`` and the node's hooks for
what the membership decides.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Protocol

from ..interrupts import SIGNALS, from_node
from .actor import Actor, endpoint
from .caller import current_caller
from .context import HasContext, NodeContext
from .errors import ActorNotFound, Forbidden
from .host import Host
from .ref import ActorRef, actor_info
from .types import ActorInfo, HeartbeatReply, JoinReply, MemberStatus, NodeInfo, NodeStats, SpawnSpec

log = logging.getLogger(__name__)
HEAD = "node-0"


class ServiceHost(Host, Protocol):
    """What the runtime's own actors ask of their node (``Node``) besides what any actor may:
    its counters, and its hooks for the news the membership brings (who is a member, who died,
    the cluster ends) and for what it is asked to do (spawn here, message another node)."""

    stats_: NodeStats
    join_listeners: list[Any]  # on the head: called with each node that joins
    exit_code: int  # its process's (``shutdown`` sets the head's ``nodes_exit_code``)

    def connected(self, info: NodeInfo) -> bool: ...

    def set_members(self, epoch: int, members: list[NodeInfo]) -> None: ...

    def on_node_dead(
        self, node_id: str, reason: str, incarnation: str | None = None, *, graceful: bool = False
    ) -> None: ...

    def tell_service(self, info: NodeInfo, method: str, args: list[Any]) -> None: ...

    def on_cluster_end(self, code: int = 0) -> None: ...

    async def spawn_here(
        self, cls: type[Actor], args: list[Any], kwargs: dict[str, Any], name: str
    ) -> ActorRef: ...

    async def until_joined(self) -> None: ...


class Membership(Actor):
    """Who is in the cluster and where each named actor lives (on the head only)."""

    node: ServiceHost

    def __init__(self) -> None:
        self.members: dict[str, NodeInfo] = {}
        self.last_seen: dict[str, float] = {}
        self.busy: set[str] = set()  # silent past the deadline with their connection up (logged once)
        self.dead: list[NodeInfo] = []  # processes declared dead, most recent last
        self.epoch = 0
        self.names: dict[str, ActorInfo] = {}
        self._changed = asyncio.Event()  # set and replaced on every change, for waiters
        self._checker: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self.members[self.node.node_id] = self.node.info
        self._checker = asyncio.create_task(self._check_heartbeats(), name="rlasync-heartbeat-check")

    async def on_stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.wait([self._checker])  # its end, not its CancelledError (ours still propagates)

    def _bump(self) -> None:
        self.epoch += 1
        self.node.set_members(self.epoch, list(self.members.values()))
        self._changed.set()
        self._changed = asyncio.Event()

    @endpoint
    async def join(self, info: NodeInfo) -> JoinReply:
        if not _NODE_ID.fullmatch(info.node_id) or info.node_id == self.node.node_id:
            raise ValueError(
                f"cannot join as {info.node_id!r}: a node id is node-<rank> (rank 1 or more) or node-<rank>.<child>"
            )
        self._only(info, "join as")
        if info.version != self.node.info.version:
            raise ValueError(
                f"{info.node_id} ({info.host}) runs rlasync {info.version or 'of an unknown version'} and the head runs "
                f"{self.node.info.version}: install the same version on every machine"
            )
        old = self.members.get(info.node_id)
        if old is not None and old.incarnation != info.incarnation:
            # Another process holds the rank and still heartbeats: the newcomer waits until that
            # one leaves or is declared dead (a restarted node, sooner than its death was seen).
            seen = time.monotonic() - self.last_seen.get(info.node_id, 0.0)
            return JoinReply(
                self.node.info,
                self.epoch,
                [],
                retry=f"{info.node_id} is still held by a live process (last heartbeat {seen:.1f}s ago)",
            )
        taken = next(
            (
                m
                for m in self.members.values()
                if info.key and m.key == info.key and m.node_id != info.node_id
            ),
            None,
        )
        if taken is not None:
            raise ValueError(f"cannot join as {info.node_id}: this process is {taken.node_id} already")
        self.members[info.node_id] = info
        self.last_seen[info.node_id] = time.monotonic()
        self._bump()
        log.info("%s joined from %s (pid %d on %s)", info.node_id, info.address, info.pid, info.host)
        for listener in list(self.node.join_listeners):
            try:
                listener(info)
            except Exception:  # one listener's bug must not refuse the node
                log.exception("a join listener failed for %s", info.node_id)
        return JoinReply(self.node.info, self.epoch, list(self.members.values()))

    @endpoint
    async def heartbeat(self, node_id: str, incarnation: str, epoch: int) -> HeartbeatReply:
        info = self.members.get(node_id)
        if info is None or info.incarnation != incarnation:
            return HeartbeatReply(self.epoch, fenced=True)
        self._only(info, "heartbeat for")
        self.last_seen[node_id] = time.monotonic()
        self.busy.discard(node_id)
        if epoch == self.epoch:
            return HeartbeatReply(self.epoch)
        return HeartbeatReply(self.epoch, members=list(self.members.values()), dead=list(self.dead))

    @endpoint
    async def leave(self, node_id: str, incarnation: str) -> None:
        member = self.members.get(node_id)
        if member is not None and member.incarnation == incarnation:  # not a newer process of that rank
            self._only(member, "leave as")
            self._declare_dead(node_id, "it shut down", graceful=True)

    @endpoint
    async def interrupted(self, node_id: str, signal_name: str) -> float:
        """``node_id`` got a termination signal (``runtime.signals``): the run this head drives
        stops as if the head had got it. The seconds the node should keep serving; 0: stop now."""
        member = self.members.get(node_id)
        if member is None:
            return 0.0
        self._only(member, "report a signal to")
        if signal_name not in {s.name for s in SIGNALS}:
            raise ValueError(f"{signal_name!r} is not a signal that stops a run")
        return from_node(node_id, signal_name)

    @endpoint
    async def register(self, info: ActorInfo) -> None:
        self._only(info.node, "register an actor for")
        if info.name.startswith("_"):
            raise ValueError(f"actor names starting with '_' belong to the runtime; rename {info.name!r}")
        taken = self.names.get(info.name)
        if taken is not None and taken.node.node_id in self.members:
            raise ValueError(
                f"actor name {info.name!r} is taken by an actor on {taken.node.node_id}; pick another name"
            )
        self.names[info.name] = info
        self._bump()

    @endpoint
    async def unregister(self, name: str) -> None:
        info = self.names.get(name)
        if info is not None:
            self._only(info.node, "unregister an actor of")
            del self.names[name]
            self._bump()

    @endpoint
    async def lookup(self, name: str, timeout: float = 0.0) -> ActorInfo:
        """The actor named ``name``, waiting up to ``timeout`` seconds for it to be spawned."""
        deadline = time.monotonic() + timeout
        while (info := self.names.get(name)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ActorNotFound(
                    f"no live actor is named {name!r} (it was never spawned, or its node died); "
                    "pass lookup(..., timeout=...) to wait for it to appear"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass
        return info

    @endpoint
    async def members_list(self) -> list[NodeInfo]:
        return sorted(self.members.values(), key=lambda m: _order(m.node_id))

    @endpoint
    async def status(self) -> list[MemberStatus]:
        """Every live node, how long since its last heartbeat, and its named actors (those of
        the processes it supervises, ``node-1.0``, counted as its own)."""
        now = time.monotonic()
        placed: dict[str, list[ActorInfo]] = {}
        for info in self.names.values():
            placed.setdefault(info.node.node_id.split(".")[0], []).append(info)
        return [
            MemberStatus(
                m,
                0.0 if m.node_id == self.node.node_id else now - self.last_seen.get(m.node_id, now),
                sorted(placed.get(m.node_id, []), key=lambda a: a.name),
            )
            for m in sorted(self.members.values(), key=lambda m: _order(m.node_id))
            if "." not in m.node_id
        ]

    @endpoint
    async def wait_node(self, node_id: str, timeout: float) -> NodeInfo:
        """``node_id`` once it is a member; ``TimeoutError`` after ``timeout`` s."""
        async with asyncio.timeout(timeout):
            while node_id not in self.members:
                await self._changed.wait()
        return self.members[node_id]

    @endpoint
    async def wait_members(self, count: int, timeout: float) -> list[NodeInfo]:
        """The members once there are at least ``count``; ``TimeoutError`` after ``timeout`` s."""
        async with asyncio.timeout(timeout):
            while len(self.members) < count:
                await self._changed.wait()
        return await self.members_list()

    async def _check_heartbeats(self) -> None:
        config = self.node.config
        period = min(config.heartbeat_interval_s, config.node_dead_after_s) / 4
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for node_id, seen in list(self.last_seen.items()):
                info = self.members.get(node_id)
                if now - seen <= config.node_dead_after_s or info is None:
                    continue
                if self.node.connected(info):
                    # Its process and link live (libzmq's heartbeats hold the connection up): its
                    # loop, or this one, is busy. Silence alone is no death.
                    if node_id not in self.busy:
                        self.busy.add(node_id)
                        log.info(
                            "%s has sent no heartbeat for %.1fs, but its connection is alive: a loop is busy",
                            node_id,
                            now - seen,
                        )
                    continue
                try:
                    self._declare_dead(
                        node_id,
                        f"its connection closed and no heartbeat came for {now - seen:.1f}s "
                        f"(runtime.node_dead_after_s={config.node_dead_after_s})",
                    )
                except Exception:  # the checker must outlive any one failure, or no death is seen again
                    log.exception("declaring %s dead failed", node_id)
                    self.members.pop(node_id, None)

    def _only(self, info: NodeInfo, action: str) -> None:
        """Refuse the running call unless it comes from the process ``info`` describes."""
        _refuse_unless(
            self.node,
            [info],
            f"{action} {info.node_id}",
            f"a node may only {action} itself, not {info.node_id}",
        )

    def declare_dead(self, node_id: str, reason: str) -> None:
        """Declare ``node_id`` dead now (its process is known to have exited), without waiting
        for its heartbeats to stop."""
        if node_id in self.members:
            self._declare_dead(node_id, reason)

    def _declare_dead(self, node_id: str, reason: str, graceful: bool = False) -> None:
        info = self.members.pop(node_id, None)
        self.last_seen.pop(node_id, None)
        self.busy.discard(node_id)
        if info is None:
            return
        if graceful:  # a clean shutdown (``leave``): news, not a failure
            log.info("%s left the cluster (%s)", node_id, reason)
        else:
            log.warning("%s declared dead: %s", node_id, reason)
        self.dead.append(info)
        del self.dead[:-1024]
        for name in [n for n, a in self.names.items() if a.node.node_id == node_id]:
            del self.names[name]
        self._bump()
        self.node.on_node_dead(node_id, reason, info.incarnation, graceful=graceful)
        for member in self.members.values():
            if member.node_id != self.node.node_id:
                self.node.tell_service(member, "node_dead", [node_id, info.incarnation, reason, graceful])


_NODE_ID = re.compile(r"node-[0-9]{1,6}(\.[0-9]{1,6})?")


def _order(node_id: str) -> tuple[int, ...]:
    """Nodes in rank order, each node's children after it: node-1 < node-1.0 < node-2."""
    return tuple(int(part) for part in node_id.removeprefix("node-").split("."))


class NodeService(Actor):
    """The runtime's own actor on every node (``_node``)."""

    node: ServiceHost

    @endpoint
    async def spawn(self, spec: SpawnSpec) -> ActorInfo:
        if spec.name.startswith("_"):
            self.node.stats_.calls_forbidden += 1
            raise Forbidden(f"actor names starting with '_' belong to the runtime; rename {spec.name!r}")
        # Importing an actor's module can take seconds (torch, transformers): in a thread, so
        # this node's heartbeats keep flowing and the head does not declare it dead meanwhile.
        cls = await asyncio.to_thread(import_actor_class, spec)
        ref = await self.node.spawn_here(cls, list(spec.args), dict(spec.kwargs), spec.name)
        return ref.info

    @endpoint
    async def start_child(self, preload: list[str]) -> NodeInfo:
        """Start a process this node supervises, joined to the cluster (``Node.start_child``).
        Only the head places processes: another member cannot make a node start any."""
        await self.node.until_joined()
        self._only_from(HEAD, "start a process on another node")
        return await self.node.start_child(preload=tuple(preload))

    @endpoint
    async def node_dead(self, node_id: str, incarnation: str, reason: str, graceful: bool = False) -> None:
        await self.node.until_joined()
        self._only_from(HEAD, "declare a node dead")
        self.node.on_node_dead(node_id, reason, incarnation, graceful=graceful)

    @endpoint
    async def stats(self) -> NodeStats:
        return self.node.stats()

    @endpoint
    async def ping(self) -> str:
        return self.node.node_id

    @endpoint
    async def shutdown(self, code: int = 0) -> None:
        """Stop this node (asked by the head, or by the node that started this one), exiting with
        ``code`` (the head's ``nodes_exit_code``)."""
        parent = self.node.node_id.rsplit(".", 1)[0] if "." in self.node.node_id else HEAD
        self._only_from((HEAD, parent), "stop a node")
        self.node.exit_code = code
        # Stop after this call has answered, so the caller is not left waiting on it.
        asyncio.get_running_loop().call_soon(self.node.request_stop)

    @endpoint
    async def cluster_ends(self, code: int = 0) -> None:
        """The head stops the cluster: stop with ``code``, and do not rejoin."""
        self._only_from(HEAD, "end the cluster")
        asyncio.get_running_loop().call_soon(self.node.on_cluster_end, code)

    def _only_from(self, node_ids: str | tuple[str, ...], action: str) -> None:
        allowed = (node_ids,) if isinstance(node_ids, str) else node_ids
        members = [info for n in allowed if (info := self.node.live_member(n)) is not None]
        _refuse_unless(self.node, members, action, f"only {' or '.join(allowed)} may {action}")


def service_at(node: NodeContext | HasContext, info: NodeInfo) -> ActorRef:
    """A ref to the ``NodeService`` of the process ``info`` describes, for ``node``'s calls."""
    return ActorRef(node, actor_info("_node", NodeService, info), NodeService)


def membership_at(node: NodeContext | HasContext, head: NodeInfo) -> ActorRef:
    """A ref to the ``Membership`` of the head ``head`` describes, for ``node``'s calls."""
    return ActorRef(node, actor_info("_membership", Membership, head), Membership)


def _refuse_unless(node: ServiceHost, allowed: list[NodeInfo], action: str, message: str) -> None:
    """Raise ``Forbidden(message)`` (counted) unless the running call comes from this process or
    from one of the processes ``allowed`` describes (``caller.current_caller``)."""
    caller = current_caller.get()
    if caller is None or any(caller.is_node(info) for info in allowed):
        return
    node.stats_.calls_forbidden += 1
    log.warning("refused a caller (%s) that tried to %s", caller, action)
    raise Forbidden(message)


def import_actor_class(spec: SpawnSpec) -> type[Actor]:
    """The class ``spec`` names, imported on this node; the error says how to make it importable."""
    try:
        if spec.file and spec.module == "__main__":
            module = _running_script(spec.file) or _import_script(spec.file)
        else:
            module = importlib.import_module(spec.module)
        obj: Any = module
        for part in spec.qualname.split("."):
            obj = getattr(obj, part)
    except ScriptImportError:
        raise
    except AttributeError as exc:
        where = spec.file or spec.module
        raise ImportError(
            f"{where} defines no {spec.qualname} when a node imports it ({exc}): define actor classes at module "
            'level, outside `if __name__ == "__main__":`'
        ) from exc
    except (ImportError, OSError) as exc:
        raise ImportError(
            f"cannot import actor class {spec.module}:{spec.qualname} on this node ({exc}); define actor "
            "classes at module level in a module every node can import (install it, or add it to PYTHONPATH)"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{spec.module}:{spec.qualname} is not an rlasync.Actor subclass")
    return obj


class ScriptImportError(ImportError):
    """Importing the running script on a node (for its actor classes) ran the script's work."""


_importing = threading.local()  # .script: the script this thread is importing for its actor classes


def importing_script() -> str:
    """The script whose top-level code this thread runs to import its actor classes (else "").
    A node or cluster that starts then was started by a script without a ``__main__`` guard."""
    return str(getattr(_importing, "script", ""))


SCRIPT_MODULE = "__rlasync_main__"
"""The name the running script is imported under on nodes that need its actor classes."""


def _running_script(path: str) -> Any:
    """This process's ``__main__`` if it is the script at ``path`` (the script runs here: on the
    head, a spawn asked by another node must not import it a second time)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    try:
        return main if file and os.path.samefile(file, path) else None
    except OSError:
        return None


def _import_script(path: str) -> Any:
    # A script's classes live in its __main__; load the file under another name so its
    # `if __name__ == "__main__":` block does not run again here.
    name = SCRIPT_MODULE
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load script {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        _importing.script = path
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # a half-run script is not kept for the next spawn
            del sys.modules[name]
            raise ScriptImportError(
                f"every node imports {path} to find its actor classes, and importing it ran its top-level code, which "
                f"raised {type(exc).__name__}: {exc}. Put the script's work under "
                '`if __name__ == "__main__":` (e.g. `if __name__ == "__main__": rlasync.run(main())`)'
            ) from None
        finally:
            _importing.script = ""
    return module
