"""The runtime across real node processes: calls, streaming, tensors, a dead node.

    .venv/bin/python examples/runtime_demo.py

Starts a 3-node local cluster (this process is the head), spawns actors on the other
nodes, and shows typed calls, a stream, a tensor round trip, a remote error with its
traceback, and what happens to calls when a node is killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

import torch

import rlasync


class Accumulator(rlasync.Actor):
    def __init__(self, start: float) -> None:
        self.total = start

    @rlasync.endpoint
    async def add(self, x: float) -> float:
        self.total += x
        return self.total

    @rlasync.endpoint
    async def where(self) -> str:
        return f"{self.node.node_id} (pid {os.getpid()})"

    @rlasync.endpoint
    async def countdown(self, n: int) -> AsyncIterator[int]:
        for i in range(n, 0, -1):
            await asyncio.sleep(0.05)
            yield i

    @rlasync.endpoint
    async def scale(self, t: torch.Tensor, factor: float) -> torch.Tensor:
        return t * factor

    @rlasync.endpoint
    async def divide(self, x: float) -> float:
        return self.total / x


async def main() -> None:
    config = rlasync.RuntimeConfig(heartbeat_interval_s=0.25, node_dead_after_s=2.0)
    started = time.perf_counter()
    async with rlasync.LocalCluster(nodes=3, config=config) as cluster:
        acc = await cluster.spawn(Accumulator, 1.0, node=1, name="acc")
        print(f"cluster of 3 up and first actor spawned in {time.perf_counter() - started:.2f}s")
        print("acc lives on", await acc.where())
        print("add(41) ->", await acc.add(41))

        other = await cluster.spawn(Accumulator, 0.0, node=2)
        same = await cluster.lookup("acc", Accumulator)
        print("looked up by name, add(1) ->", await same.add(1))

        print("stream:", [i async for i in acc.countdown(5)])
        t = torch.randn(4, 4, dtype=torch.bfloat16)
        print("bf16 tensor round trip exact:", torch.equal(await acc.scale(t, 2.0), t * 2.0))

        t0 = time.perf_counter()
        await asyncio.gather(*[acc.add(1) for _ in range(10_000)])
        print(f"10,000 pipelined calls in {time.perf_counter() - t0:.2f}s")

        try:
            await acc.divide(0)
        except rlasync.ActorError as exc:
            print(
                "remote error:",
                exc.remote_type,
                "-",
                exc.message,
                f"(traceback: {len(exc.remote_traceback.splitlines())} lines)",
            )

        pending = asyncio.ensure_future(other.countdown(1000).__anext__())
        os.kill(cluster.pid(2), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            await other.add(1)
            await asyncio.sleep(30)
        except rlasync.NodeLostError as exc:
            print(f"after SIGKILL of node-2: NodeLostError in {time.perf_counter() - t0:.2f}s: {exc}")
        pending.cancel()
        print("node-1 still answers:", await acc.add(0))
        print("members now:", [m.node_id for m in await cluster.members()])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rlasync.run(main())
