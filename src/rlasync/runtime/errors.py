"""Errors of the actor runtime.

Recoverable and unrecoverable failures are different types: ``ActorError`` (the call ran
and raised; retrying may help) and ``CallTimeout`` (no answer in time) leave the peer
usable, while ``NodeLostError`` means the node is gone and every call to it will fail.
Each message names what to change.
"""

from __future__ import annotations


class RuntimeErrorBase(Exception):
    """Base of every error the runtime raises."""


class ActorError(RuntimeErrorBase):
    """An endpoint raised. Carries the remote exception's type, message and traceback."""

    def __init__(
        self, actor: str, method: str, remote_type: str, message: str, traceback: str = "", node: str = ""
    ) -> None:
        self.actor = actor
        self.method = method
        self.remote_type = remote_type
        self.message = message
        self.remote_traceback = traceback
        self.node = node
        where = f"{actor}.{method}" + (f" on {node}" if node else "")
        text = f"{where} raised {remote_type}: {message}"
        if traceback:
            text += "\n\n--- remote traceback (" + where + ") ---\n" + traceback.rstrip()
        super().__init__(text)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (
            type(self),
            (self.actor, self.method, self.remote_type, self.message, self.remote_traceback, self.node),
        )


class ActorNotFound(RuntimeErrorBase, LookupError):
    """No live actor has that name (never spawned, or its node died)."""


class NotAnEndpoint(RuntimeErrorBase, AttributeError):
    """The attribute called on an actor ref is not an ``@endpoint`` of the actor."""


class CallTimeout(RuntimeErrorBase, TimeoutError):
    """A call got no answer before its deadline. The callee is told to stop."""


class CallRefused(RuntimeErrorBase):
    """The callee refused the call before running it: this caller already runs as many calls
    there as ``runtime.max_calls_per_caller`` allows, or this node queues as many for that
    peer as ``runtime.max_queued_calls`` allows. Nothing ran; retrying later may succeed."""


class Forbidden(RuntimeErrorBase, PermissionError):
    """A member asked for what only another may do: join, leave or heartbeat as another node,
    declare a death (the head's), or spawn under a name that belongs to the runtime."""


class NodeLostError(RuntimeErrorBase, ConnectionError):
    """The node hosting the actor is dead (missed heartbeats, shut down, or unreachable).
    ``graceful``: it left on purpose (a clean shutdown), which nobody needs to be warned of."""

    graceful = False

    def __init__(self, node: str, detail: str, *, graceful: bool = False) -> None:
        self.node = node
        self.graceful = graceful
        super().__init__(f"{node} is lost: {detail}")


class JoinError(RuntimeErrorBase):
    """A node could not join the cluster (head unreachable, wrong secret, rank taken)."""


class ClusterStartError(RuntimeErrorBase):
    """A local cluster's node processes did not all start and join in time."""
