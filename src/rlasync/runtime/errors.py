"""Errors of the actor runtime.

Recoverable and unrecoverable failures are different types: ``ActorError`` (the call ran
and raised; retrying may help) and ``CallTimeout`` (no answer in time) leave the peer
usable, while ``NodeLostError`` means the node is gone and every call to it will fail.
Each message names what to change.

The helpers at the end turn exceptions into wire errors and back (``error_reply``,
``remote_error``), wrap what an endpoint of this node raised (``actor_error``), and tell a
cancellation of a call from an endpoint's own ``CancelledError`` (``cancelled_from_outside``).
"""

from __future__ import annotations

import asyncio
import traceback as tb
from typing import Any

from ..transport import Error as ErrorMessage


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

    def __reduce__(self) -> tuple[Any, ...]:
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


def missing_secret() -> ValueError:
    """The error for TCP between nodes without a cluster secret."""
    return ValueError(
        "TCP between nodes is authenticated: give every node the same cluster secret "
        "(secret=... or the RLASYNC_CLUSTER_SECRET environment variable)"
    )


def not_started(node_id: str) -> RuntimeError:
    """The error for using a node before ``start`` (or ``async with``)."""
    return RuntimeError(f"{node_id} has not started: await node.start() (or use `async with node`) first")


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error inside a log line or another error's message: the first line of its text, cut at
    ``limit`` characters, or its type's name when it has no text (torch's errors run to pages)."""
    text = str(error)
    return text.splitlines()[0][:limit] if text.strip() else type(error).__name__


def wire_name(kind: type) -> str:
    """The name an exception type travels under: ``module.QualName`` (a builtin: ``QualName``)."""
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def error_reply(call_id: int, exc: BaseException) -> ErrorMessage:
    """The wire error that answers call ``call_id`` whose endpoint raised ``exc``."""
    return ErrorMessage(call_id, "raised", wire_name(type(exc)), str(exc), "".join(tb.format_exception(exc)))


def actor_error(exc: BaseException, actor: str, method: str, node: str) -> ActorError:
    """``exc``, raised by ``actor.method`` on this node, as the ``ActorError`` a remote caller gets."""
    error = error_reply(0, exc)
    return ActorError(actor, method, error.type, error.message, error.traceback, node)


# Runtime errors that cross the wire keep their type (the rest arrive as ActorError).
RUNTIME_ERRORS: dict[str, type[RuntimeErrorBase]] = {
    wire_name(cls): cls for cls in (ActorNotFound, NotAnEndpoint, CallTimeout, CallRefused, Forbidden)
}


def remote_error(msg: ErrorMessage, actor: str, method: str, node: str) -> RuntimeErrorBase:
    """The exception a call to ``actor.method`` on ``node`` raises for the wire error ``msg``:
    ``NodeLostError`` when the process it meant is gone (code ``gone``), a runtime error as its
    own type, anything else as ``ActorError``."""
    if msg.code == "gone":
        return NodeLostError(node, msg.message)
    runtime_type = RUNTIME_ERRORS.get(msg.type)
    if runtime_type is not None:
        return runtime_type(msg.message)
    return ActorError(actor, method, msg.type, msg.message, msg.traceback, node)


def lost_again(error: NodeLostError) -> NodeLostError:
    """A fresh ``NodeLostError`` like ``error``, for one more call to a lost peer (each call
    raises its own), ``graceful`` included: a node that shut down cleanly stays one."""
    return NodeLostError(error.node, str(error).split(": ", 1)[-1], graceful=error.graceful)


def cancelled_from_outside() -> bool:
    """Whether the current task was cancelled by ``Task.cancel`` (a caller, or a stopping node),
    rather than its code letting a ``CancelledError`` of its own out."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
