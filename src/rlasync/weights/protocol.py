"""What the members of a weight transfer send each other: ``GroupAddress``, where and how a
generation of the weight group meets.

The synchroniser builds one per generation and hands it to every member (trainer rank 0 and
each broadcast engine, across the wire to actors), so the members cannot disagree on a field.
"""

from __future__ import annotations

import msgspec


class GroupAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how one generation of the weight group meets: the same for every member.

    A member's rank is not in it: rank is what differs between members (0 is the trainer,
    1.. the broadcast engines), so it travels beside the address, and the trainer's side,
    always rank 0, takes none."""

    host: str
    """The group's rendezvous store: trainer rank 0's node as the engines reach it."""
    port: int
    size: int
    """Members: trainer rank 0 and every broadcast engine (1: no engine takes the broadcast)."""
    timeout_s: float
    """The deadline of joining and of every collective (``weights.timeout_s``)."""
    generation: int
    """A new one after each failure: its keys in the store are fresh, the store is the same."""
    backend: str
    """``gloo`` or ``nccl``; ``""`` lets trainer rank 0 pick by its device (an engine needs it named)."""
    peer: str = ""
    """The one engine of a pair group (gloo: trainer rank 0 and one engine, ``size`` 2), so a dead
    or cut engine fails only its own transfer; ``""``: one group of every broadcast engine (NCCL,
    whose broadcast is pipelined)."""
