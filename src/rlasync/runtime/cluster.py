"""``LocalCluster``: real node processes on this machine, for tests, scripts and the demo.

    async with LocalCluster(nodes=3) as cluster:
        counter = await cluster.spawn(Counter, 0, node=2)
        print(await counter.add(1))

This process is the head (node-0); ``nodes - 1`` child processes are nodes 1..N-1. The
children talk over Unix sockets in a private directory (``runtime.transport: ipc``) or
over loopback TCP authenticated with a fresh cluster secret (``tcp``). Leaving the block
stops the children (politely, then SIGKILL after ``runtime.shutdown_timeout_s``) and the
head. A child that loses the head (this process died) stops itself after
``runtime.node_dead_after_s``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, TypeVar

import msgspec

from ..config import RuntimeConfig
from ..transport.auth import new_secret
from .actor import Actor
from .errors import ClusterStartError
from .node import Node
from .types import CONFIG_ENV, SECRET_ENV, NodeInfo

A = TypeVar("A", bound=Actor)


class LocalCluster:
    """A head in this process plus ``nodes - 1`` node processes, started and stopped together."""

    def __init__(self, nodes: int = 2, *, config: RuntimeConfig | None = None, secret: str | None = None, env: dict[str, str] | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least 1 node, got nodes={nodes}")
        self.size = nodes
        self.config = config or RuntimeConfig()
        self.secret = secret or new_secret()
        self.env = env or {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.head: Node
        self.start_seconds = 0.0  # from __aenter__ until every node had joined
        self._dir = ""

    def _address(self, rank: int) -> str:
        if self.config.transport == "tcp":
            return f"tcp://{self.config.host}:0"
        return f"ipc://{self._dir}/node-{rank}.sock"

    async def __aenter__(self) -> LocalCluster:
        started = time.perf_counter()
        self._dir = tempfile.mkdtemp(prefix="rlasync-")  # mode 0700: only this user reaches the sockets
        self.head = Node(0, self._address(0), config=self.config, secret=self.secret)
        try:
            await self.head.start()
            await self._start_children()
        except BaseException:
            await self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        return self

    async def _start_children(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env[SECRET_ENV] = self.secret
        env[CONFIG_ENV] = msgspec.json.encode(self.config).decode()
        # Children import actor classes by module name: give them this process's path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for rank in range(1, self.size):
            self.processes[f"node-{rank}"] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rlasync.runtime.worker",
                "--rank", str(rank), "--listen", self._address(rank), "--head", self.head.address,
                env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        if self.size == 1:
            return
        timeout = self.config.join_timeout_s
        joined = asyncio.ensure_future(self.head.local_actor("_membership").wait_members(self.size, timeout))  # type: ignore[attr-defined]
        exits = {asyncio.ensure_future(p.wait()): node for node, p in self.processes.items()}
        try:
            done, _ = await asyncio.wait([joined, *exits], return_when=asyncio.FIRST_COMPLETED, timeout=timeout + 1)
        finally:
            for waiter in exits:
                waiter.cancel()
        if joined in done and joined.exception() is None:
            return
        joined.cancel()
        for waiter in exits:
            if waiter in done:
                node = exits[waiter]
                raise ClusterStartError(f"{node} exited with code {self.processes[node].returncode} before joining; its stderr is above")
        raise ClusterStartError(
            f"the {self.size - 1} node processes did not all join within runtime.join_timeout_s={timeout:g}s; "
            "raise it on a loaded machine"
        )

    async def spawn(self, cls: type[A], *args: Any, node: int | str | None = None, name: str | None = None, **kwargs: Any) -> A:
        """Start an actor on ``node`` (a rank; default: the head). See ``Node.spawn``."""
        return await self.head.spawn(cls, *args, node=node, name=name, **kwargs)

    async def lookup(self, name: str, cls: type[A] | None = None, *, timeout: float = 0.0) -> A:
        return await self.head.lookup(name, cls, timeout=timeout)

    async def members(self) -> list[NodeInfo]:
        return await self.head.members()

    def pid(self, node: int | str) -> int:
        """The process id of a child node, e.g. to kill it in a test."""
        node_id = f"node-{node}" if isinstance(node, int) else node
        return self.processes[node_id].pid

    async def close(self) -> None:
        """Stop every node: ask the children, wait, kill stragglers, then stop the head."""
        timeout = self.config.shutdown_timeout_s
        head = getattr(self, "head", None)
        running = [p for p in self.processes.values() if p.returncode is None]
        if head is not None and head._started:
            for node_id in list(self.processes):
                info = head._members.get(node_id)
                if info is not None:
                    head.tell_service(info, "shutdown", [])
        if running:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in running], timeout=timeout)
            for p in running:
                if p.returncode is None:
                    p.send_signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=timeout)
        if head is not None:
            await head.stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
