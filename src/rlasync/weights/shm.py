"""The same-host fast path: parameters in a shared-memory file both processes map.

When the trainer's rank 0 and an engine share a machine, no byte needs a socket. Rank 0 lays
its parameters out as the bucket plan's flat buffer *inside* a file in ``weights.shm_dir``
(``/dev/shm``: memory, not disk), so its optimizer updates them in place there; a sync then
only writes the new version number into the file's header, and each engine on the machine
copies the buffer into its staging copy in one ``memcpy`` while it keeps decoding.

    # trainer rank 0                                   # an engine on the same machine
    shared = SharedWeights.create(dir, plan)           view = SharedWeights.open(offer, plan)
    flat_layout(plan, params, out=shared.data)         version = view.copy_into(staging, 7, timeout_s)
    shared.publish(7)       # after the step
    shared.invalidate()     # before the next step

With ``slots`` > 1 the file is the trainer node's *relay* (``weights.max_live_versions``): the
parameters stay in the trainer's own memory, and each version is copied into the next slot
(``hold``: one ``memcpy``), so the trainer goes on at once while engines copy the version from
its slot, and the pair groups of engines on other machines send from the same snapshot.

    relay = SharedWeights.create(dir, plan, slots=2)   # the trainer
    relay.hold(7, lambda slot: slot.copy_(flat))       # after the step: v7 in the next slot

The header (nonce, version, plan digest) guards every copy: an engine that cannot open the
file, or finds another nonce there (a different machine, container or mount namespace), is
not on the same host and takes the broadcast instead; a copy is only kept if the header
showed the same published version before and after it (the trainer marks the buffer as
changing before each step), so a torn read is an error, never a silent mix of versions.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from .buckets import BucketPlan, bucket_starts
from .errors import SyncError

HEADER = 64  # bytes before the data: int64 nonce, version, plan digest (the rest reserved)
CHANGING = -1  # the header's version while the trainer may be writing the parameters


class ShmOffer(msgspec.Struct, frozen=True, array_like=True):
    """What an engine needs to map the trainer's buffer: sent over the actor runtime."""

    path: str
    nonce: int
    nbytes: int  # of the data region (the plan's flat layout)
    slots: int = 1  # versions the file holds (``weights.max_live_versions``), one region each


def _stride(plan: BucketPlan) -> int:
    """Bytes of one slot: its header and the plan's flat buffer, so the next header is 64-byte aligned."""
    return HEADER + -(-bucket_starts(plan)[-1] // HEADER) * HEADER


class SharedWeights:
    """``slots`` regions in one memory-mapped file, each a header and the plan's flat buffer.

    One slot: the trainer keeps its parameters in it (``data``) and publishes them in place.
    Several (the relay, ``hold``): each version is a snapshot copied into the next slot, so the
    trainer may change its parameters at once while engines still copy the version, and the
    newest ``slots`` versions stay readable."""

    def __init__(self, path: Path, plan: BucketPlan, nonce: int, *, owner: bool, slots: int = 1) -> None:
        self.path, self.plan, self.nonce, self.owner, self.slots = path, plan, nonce, owner, slots
        size, stride = bucket_starts(plan)[-1], _stride(plan)
        self._file = torch.from_file(str(path), shared=True, size=stride * slots, dtype=torch.uint8)
        self.headers = [self._file[i * stride : i * stride + HEADER].view(torch.int64) for i in range(slots)]
        self.datas = [self._file[i * stride + HEADER : i * stride + HEADER + size] for i in range(slots)]
        self.header, self.data = self.headers[0], self.datas[0]  # the single slot's
        # The trainer's side of a relay: how many sends read each slot (pair threads release
        # them), and when each was filled (the oldest free one is overwritten next).
        self._pins, self._age, self._published = [0] * slots, [0] * slots, 0
        self._pin_lock = threading.Lock()

    @classmethod
    def create(cls, directory: str | os.PathLike[str], plan: BucketPlan, *, slots: int = 1) -> SharedWeights:
        """A new file (its size: ``slots`` headers and flat buffers), every slot marked as changing."""
        nonce = secrets.randbits(62)
        path = Path(directory) / f"rlasync-weights-{os.getpid()}-{nonce:x}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _stride(plan) * slots)  # sparse: memory is taken as the parameters are written
        finally:
            os.close(fd)
        shared = cls(path, plan, nonce, owner=True, slots=slots)
        for header in shared.headers:
            header[0], header[1], header[2] = nonce, CHANGING, plan.digest
        return shared

    @classmethod
    def open(cls, offer: ShmOffer, plan: BucketPlan) -> SharedWeights | None:
        """The trainer's file, if this process sees the same one (else None: not the same host)."""
        path = Path(offer.path)
        try:
            if offer.nbytes != bucket_starts(plan)[-1] or path.stat().st_size != _stride(plan) * offer.slots:
                return None
            shared = cls(path, plan, offer.nonce, owner=False, slots=offer.slots)
        except (OSError, RuntimeError):
            return None
        if int(shared.header[0]) != offer.nonce or int(shared.header[2]) != plan.digest:
            shared.close()
            return None
        return shared

    def hold(
        self, version: int, fill: Callable[[torch.Tensor], None], *, wait_s: float = 60.0
    ) -> torch.Tensor:
        """(the trainer's side) ``fill`` a slot with ``version`` and publish it there; that slot's
        buffer. The slot taken is the oldest one no pair group is sending from (``pin``): a
        send in progress never reads a version being overwritten. If every other slot is being
        sent from (an engine ``slots - 1`` versions behind and still receiving), this waits up
        to ``wait_s`` for one to end, then raises ``SyncError``. An engine copying a slot as it
        is overwritten sees it (``copy_into``) and takes the newer version instead."""
        for index, header in enumerate(self.headers):
            if int(header[1]) == version:
                return self.datas[index]  # held already (a sync tried again)
        deadline = time.monotonic() + wait_s
        while (free := self._free_slot()) is None:
            if time.monotonic() > deadline:
                raise SyncError(
                    f"weights relay: every slot is being sent to an engine {self.slots - 1} version(s) behind "
                    f"after {wait_s:g} s; raise weights.max_live_versions to let engines lag further"
                )
            time.sleep(0.001)
        fill(self.datas[free])
        self.headers[free][1] = version
        return self.datas[free]

    def _free_slot(self) -> int | None:
        """The slot least recently filled that nothing is being sent from, marked as changing
        (under the lock, so no send can pin the version it held from now on)."""
        with self._pin_lock:
            free = [i for i in range(self.slots) if not self._pins[i]]
            if not free:
                return None
            index = min(free, key=lambda i: self._age[i])
            self._age[index] = self._published = self._published + 1
            self.headers[index][1] = CHANGING  # copies of the version it held fail from now on
            return index

    def pin(self, version: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """(the trainer's side) ``version``'s slot, kept from being overwritten until the returned
        release is called (once; later calls do nothing): a pair group sends from it meanwhile.
        ``SyncError`` if no slot holds ``version`` any more."""
        with self._pin_lock:
            index = self._slot(version)
            if index is None:
                held = sorted(int(h[1]) for h in self.headers if int(h[1]) != CHANGING)
                raise SyncError(f"weights relay: version {version} is no longer held (it holds {held})")
            self._pins[index] += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._pin_lock:
                if not released:
                    released = True
                    self._pins[index] -= 1

        return self.datas[index], release

    @property
    def offer(self) -> ShmOffer:
        return ShmOffer(str(self.path), self.nonce, int(self.data.numel()), self.slots)

    @property
    def version(self) -> int:
        """The newest version published (``CHANGING``: none)."""
        return max(int(header[1]) for header in self.headers)

    def _slot(self, version: int) -> int | None:
        return next((i for i, header in enumerate(self.headers) if int(header[1]) == version), None)

    def publish(self, version: int) -> None:
        """The parameters in the buffer are ``version`` now (the trainer's side)."""
        self.header[1] = version

    def invalidate(self) -> None:
        """The trainer is about to change the parameters: copies made from now on fail. (A relay
        holds snapshots, which the parameters' changes do not touch.)"""
        if self.slots == 1:
            self.header[1] = CHANGING

    def copy_into(self, staging: torch.Tensor, version: int, timeout_s: float) -> None:
        """Copy the buffer into ``staging`` once the trainer has published ``version`` (waiting up
        to ``timeout_s``); raise ``SyncError`` if it changed meanwhile."""
        deadline = time.monotonic() + timeout_s
        while (slot := self._slot(version)) is None:
            seen = self.version
            held = [int(h[1]) for h in self.headers if int(h[1]) != CHANGING]
            if seen > version and (self.slots == 1 or (len(held) == self.slots and min(held) > version)):
                raise SyncError(
                    f"shared-memory weights: waited for version {version}, the trainer published {seen}"
                    + (f" (its relay holds versions {sorted(held)} now)" if self.slots > 1 else "")
                )
            if time.monotonic() > deadline:
                raise SyncError(
                    f"shared-memory weights: version {version} was not published within weights.timeout_s={timeout_s:g} s "
                    f"(the trainer is at {seen}; raise the deadline if it is only slow)"
                )
            time.sleep(0.001)
        staging[: self.data.numel()].copy_(self.datas[slot])
        if int(self.headers[slot][1]) != version:
            raise SyncError(
                f"shared-memory weights: the trainer changed the parameters while version {version} was copied"
            )

    def close(self) -> None:
        """Unmap; the owner also removes the file (engines that mapped it keep their mapping)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
