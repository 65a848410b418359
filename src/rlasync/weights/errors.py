"""The weight sync's errors, and how the synchroniser tells a failed transfer from a bug.

``SyncError`` is a failed transfer: a peer died or stalled past ``weights.timeout_s``, or the
two sides disagreed (a version or plan). The synchroniser answers one by taking engines out or
forming a new group generation (``is_transfer_failure``); any other error is a bug or a bad
config, which no retry can help, and is raised.
"""

from __future__ import annotations

import torch.distributed as dist

from ..runtime import ActorError, ActorNotFound, CallTimeout, NodeLostError


class SyncError(RuntimeError):
    """A weight transfer failed (a peer died, stalled past the deadline, or disagreed on the
    plan). The group is unusable: drop it and make a new generation."""


# A transfer failed, seen here: ours, or the call to the other side died or did not answer.
LOCAL_FAILURES: tuple[type[BaseException], ...] = (
    SyncError,
    CallTimeout,
    NodeLostError,
    ActorNotFound,
    TimeoutError,
)
# A transfer failed on the other side of an actor call (an engine's or a trainer rank's
# process): ours, or torch.distributed's own when a collective broke.
REMOTE_FAILURES: tuple[type[BaseException], ...] = (SyncError, dist.DistBackendError, dist.DistNetworkError)


def raised_remotely(error: BaseException, *types: type[BaseException]) -> bool:
    """Whether ``error`` is an actor call's ``ActorError`` for an exception of one of ``types``
    raised by the endpoint, in another process.

    By name, and only here: the actor runtime does not send the remote exception itself (it may
    not even be importable on this side), only its type's name (``ActorError.remote_type``,
    qualified by its module); so across processes a type can only be recognised by its name,
    which this compares with each class's ``__name__`` (never with string literals). The module
    is not compared: a type re-exported elsewhere is still the same type.
    """
    if not isinstance(error, ActorError):
        return False
    name = error.remote_type.rsplit(".", 1)[-1]
    return any(name == cls.__name__ for cls in types)


def is_transfer_failure(error: BaseException) -> bool:
    """A failed transfer, which a new group generation (or taking the engine out) answers:
    locally one of ``LOCAL_FAILURES``, from another process one of ``REMOTE_FAILURES``."""
    return isinstance(error, LOCAL_FAILURES) or raised_remotely(error, *REMOTE_FAILURES)


__all__ = [
    "LOCAL_FAILURES",
    "REMOTE_FAILURES",
    "SyncError",
    "is_transfer_failure",
    "raised_remotely",
]
