"""``EngineWeights``: the receiving side of the weight sync, in an engine's process.

    weights = EngineWeights(engine)                   # any Engine; EngineActor holds one
    mode = await weights.attach(plan, offer)          # once: "shm" (same machine) or "broadcast"
    await weights.join(address, rank)                 # broadcast engines: a rank of the weight group
    await weights.stage(7, timeout_s)                 # the version lands in a staging copy; decoding goes on
    commit = await weights.commit(7, "keep")         # the engine takes it whole at its next step

Staging and committing are two steps so that a synchroniser with several engines can stage
the version on all of them first and only then let them switch, close together, and so a
version is taken whole or not at all: an engine never serves a mix of two versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import msgspec
import torch

from .adapters import EngineAdapters, engine_adapters
from .buckets import BucketPlan
from .commit import Commit, Interrupt, take_version
from .errors import SyncError
from .group import WeightGroup
from .node_relay import NodeRelay
from .protocol import GroupAddress
from .shm import SharedWeights, ShmOffer
from .sync import StagingRing, WeightReceiver

Transport = Literal["shm", "broadcast", "node"]


class EngineWeights:
    """Receives versions for ``engine`` (anything with ``update_weights``; an engine with
    ``swap_weights`` takes a version by reference, from a double-buffered staging ring): a
    ``WeightSink`` for an engine in this process, and what an ``EngineActor`` serves."""

    def __init__(self, engine: Any, *, device: torch.device | str | None = None) -> None:
        self.engine = engine
        model = getattr(engine, "model", None)
        first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.plan: BucketPlan | None = None
        self.transport: Transport = "broadcast"
        self._ring: StagingRing | None = None
        self._shared: SharedWeights | None = None
        self._group: WeightGroup | None = None
        self._receiver: WeightReceiver | None = None
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._node: NodeRelay | None = None  # this node's relay: filled by this engine, or copied from
        self._node_key = ""
        self._adapters: EngineAdapters | None = None  # a LoRA plan: how this engine takes adapters

    @property
    def version(self) -> int:
        return int(self.engine.weight_version)

    async def attach(
        self,
        plan: bytes,
        offer: Any = None,
        *,
        double_buffer: bool = True,
        node_relay: str = "",
        slots: int = 2,
    ) -> Transport:
        """Take the plan (sent once) and, given the trainer's shared-memory offer, map it if this
        process sees the same file: then versions are copied from it (``shm``). Else, with
        ``node_relay`` (the synchroniser's key), the first engine of this node to attach takes
        the broadcast and keeps each version in the node's relay (``slots`` versions), and the
        node's other engines copy from there (``node``); without it, every engine takes the
        broadcast."""
        self.plan = msgspec.msgpack.decode(plan, type=BucketPlan)
        if self.plan.lora_scale and self._adapters is None:  # once: later, the engine's weights are merged
            self._adapters = engine_adapters(self.engine, self.plan)
        # Swapping by reference needs the version served to outlive the next one's staging.
        depth = 2 if double_buffer and hasattr(self.engine, "swap_weights") else 1
        self._ring = StagingRing(self.plan, device=self.device, depth=depth)
        self._shared = None
        if offer is not None:  # on a GPU too: each version copied from host memory onto it
            self._shared = SharedWeights.open(msgspec.convert(offer, ShmOffer), self.plan)
        self.transport = "shm" if self._shared is not None else "broadcast"
        if self._shared is None and node_relay:
            self._node, first = NodeRelay.of(node_relay, self.plan, slots=slots, device=self.device)
            self._node_key = node_relay if first else ""
            self.transport = "broadcast" if first else "node"
        return self.transport

    async def join(self, address: GroupAddress, rank: int, local_host: str = "") -> None:
        """Become ``rank`` of the weight group's generation at ``address`` (rank 0, the trainer,
        hosts its store); ``local_host``: this process's address as the others reach it."""
        if self.plan is None or self._ring is None:
            raise SyncError("join before attach: the synchroniser sends the plan first")
        if (
            address.backend == "nccl" and self.device.type != "cuda"
        ):  # NCCL moves GPU memory: stage on this process's GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._ring = StagingRing(self.plan, device=self.device, depth=self._ring.depth)
        previous = self._group
        here = (address.host, address.port)
        store = previous.store if previous is not None and previous.address == here else None
        self.close_group()
        self._group = await asyncio.to_thread(
            WeightGroup.at, address, rank, store=store, local_host=local_host
        )
        self._receiver = WeightReceiver(self._group, self.plan, ring=self._ring)

    async def stage(self, version: int, timeout_s: float) -> float:
        """Receive ``version`` into a staging copy (the engine decodes meanwhile); returns seconds."""
        started = time.perf_counter()
        if self._shared is not None and self._ring is not None:
            shared, ring = self._shared, self._ring
            buffer = ring.next()
            await asyncio.to_thread(shared.copy_into, buffer, version, timeout_s)
            staged = (version, ring.tensors(buffer))
        elif self.transport == "node" and self._node is not None and self._ring is not None:
            buffer = self._ring.next()
            await self._node.copy_into(buffer, version, timeout_s)
            staged = (version, self._ring.tensors(buffer))
        elif self._receiver is not None:
            staged = await asyncio.to_thread(self._receiver.receive)
            if staged[0] != version:
                raise SyncError(f"weight sync: expected version {version}, the trainer sent {staged[0]}")
            if self._node is not None and self._ring is not None:  # the node's other engines copy it
                await asyncio.to_thread(self._node.put, version, self._ring.last)
        else:
            raise SyncError("stage before join: this engine is in no weight group and maps no shared memory")
        if self._adapters is not None:  # merged into weights here, while the engine decodes
            staged = (version, await asyncio.to_thread(self._adapters.prepare, staged[1]))
        self._staged = staged
        return time.perf_counter() - started

    async def commit(
        self, version: int, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> Commit:
        """The engine takes the staged ``version`` at its own step boundary; what happens to its
        running turns is ``interrupt`` (``weights.commit``). Returns how long it paused."""
        if self._staged is None or self._staged[0] != version:
            have = "nothing" if self._staged is None else f"version {self._staged[0]}"
            raise SyncError(f"commit of version {version}, but {have} is staged here")
        _, tensors = self._staged
        self._staged = None
        by_reference = (
            hasattr(self.engine, "swap_weights") and self._ring is not None and self._ring.depth == 2
        )

        async def swap() -> float | None:
            if self._adapters is not None:
                return await self._adapters.take(self.engine, tensors, version)
            if by_reference:
                return float(await self.engine.swap_weights(tensors, version))
            await self.engine.update_weights(tensors, version)  # copies: the staging buffer is reused
            return None

        return await take_version(
            self.engine, swap, version=version, interrupt=interrupt, drain_timeout_s=drain_timeout_s
        )

    async def alive(self, within_s: float) -> bool:
        """An engine in this process always answers."""
        return True

    def close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._receiver = None, None

    def close(self) -> None:
        self.close_group()
        self._shared = None
        if self._node_key:  # the next engine of this node to attach fills a new relay
            NodeRelay.forget(self._node_key)
        self._node = None
