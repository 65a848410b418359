"""``NodeRelay``: the newest versions one node has received, so the trainer sends each version
once per node, not once per engine.

    relay, first = NodeRelay.of(key, plan, slots=2, device)   # every engine of this process asks
    relay.put(7, staged_buffer)                               # the node's first engine, after receiving v7
    await relay.copy_into(staging, 7, timeout_s)              # each other engine of the node

A node is one process (the design card), so its engines share this object. The first engine of
a synchroniser (``key``) on a node takes the trainer's send over its pair group, as before, and
puts each version it receives here; the node's other engines copy the version from here (one
``memcpy``) instead of receiving it over the network: with eight engines on a node the trainer
sends an eighth of the bytes. (Engines on the trainer's own machine copy from the trainer's
relay in shared memory instead: ``SharedWeights``.)

On a GPU node the slots are pinned host memory, so a version received over NCCL goes to the
host once and each engine copies it to its own device asynchronously (written for CUDA; tested
where one is lent). A slot an engine is copying from is never overwritten; one that lags and
finds only newer versions here takes the newest instead (its puller asks for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import ClassVar

import torch

from .buckets import BucketPlan, bucket_starts
from .errors import SyncError


class NodeRelay:
    _relays: ClassVar[dict[str, NodeRelay]] = {}

    def __init__(self, plan: BucketPlan, *, slots: int, device: torch.device) -> None:
        self.plan, self.slots = plan, slots
        self._nbytes = bucket_starts(plan)[-1]
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self.datas: list[torch.Tensor] = []  # allocated at the first put: a node with one engine has none
        self.copiers = 0  # the node's engines that copy from it; none: nothing is put
        self.versions = [-1] * slots
        self._age, self._filled = [0] * slots, 0
        self._pins = [0] * slots  # copies reading each slot
        self._lock = threading.Lock()
        self._waiting: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}  # set on each put

    @classmethod
    def of(cls, key: str, plan: BucketPlan, *, slots: int, device: torch.device) -> tuple[NodeRelay, bool]:
        """This process's relay for synchroniser ``key`` (made on first use), and whether the
        caller is the first engine to ask: the one that receives versions and puts them here."""
        relay = cls._relays.get(key)
        if relay is not None and relay.plan.digest == plan.digest:
            relay.copiers += 1
            return relay, False
        relay = cls._relays[key] = cls(plan, slots=max(1, slots), device=device)
        return relay, True

    @classmethod
    def forget(cls, key: str) -> None:
        """Let the relay of ``key`` go (its filling engine left): the next engine to attach fills a new one."""
        cls._relays.pop(key, None)

    def put(self, version: int, buffer: torch.Tensor, wait_s: float = 30.0) -> None:
        """(the filling engine, in a thread) ``version``'s flat buffer, copied into the slot least
        recently filled that no engine is copying from (waiting up to ``wait_s`` for one: copies
        take a ``memcpy``'s time). Nothing, on a node where no other engine copies."""
        if not self.copiers:
            return
        if not self.datas:
            self.datas = [
                torch.empty(self._nbytes, dtype=torch.uint8, pin_memory=self._pin) for _ in range(self.slots)
            ]
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if version in self.versions:
                    return
                free = [i for i in range(self.slots) if not self._pins[i]]
                if free:
                    index = min(free, key=lambda i: self._age[i])
                    self._filled += 1
                    self._age[index], self.versions[index] = self._filled, -1
                    break
            if time.monotonic() > deadline:
                raise SyncError(f"node relay: every slot was being copied from for {wait_s:g} s")
            time.sleep(0.001)
        self.datas[index].copy_(buffer[: self.datas[index].numel()])
        with self._lock:
            self.versions[index] = version
        for loop, event in list(self._waiting.items()):
            loop.call_soon_threadsafe(event.set)

    async def copy_into(self, staging: torch.Tensor, version: int, timeout_s: float) -> None:
        """Copy ``version`` into ``staging`` once the node's filling engine has put it here
        (waiting up to ``timeout_s``); ``SyncError`` if only newer versions are here by then
        (the caller takes the newest) or none came."""
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        event = self._waiting.setdefault(loop, asyncio.Event())
        while True:
            event.clear()  # before looking: a put after the look sets it
            with self._lock:
                index = self.versions.index(version) if version in self.versions else None
                if index is not None:
                    self._pins[index] += 1
                newest = max(self.versions)
            if index is not None:
                break
            if newest > version:
                raise SyncError(f"node relay: waited for version {version}, the node holds {newest} now")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncError(
                    f"node relay: version {version} did not reach this node within weights.timeout_s={timeout_s:g} s "
                    f"(its first engine receives it; the node holds {newest})"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=left)
        try:
            await asyncio.to_thread(_copy, staging, self.datas[index])
        finally:
            with self._lock:
                self._pins[index] -= 1


def _copy(staging: torch.Tensor, source: torch.Tensor) -> None:
    """``source`` (host memory) into ``staging``: to a GPU from pinned memory asynchronously, and
    waited for on the same thread's stream before the slot may be overwritten."""
    staging[: source.numel()].copy_(source, non_blocking=staging.is_cuda)
    if staging.is_cuda:
        torch.cuda.current_stream(staging.device).synchronize()


__all__ = ["NodeRelay"]
