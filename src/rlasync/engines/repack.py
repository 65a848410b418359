"""Moving turns between engines: which turns move where, at each load refresh of a router.

Two policies, each a pure function of what the router knows:

- **Queued turns even out** (``rebalance_moves``, ``router.rebalance_queued``). An engine
  starts at most its batch (the torch engine's ``max_batch``, vLLM's ``max_num_seqs``); what a
  router sends past that waits in the engine's own queue. Least-outstanding routing evens the
  *counts*, not the work: the engine that drew the longer answers still has turns queued when
  the other has run out of work (the end of a synchronous step, or admissions held by the
  staleness bound), and that engine idles while they wait. A queued turn has made no token, so
  moving it costs nothing but the move: the engine with a queue hands turns to the least loaded
  one until the two are within one of each other.
- **The long tail packs** (``repack_moves``, ``router.repack_below``). When requests wait while
  some engines run only a few long turns, those engines hand their turns to the fullest of them,
  the *tail engine*, and take new work themselves (Laminar's repack, DORA's migration,
  RollPacker's tail rounds). A running turn moved is prefilled again by its target.

``Router.migrate`` makes each move: the turn's tokens stay with the caller (an agent loop), the
target prefills them (the cost the simulator charges and the torch engine pays), and every
token keeps the version that made it.

    rebalance_moves({"e0": 9, "e1": 3}, {"e0": ["r9", "r8", "r7"]})
    # [("r9", "e1"), ("r8", "e1"), ("r7", "e1")]: e0's queue moves to e1, which had room
    repack_moves({"e0": ["r1"], "e1": ["r2", "r3"], "e2": [...]}, waiting=12, below=2, target_max=64)
    # [("r1", "e1")]: e0 gives its one turn to e1 and is free for the waiting requests

Their knobs are ``router.rebalance_queued``, ``router.repack_below`` (0: off),
``router.repack_target_max`` and the router's ``load_refresh_s`` (how often it looks).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def rebalance_moves(load: Mapping[str, int], queued: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(request id, target engine) pairs that even out engines' queues. ``load``: each engine's
    requests, running and queued (every router's); ``queued``: for each engine with a queue,
    the ids of this router's turns taken to wait in it, the first to move first (the router
    names its newest there, as many as the engine reports waiting: an engine starts its queue
    in arrival order; where other routers' turns wait there too, one named may be running, and
    moved it is prefilled again). A turn moves from the most loaded donor to the least loaded
    engine while the donor stays at least as loaded as the target after the move, so no turn
    moves back at the next look."""
    loads = dict(load)
    targets = [(n, name) for name, n in loads.items()]
    heapq.heapify(targets)
    moves: list[tuple[str, str]] = []
    for donor in sorted(queued, key=lambda name: -loads[name]):
        for request_id in queued[donor]:
            while targets and loads[targets[0][1]] != targets[0][0]:
                heapq.heappop(targets)  # stale: its load changed since it was pushed
            if not targets:
                break
            n, target = targets[0]
            if loads[donor] - n < 2:
                break
            moves.append((request_id, target))
            loads[donor] -= 1
            loads[target] = n + 1
            heapq.heapreplace(targets, (n + 1, target))
            heapq.heappush(targets, (loads[donor], donor))
    return moves


def repack_moves(
    running: Mapping[str, Sequence[str]], waiting: int, *, below: int, target_max: int
) -> list[tuple[str, str]]:
    """(request id, target engine) pairs. ``running``: each engine's outstanding request ids;
    ``waiting``: requests waiting anywhere. With ``below`` > 0 and requests waiting, the engines
    running from 1 to ``below`` turns give them to the fullest of them, while it has room for
    all of a donor's turns under ``target_max`` (then to the next fullest): the emptiest engines
    are freed first, and no engine is both a donor and a target."""
    if below <= 0 or waiting <= 0:
        return []
    small = sorted(
        (name for name, ids in running.items() if 0 < len(ids) <= below), key=lambda n: (-len(running[n]), n)
    )
    moves: list[tuple[str, str]] = []
    first, last = 0, len(small) - 1
    room = {name: target_max - len(running[name]) for name in small}
    while first < last:
        target, donor = small[first], small[last]
        turns = running[donor]
        if room[target] < len(turns):  # the target is full: the next fullest takes over
            first += 1
            continue
        moves += [(request_id, target) for request_id in turns]
        room[target] -= len(turns)
        last -= 1
    return moves


__all__ = ["rebalance_moves", "repack_moves"]
