"""``PeerSenders``: the trainer's sending side of the weight groups, one pair group per engine.

    senders = PeerSenders(plan, device="cpu")
    senders.join(address, store=store, local_host=host)   # address.peer: that engine's pair group
    senders.post(weights, version)                        # returns at once; each pair sends on its thread
    senders.drop("engine-2")                              # taken out of rotation: its group goes

Over gloo a broadcast from rank 0 is one send to each other rank anyway, so a group per engine
costs the trainer no bandwidth, and buys fault isolation: an engine that died or was cut off
fails (or stalls) only its own pair's transfer; the others finish at their own pace, and the
trainer's training thread never waits on any of them (each pair sends on a thread of its own,
versions in order). The synchroniser learns what each engine staged from the engine; a send to
an engine it has taken out is abandoned (its thread ends at the group's deadline).

Each send reads a snapshot: a slot of the trainer's relay, pinned until the send ends (``post``'s
``pin``: the relay never overwrites it meanwhile), or, without a relay, the parameters, which
the trainer does not change until the synchroniser returns. So each live engine receives one
whole version. A pair dropped mid-send releases its pin at once: what it still reads goes only
to an engine already out of rotation.

NCCL keeps one group of every engine (``address.peer == ""``): its broadcast is pipelined, and
a send to it blocks until every engine has it, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..runtime.errors import first_line
from .buckets import BucketPlan
from .group import WeightGroup
from .protocol import GroupAddress
from .sync import WeightSender

log = logging.getLogger(__name__)


Job = tuple[Mapping[str, torch.Tensor], int, Callable[[], None]]
"""A version to send: its tensors, its number, and what to call once they are no longer read
(the relay slot's release)."""


def _nothing() -> None:
    return None


class _Pair:
    """One engine's pair group: its sender and the daemon thread its sends run on, in order (a
    daemon: a send stuck on a dead engine never holds the process's exit)."""

    def __init__(self, sender: WeightSender, peer: str) -> None:
        self.sender, self.peer = sender, peer
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._sending: Job | None = None
        self.busy = False
        threading.Thread(target=self._serve, name=f"rlasync-weights-{peer}", daemon=True).start()

    def post(
        self, weights: Mapping[str, torch.Tensor], version: int, done: Callable[[], None] = _nothing
    ) -> None:
        self._queue.put((weights, version, done))

    def _serve(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                self.busy, self._sending = True, job
                try:
                    self.sender.send(job[0], job[1])
                except Exception as exc:  # the engine's stage says what it got: this is the trainer's view
                    log.info("weight send of version %d to %s failed: %s", job[1], self.peer, first_line(exc))
                    return  # the group is closed: the synchroniser forms a new one or drops the engine
                finally:
                    self.busy, self._sending = False, None
                    job[2]()
        finally:
            # Here, not in close(): a group dropped while a send is inside it would block its
            # dropper until the send's deadline (the communicator waits for its work).
            self.sender.group.close()
            self._release_queued()

    def _release_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[2]()

    def close(self) -> None:
        """Stop after the send in progress, if any (one stuck on a dead engine ends at its
        deadline). What it was sending is released now: the engine is out of rotation, so
        a version overwritten under it can reach no one who would serve it."""
        sending = self._sending
        if sending is not None:
            sending[2]()
        self._release_queued()
        self._queue.put(None)


class PeerSenders:
    def __init__(self, plan: BucketPlan, *, device: torch.device | str = "cpu") -> None:
        self.plan, self.device = plan, device
        self._pairs: dict[str, _Pair] = {}
        self._group: WeightSender | None = None  # NCCL: one group of every engine

    def join(self, address: GroupAddress, *, store: Any, local_host: str) -> None:
        """Become rank 0 of ``address`` (blocks until its engine(s) join, under its deadline); it
        replaces the group of the same peer, if any."""
        if address.peer:
            self.drop(address.peer)
        elif self._group is not None:
            self._group.group.close()
            self._group = None
        group = WeightGroup.at(address, 0, store=store, local_host=local_host)
        sender = WeightSender(group, self.plan, device=self.device)
        if address.peer:
            self._pairs[address.peer] = _Pair(sender, address.peer)
        else:
            self._group = sender

    def drop(self, peer: str) -> None:
        """Let go of ``peer``'s pair group (taken out of rotation, or about to join again)."""
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.close()

    @property
    def peers(self) -> list[str]:
        return list(self._pairs)

    @property
    def busy(self) -> bool:
        """Is a pair inside a send (perhaps stuck on a dead engine until its deadline)?"""
        return any(pair.busy for pair in list(self._pairs.values()))

    def __bool__(self) -> bool:
        return bool(self._pairs) or self._group is not None

    def post(
        self,
        weights: Mapping[str, torch.Tensor],
        version: int,
        peers: Iterable[str] | None = None,
        *,
        pin: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """Send ``version`` to every pair (or those named) on their own threads and return at
        once; over one NCCL group, send it and return when every engine has it. ``pin``: called
        once per pair sent to, it returns what to call when that send no longer reads
        ``weights`` (a relay slot kept from being overwritten meanwhile)."""
        # A copy: a pair may join or go on another thread meanwhile (the trainer forms pairs off
        # its training thread).
        for name in list(self._pairs) if peers is None else peers:
            pair = self._pairs.get(name)
            if pair is not None:
                pair.post(weights, version, pin() if pin is not None else _nothing)
        if self._group is not None:
            self._group.send(weights, version)

    def close(self) -> None:
        for peer in list(self._pairs):
            self.drop(peer)
        if self._group is not None:
            self._group.group.close()
            self._group = None


__all__ = ["PeerSenders"]
