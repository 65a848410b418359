"""The router's view of its engines: one ``EngineSlot`` per engine (its load, its requests), and
a ``SlotIndex`` that keeps them by load, so picking the least loaded of hundreds of engines
(the simulator runs 768 behind one router) costs O(log n), not a scan of every engine."""

from __future__ import annotations

import heapq

from ..runtime import ActorRef


class EngineSlot:
    """What the router knows about one engine."""

    __slots__ = ("ref", "outstanding", "others", "assigned", "alive", "requests", "waiting", "order")

    def __init__(self, ref: ActorRef, order: int = 0) -> None:
        self.ref = ref
        self.order = order  # when it joined: ties go to the earliest
        self.outstanding = 0
        self.others = 0
        self.assigned = 0
        self.alive = True
        self.requests: dict[str, None] = {}  # request ids outstanding here, oldest first (for abort)
        self.waiting = 0  # requests queued inside the engine, as of its last report

    @property
    def load(self) -> int:
        """Requests on the engine: this router's outstanding and other routers' (reported)."""
        return self.outstanding + self.others

    def key(self) -> tuple[int, int, int]:
        """Least loaded first, then least used, then the earliest."""
        return (self.load, self.assigned, self.order)


class SlotIndex:
    """``slots`` (the router's live engines, by name) ordered by ``EngineSlot.key`` in a heap.
    An entry is pushed at each change of a slot's key (``touch``); one whose key is no longer
    its slot's, or whose slot left, is stale and dropped when it surfaces."""

    def __init__(self, slots: dict[str, EngineSlot]) -> None:
        self._slots = slots
        self._heap: list[tuple[tuple[int, int, int], int, EngineSlot]] = []
        self._pushes = 0  # breaks ties between two entries of one slot (never compare slots)

    def __len__(self) -> int:
        return len(self._heap)

    def touch(self, slot: EngineSlot) -> None:
        """``slot``'s key changed (or it joined): index it again (its old entry goes stale)."""
        self._pushes += 1
        heapq.heappush(self._heap, (slot.key(), self._pushes, slot))
        if len(self._heap) > 4 * len(self._slots) + 64:  # mostly stale: rebuild
            self._heap = []
            for live in self._slots.values():
                self._pushes += 1
                self._heap.append((live.key(), self._pushes, live))
            heapq.heapify(self._heap)

    def least(self, cap: int | None) -> EngineSlot | None:
        """The least loaded engine with fewer than ``cap`` requests outstanding (None: no cap)."""
        capped = []
        best = None
        while self._heap:
            key, _, slot = self._heap[0]
            if not slot.alive or self._slots.get(slot.ref.name) is not slot or key != slot.key():
                heapq.heappop(self._heap)  # stale
            elif cap is not None and slot.outstanding >= cap:
                capped.append(heapq.heappop(self._heap))
            else:
                best = slot
                break
        for entry in capped:
            heapq.heappush(self._heap, entry)
        return best


__all__ = ["EngineSlot", "SlotIndex"]
