"""Actors the runtime tests spawn in node processes (importable there through PYTHONPATH)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rlasync import Actor, endpoint


class Point(msgspec.Struct):
    x: int
    y: int


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @endpoint
    async def add(self, n: int) -> int:
        self.value += n
        return self.value

    @endpoint
    async def norm1(self, p: Point) -> int:
        return abs(p.x) + abs(p.y)

    @endpoint
    async def mirror(self, p: Point) -> Point:
        return Point(p.y, p.x)

    @endpoint
    async def echo(self, value: Any) -> Any:
        return value

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    async def helper(self) -> int:  # not an endpoint
        return 1


class Blocker(Actor):
    """Blocks its node's event loop, as careless code in an endpoint would."""

    @endpoint
    async def block(self, seconds: float) -> float:
        time.sleep(seconds)  # noqa: ASYNC251  (the point: the loop is held)
        return seconds


class Slow(Actor):
    """Sleeps on request and records what it saw, for cancellation and backpressure tests."""

    def __init__(self) -> None:
        self.running = 0
        self.max_running = 0
        self.cancelled = 0
        self.finished = 0

    @endpoint
    async def sleep(self, seconds: float) -> float:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        self.finished += 1
        return seconds

    @endpoint
    async def report(self) -> dict[str, int]:
        return {
            "running": self.running,
            "max_running": self.max_running,
            "cancelled": self.cancelled,
            "finished": self.finished,
        }


class Streamer(Actor):
    def __init__(self) -> None:
        self.produced = 0
        self.closed = 0

    @endpoint
    async def count(self, n: int, delay: float = 0.0) -> AsyncIterator[int]:
        try:
            for i in range(n):
                self.produced += 1
                if delay:
                    await asyncio.sleep(delay)
                yield i
        finally:
            self.closed += 1

    @endpoint
    async def fail_after(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise RuntimeError(f"stream broke after {n}")

    @endpoint
    async def report(self) -> dict[str, int]:
        return {"produced": self.produced, "closed": self.closed}


class Failer(Actor):
    @endpoint
    async def fail(self, message: str) -> None:
        self._deep(message)

    def _deep(self, message: str) -> None:
        raise KeyError(message)


class PingPong(Actor):
    """Calls back into another actor, so traffic flows both ways on every socket."""

    @endpoint
    async def bounce(self, other: Any, n: int) -> int:
        results = await asyncio.gather(*[other.add(1) for _ in range(n)])
        return len(results)


class Relay(Actor):
    """Calls a third actor and reports how the call ended."""

    @endpoint
    async def relay(self, slow: Any, seconds: float) -> str:
        from rlasync import NodeLostError

        try:
            await slow.sleep(seconds)
        except NodeLostError as exc:
            return type(exc).__name__
        return "finished"


class Tasky(Actor):
    """Endpoints that need a current task from their first line, and results that cannot travel."""

    @endpoint
    async def with_timeout(self, seconds: float) -> str:
        async with asyncio.timeout(seconds):
            await asyncio.sleep(0)
        return "ok"

    @endpoint
    async def with_taskgroup(self, n: int) -> int:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(asyncio.sleep(0, result=i)) for i in range(n)]
        return sum(t.result() for t in tasks)

    @endpoint
    async def has_task(self) -> bool:
        return asyncio.current_task() is not None

    @endpoint
    async def too_big(self) -> int:
        return 2**70  # msgpack has no integer this large

    @endpoint
    async def cancels_itself(self) -> None:
        raise asyncio.CancelledError()


class Ticker(Actor):
    """Measures its node's event loop: the longest gap between ticks meant to be 10 ms apart."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    @endpoint
    async def report(self) -> dict[str, Any]:
        import sys

        return {"max_gap": self.max_gap, "torch": "torch" in sys.modules}


class Pumper(Actor):
    """Calls another actor every few milliseconds without waiting, until stopped."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    @endpoint
    async def start(self, counter: Any) -> None:
        async def pump() -> None:
            while True:
                asyncio.ensure_future(counter.add(1)).add_done_callback(
                    lambda f: f.cancelled() or f.exception()
                )
                await asyncio.sleep(0.005)

        self._task = asyncio.create_task(pump())


class MemberView(Actor):
    """What its node has heard of the cluster: tests wait on it instead of sleeping."""

    @endpoint
    async def sees(self, node_id: str) -> bool:
        """Whether this node still counts ``node_id`` as a live member (it asks nobody)."""
        return self.node.live_member(node_id) is not None
