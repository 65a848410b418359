"""``LocalCluster``: real node processes on this machine, for tests, scripts and the demo.

    async with LocalCluster(nodes=3) as cluster:
        counter = await cluster.spawn(Counter, 0, node=2)
        print(await counter.add(1))

This process is the head (node-0); ``nodes - 1`` child processes are nodes 1..N-1. The
children talk over Unix sockets in a private directory (``runtime.transport: ipc``) or
over loopback TCP authenticated with a fresh cluster secret (``tcp``). Leaving the block
stops the children (politely, then SIGKILL after ``runtime.shutdown_timeout_s``) and the
head. The children die with this process (``runtime.lifeline``), and one that exits while the
cluster runs is declared dead at once.
"""

from __future__ import annotations

import abc
import asyncio
import os
import shutil
import signal
import tempfile
import time
from typing import Any, TypeVar

from ..config import RuntimeConfig
from ..transport.auth import new_secret
from .actor import Actor
from .errors import ClusterStartError
from .events import emit
from .node import Node
from .process import start_node_process
from .types import SECRET_ENV, NodeInfo

A = TypeVar("A", bound=Actor)
C = TypeVar("C", bound="_Cluster")


class _Cluster(abc.ABC):
    """A head in this process and the nodes it has: opened by ``async with``, closed on the way out."""

    start_seconds = 0.0  # from __aenter__ until every node had joined

    def __init__(self) -> None:
        self._head: Node | None = None  # made by _open

    @property
    def head(self) -> Node:
        """The head: this process's node, there once the cluster is opened (``async with``)."""
        if self._head is None:
            raise RuntimeError("the cluster is not open: use `async with` (its head starts then)")
        return self._head

    @abc.abstractmethod
    async def _open(self) -> None:
        """Start the head, and have every node join it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every node, then the head. Idempotent; safe after a failed start."""

    async def __aenter__(self: C) -> C:
        started = time.perf_counter()
        try:
            await self._open()
        except BaseException:
            await self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def spawn(
        self, cls: type[A], *args: Any, node: int | str | None = None, name: str | None = None, **kwargs: Any
    ) -> A:
        """Start an actor on ``node`` (a rank; default: the head). See ``Node.spawn``."""
        return await self.head.spawn(cls, *args, node=node, name=name, **kwargs)

    async def lookup(self, name: str, cls: type[A] | None = None, *, timeout: float = 0.0) -> A:
        return await self.head.lookup(name, cls, timeout=timeout)

    async def members(self) -> list[NodeInfo]:
        return await self.head.members()


class LocalCluster(_Cluster):
    """A head in this process plus ``nodes - 1`` node processes, started and stopped together."""

    def __init__(
        self,
        nodes: int = 2,
        *,
        config: RuntimeConfig | None = None,
        secret: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least 1 node, got nodes={nodes}")
        super().__init__()
        self.size = nodes
        self.config = config or RuntimeConfig()
        self.secret = secret or new_secret()
        self.env = env or {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self._dir = ""
        self._watchers: list[asyncio.Future[None]] = []
        self._closing = False

    def _address(self, rank: int) -> str:
        if self.config.transport == "tcp":
            return f"tcp://{self.config.host}:0"
        return f"ipc://{self._dir}/node-{rank}.sock"

    async def _open(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rlasync-")  # mode 0700: only this user reaches the sockets
        self._head = Node(0, self._address(0), config=self.config, secret=self.secret)
        await self._head.start()
        await self._start_children()

    async def _start_children(self) -> None:
        for rank in range(1, self.size):
            node_id = f"node-{rank}"
            self.processes[node_id] = await start_node_process(
                node_id,
                self._address(rank),
                self.head.address,
                config=self.config,
                secret=self.secret,
                parent=os.getpid(),
                env=self.env,
            )
            self._watchers.append(asyncio.ensure_future(self._watch(node_id, self.processes[node_id])))
        if self.size == 1:
            return
        timeout = self.config.join_timeout_s
        joined = asyncio.ensure_future(self.head.local_actor("_membership").wait_members(self.size, timeout))  # type: ignore[attr-defined]
        exits = {asyncio.ensure_future(p.wait()): node for node, p in self.processes.items()}
        try:
            done, _ = await asyncio.wait(
                [joined, *exits], return_when=asyncio.FIRST_COMPLETED, timeout=timeout + 1
            )
        finally:
            for waiter in exits:
                waiter.cancel()
        if joined in done and joined.exception() is None:
            return
        joined.cancel()
        for waiter in exits:
            if waiter in done:
                node = exits[waiter]
                raise ClusterStartError(
                    f"{node} exited with code {self.processes[node].returncode} before joining; its stderr is above"
                )
        raise ClusterStartError(
            f"the {self.size - 1} node processes did not all join within runtime.join_timeout_s={timeout:g}s; "
            "raise it on a loaded machine"
        )

    async def _watch(self, node_id: str, proc: asyncio.subprocess.Process) -> None:
        """A node process that exits while the cluster runs is declared dead at once: its callers
        fail now instead of after ``runtime.node_dead_after_s``."""
        code = await proc.wait()
        if not self._closing:
            self.head.local_actor("_membership").declare_dead(node_id, f"its process exited with code {code}")  # type: ignore[attr-defined]

    def pid(self, node: int | str) -> int:
        """The process id of a child node, e.g. to kill it in a test."""
        node_id = f"node-{node}" if isinstance(node, int) else node
        return self.processes[node_id].pid

    async def close(self) -> None:
        """Stop every node: ask the children, wait, kill stragglers, then stop the head."""
        self._closing = True
        timeout = self.config.shutdown_timeout_s
        head = self._head
        running = [p for p in self.processes.values() if p.returncode is None]
        if head is not None:
            for node_id in list(self.processes):
                info = head.live_member(node_id)  # None before the head started: none to tell
                if info is not None:
                    head.tell_service(info, "shutdown", [head.nodes_exit_code])
        if running:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in running], timeout=timeout
            )
            for p in running:
                if p.returncode is None:
                    p.send_signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=timeout)
        for watcher in self._watchers:
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(self._watchers)
        if head is not None:
            await head.stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class ExternalCluster(_Cluster):
    """A head in this process, and ``nodes - 1`` nodes started elsewhere that join it at
    ``listen`` (``rlasync node --rank R --head ADDRESS`` on each machine, or a launcher).

        async with ExternalCluster(3, "tcp://10.0.0.1:29600") as cluster:   # waits for node-1, node-2
            counter = await cluster.spawn(Counter, 0, node=2)

    The cluster secret comes from ``secret`` or ``RLASYNC_CLUSTER_SECRET``. Leaving the block
    asks every node to shut down, then stops the head."""

    def __init__(
        self, nodes: int, listen: str, *, config: RuntimeConfig | None = None, secret: str | None = None
    ) -> None:
        super().__init__()
        self.size = nodes
        self.listen = listen
        self.config = config or RuntimeConfig()
        self.secret = secret or os.environ.get(SECRET_ENV, "")

    async def _open(self) -> None:
        if self.listen.startswith("tcp://") and not self.secret:
            raise ClusterStartError(
                f"the nodes authenticate with a shared secret: export {SECRET_ENV} on every machine (make one with `rlasync secret`)"
            )
        self._head = Node(0, self.listen, config=self.config, secret=self.secret or None)
        await self._head.start()
        emit("listening", node=self.head.node_id, address=self.head.address)
        await self._wait_for_nodes()
        emit("ready", nodes=self.size)

    async def _wait_for_nodes(self) -> None:
        timeout = self.config.join_timeout_s
        membership = self.head.local_actor("_membership")
        wanted = [f"node-{rank}" for rank in range(1, self.size)]
        try:
            async with asyncio.timeout(timeout):
                for node_id in wanted:
                    await membership.wait_node(node_id, timeout)  # type: ignore[attr-defined]
        except TimeoutError:
            joined = {m.node_id for m in await self.head.members()}
            missing = [n for n in wanted if n not in joined]
            raise ClusterStartError(
                f"{', '.join(missing)} did not join the head at {self.head.address} within runtime.join_timeout_s={timeout:g}s: "
                f"start each with `rlasync node --rank R --head {self.head.address}` (same {SECRET_ENV}), or raise the timeout"
            ) from None

    async def close(self) -> None:
        """Ask every node to shut down (their children stop with them), then stop the head."""
        head = self._head
        if head is None:
            return
        if head.is_running:
            others = [
                m.node_id for m in await head.members() if m.node_id != head.node_id and "." not in m.node_id
            ]
            await head.stop_nodes(others)
        await head.stop()
