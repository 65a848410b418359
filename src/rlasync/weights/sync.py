"""Sending and receiving one version of the parameters, bucket by bucket.

    # trainer rank 0                                  # each engine process
    sender = WeightSender(group, plan)                receiver = WeightReceiver(group, plan)
    stats = sender.send(named_tensors, version=7)     version, staged = receiver.receive()
                                                      engine.update_weights(staged, version)  # the swap

A sync is a header (version, the plan's digest, bucket count) then the buckets in order. The
sender posts every bucket without waiting: a tensor too big to pack is its own bucket and
travels from its own memory, the others are packed into two buffers that take turns; a receiver
posts every bucket at once into one fresh staging buffer, and its tensors are views into it
(no copy). It stages a complete copy of the parameters and only then hands it over, so its engine keeps decoding during the
transfer and pauses just for the swap (``update_weights``), and never serves a mix of two
versions: a sync that fails midway leaves the engine on its old version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import msgspec
import torch

from .buckets import BucketPlan, bucket_starts, contiguous_bucket, flat_views, pack, unpack
from .errors import SyncError
from .group import WeightGroup


class SyncStats(msgspec.Struct, kw_only=True):
    version: int
    bytes: int
    buckets: int
    seconds: float


def _buffers(plan: BucketPlan, device: torch.device | str) -> list[torch.Tensor]:
    largest = max(plan.sizes, default=0)
    return [
        torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2 if len(plan.sizes) > 1 else 1)
    ]


class WeightSender:
    def __init__(self, group: WeightGroup, plan: BucketPlan, *, device: torch.device | str = "cpu") -> None:
        if group.rank != 0:
            raise ValueError("the sender is rank 0 of the weight group")
        self.group, self.plan = group, plan
        self._buffers = _buffers(plan, device)

    def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        started = time.perf_counter()
        plan = self.plan
        header = torch.tensor([version, plan.digest, len(plan.sizes)], dtype=torch.int64)
        self.group.broadcast(header, "the header")
        works: list[tuple[int, object]] = []  # every bucket's transfer, in order
        buffer_user: dict[int, int] = {}  # pack buffer -> the position in `works` of its last transfer
        for index, size in enumerate(plan.sizes):
            buffer = contiguous_bucket(plan, index, tensors)  # already laid out as the bucket: no copy
            if buffer is None:
                slot = index % len(self._buffers)
                if slot in buffer_user:  # that buffer's previous bucket must have left before reuse
                    previous, work = works[buffer_user[slot]]
                    self.group.wait(work, f"bucket {previous}")
                buffer = pack(plan, index, tensors, out=self._buffers[slot])
                buffer_user[slot] = len(works)
            works.append((index, self.group.broadcast_async(buffer[:size])))  # ops run in the order posted
        for index, work in works:
            self.group.wait(work, f"bucket {index}")
        return SyncStats(
            version=version,
            bytes=plan.total_bytes,
            buckets=len(plan.sizes),
            seconds=time.perf_counter() - started,
        )


class StagingRing:
    """Staging buffers for whole versions, each laid out as the plan's flat buffer, taking
    turns. With two (double buffering), the tensors of a version stay valid until the version
    after next is staged, so an engine may swap them in by reference and serve them meanwhile;
    with one, the engine must copy a version in before the next is staged."""

    def __init__(self, plan: BucketPlan, *, device: torch.device | str = "cpu", depth: int = 2) -> None:
        if depth not in (1, 2):
            raise ValueError(f"staging depth is 1 or 2, got {depth}")
        self.plan, self.device, self.depth = plan, device, depth
        starts = bucket_starts(plan)
        self.starts, self.nbytes = starts[:-1], starts[-1]
        self._buffers: list[torch.Tensor] = []
        self._turn = 0
        self.last = torch.empty(0, dtype=torch.uint8)  # the buffer ``next`` gave last

    def next(self) -> torch.Tensor:
        """The buffer the next version lands in (allocated on first use)."""
        if len(self._buffers) < self.depth:
            self._buffers.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
        buffer = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        self.last = buffer
        return buffer

    def buckets(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[start : start + size] for start, size in zip(self.starts, self.plan.sizes)]

    def tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named tensors staged in ``buffer``, as views (no copy)."""
        return flat_views(self.plan, buffer)


class WeightReceiver:
    def __init__(
        self,
        group: WeightGroup,
        plan: BucketPlan,
        *,
        device: torch.device | str = "cpu",
        ring: StagingRing | None = None,
    ) -> None:
        if group.rank == 0:
            raise ValueError("receivers are ranks 1.. of the weight group (rank 0 sends)")
        self.group, self.plan = group, plan
        self.ring = ring or StagingRing(plan, device=device)

    def receive(self, on_bucket: Callable[[int], None] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Stage one version: ``(version, named tensors)``. Buckets land straight in the ring's
        next staging buffer and the tensors are views into it (no copy; see ``StagingRing``
        for how long they stay valid). ``on_bucket(i)`` is called as bucket ``i`` lands."""
        plan = self.plan
        header = torch.zeros(3, dtype=torch.int64)
        self.group.broadcast(header, "the header")
        version, digest, count = (int(v) for v in header)
        if digest != plan.digest or count != len(plan.sizes):
            self.group.close()  # the sender is mid-sync with a layout we cannot read
            raise SyncError(
                f"weight sync v{version}: the sender's bucket plan differs from this engine's; exchange the plan again"
            )
        buckets = self.ring.buckets(self.ring.next())
        works = [self.group.broadcast_async(bucket) for bucket in buckets]  # posted in order, run in order
        if works:
            # Block once, on the last bucket, rather than waking for each: this process also
            # runs the engine, whose decoding wants the interpreter meanwhile.
            self.group.wait(works[-1], f"bucket {len(works) - 1}")
        staged: dict[str, torch.Tensor] = {}
        for index, work in enumerate(works):
            self.group.wait(work, f"bucket {index}")  # done already, or fails as the transfer did
            staged.update(unpack(plan, index, buckets[index]))
            if on_bucket is not None:
                on_bucket(index)
        return version, staged
