"""The router's index of engines by load picks exactly what a scan of every engine picks (least
loaded under the cap, then least used, then the earliest joined), over random sequences of
requests taken and released, other routers' load, caps and engines leaving. It is what keeps
picking O(log n) with hundreds of engines behind one router (the simulator runs 768)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rlasync.engines import Router, RouterConfig


class _Ref:
    def __init__(self, name: str) -> None:
        self.name, self.node_id = name, "node-0"


def _scan(router: Router, cap: int | None) -> Any:
    best = None
    for slot in router._slots.values():
        if cap is not None and slot.outstanding >= cap:
            continue
        if best is None or slot.key() < best.key():
            best = slot
    return best


@pytest.mark.parametrize("cap", [None, 2, 5])
def test_the_index_picks_what_a_scan_of_every_engine_picks(cap: int | None) -> None:
    rng = random.Random(cap or 0)
    for trial in range(60):
        engines = [_Ref(f"e{i}") for i in range(rng.randint(1, 12))]
        router = Router(engines, RouterConfig(max_inflight_per_engine=cap or 0, sticky_sessions=0))  # type: ignore[arg-type]
        live: list[tuple[Any, str]] = []
        for step in range(300):
            picked = router._index.least(cap)
            assert picked is _scan(router, cap), (trial, step)
            op = rng.random()
            if op < 0.5 and picked is not None:
                request = f"r{trial}-{step}"
                router._take(picked, None, request)
                live.append((picked, request))
            elif op < 0.8 and live:
                slot, request = live.pop(rng.randrange(len(live)))
                router._release(slot, request)
            elif op < 0.9:
                slot = rng.choice(list(router._slots.values()))
                slot.others = rng.randint(0, 5)  # another router's load, as a refresh reports it
                router._index.touch(slot)
            elif len(router._slots) > 1:
                name = rng.choice(list(router._slots))
                router.remove_engine(name)
                live = [(s, r) for s, r in live if s.ref.name != name]
        assert len(router._index) <= 4 * len(router._slots) + 64 + 1  # stale entries are swept
