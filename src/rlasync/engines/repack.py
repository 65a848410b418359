"""Long-tail repacking: which turns move where. When requests wait (at a router's cap or in an
engine's queue) while some engines run only a few long turns, those engines hand their turns to
the fullest of them, the *tail engine*, and take new work themselves (Laminar's repack, DORA's
migration, RollPacker's tail rounds). ``Router.migrate`` moves each turn: its tokens stay with
the caller, the tail engine prefills them (the cost the simulator charges and the torch engine
pays), and every token keeps the version that made it.

    moves = repack_moves({"e0": ["r1"], "e1": ["r2", "r3"], "e2": [...]}, waiting=12, below=2, target_max=64)
    # [("r1", "e1")]: e0 gives its one turn to e1 and is free for the waiting requests

Its knobs are ``router.repack_below`` (0: off), ``router.repack_target_max`` and the router's
``load_refresh_s`` (how often it looks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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


__all__ = ["repack_moves"]
