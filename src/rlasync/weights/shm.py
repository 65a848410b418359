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

The header (nonce, version, plan digest) guards every copy: an engine that cannot open the
file, or finds another nonce there (a different machine, container or mount namespace), is
not on the same host and takes the broadcast instead; a copy is only kept if the header
showed the same published version before and after it (the trainer marks the buffer as
changing before each step), so a torn read is an error, never a silent mix of versions.
"""

from __future__ import annotations

import os
import secrets
import time
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


class SharedWeights:
    """A header and the plan's flat buffer in one memory-mapped file."""

    def __init__(self, path: Path, plan: BucketPlan, nonce: int, *, owner: bool) -> None:
        self.path, self.plan, self.nonce, self.owner = path, plan, nonce, owner
        size = bucket_starts(plan)[-1]
        self._file = torch.from_file(str(path), shared=True, size=HEADER + size, dtype=torch.uint8)
        self.header = self._file[:HEADER].view(torch.int64)
        self.data = self._file[HEADER:]  # the plan's buckets, laid out as bucket_starts says

    @classmethod
    def create(cls, directory: str | os.PathLike[str], plan: BucketPlan) -> SharedWeights:
        """A new file (its size: the header and the plan's flat buffer), marked as changing."""
        nonce = secrets.randbits(62)
        path = Path(directory) / f"rlasync-weights-{os.getpid()}-{nonce:x}"
        size = HEADER + bucket_starts(plan)[-1]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: memory is taken as the parameters are written
        finally:
            os.close(fd)
        shared = cls(path, plan, nonce, owner=True)
        shared.header[0], shared.header[1], shared.header[2] = nonce, CHANGING, plan.digest
        return shared

    @classmethod
    def open(cls, offer: ShmOffer, plan: BucketPlan) -> SharedWeights | None:
        """The trainer's file, if this process sees the same one (else None: not the same host)."""
        path = Path(offer.path)
        try:
            if path.stat().st_size != HEADER + offer.nbytes or offer.nbytes != bucket_starts(plan)[-1]:
                return None
            shared = cls(path, plan, offer.nonce, owner=False)
        except (OSError, RuntimeError):
            return None
        if int(shared.header[0]) != offer.nonce or int(shared.header[2]) != plan.digest:
            shared.close()
            return None
        return shared

    @property
    def offer(self) -> ShmOffer:
        return ShmOffer(str(self.path), self.nonce, int(self.data.numel()))

    @property
    def version(self) -> int:
        return int(self.header[1])

    def publish(self, version: int) -> None:
        """The parameters in the buffer are ``version`` now (the trainer's side)."""
        self.header[1] = version

    def invalidate(self) -> None:
        """The trainer is about to change the parameters: copies made from now on fail."""
        self.header[1] = CHANGING

    def copy_into(self, staging: torch.Tensor, version: int, timeout_s: float) -> None:
        """Copy the buffer into ``staging`` once the trainer has published ``version`` (waiting up
        to ``timeout_s``); raise ``SyncError`` if it changed meanwhile."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.version) != version:
            if seen > version:
                raise SyncError(
                    f"shared-memory weights: waited for version {version}, the trainer published {seen}"
                )
            if time.monotonic() > deadline:
                raise SyncError(
                    f"shared-memory weights: version {version} was not published within weights.timeout_s={timeout_s:g} s "
                    f"(the trainer is at {seen}; raise the deadline if it is only slow)"
                )
            time.sleep(0.001)
        staging[: self.data.numel()].copy_(self.data)
        if self.version != version:
            raise SyncError(
                f"shared-memory weights: the trainer changed the parameters while version {version} was copied"
            )

    def close(self) -> None:
        """Unmap; the owner also removes the file (engines that mapped it keep their mapping)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
