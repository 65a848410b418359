"""Who sent the call an endpoint is serving: ``Caller``, and ``current_caller`` while it runs.

The server (``server.Server``) knows each caller by what its connection proved, and sets
``current_caller`` for the endpoint it runs; the runtime's own actors (``membership``) read it
to refuse what only a given node may ask. None means the call comes from this very process.
"""

from __future__ import annotations

import contextvars

from .types import NodeInfo, process_claim


class Caller:
    """Who sent a call. Over TCP, the CURVE key it authenticated with (``key``): no peer can
    speak as another by naming it. Over ``ipc://`` (a socket folder only this user can enter)
    there is no handshake, and the identity the peer set (``claim``, ``node-1:<incarnation>``)
    is taken at its word. One ``Caller`` per principal, however many connections it opens:
    ``running`` counts its calls being served now, over all of them."""

    __slots__ = ("key", "claim", "running", "connections", "dead")

    def __init__(self, key: str, claim: str) -> None:
        self.key = key
        self.claim = claim
        self.running = 0
        self.connections = 0  # routing ids it speaks through now
        self.dead = False  # its process was declared dead: it is served no more

    def is_node(self, info: NodeInfo) -> bool:
        """Whether this caller is the process ``info`` describes."""
        if self.key:
            return self.key == info.key
        return self.claim == process_claim(info.node_id, info.incarnation)

    def __str__(self) -> str:
        return f"key {self.key[:12]}..." if self.key else repr(self.claim)


# The caller of the endpoint running now (None: a call from this process). Membership and
# the node service read it to refuse what only a given node may ask.
current_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("rlasync_caller", default=None)
