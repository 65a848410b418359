"""``ActorRef``: a handle to an actor on any node; its endpoints are attributes.

``await ref.add(2)`` sends a call and returns its answer; ``ref.add.options(timeout=5)``
overrides the deadline for one call; ``async for x in ref.stream(...)`` streams. A call
returns an ``asyncio.Future`` at once (no task is created on the hot path): await it,
``asyncio.gather`` or ``asyncio.wait`` many, or keep it; cancelling it cancels the remote
call. ``asyncio.create_task(ref.add(2))`` works too (a node lets its loop's tasks await a call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .actor import endpoints_of
from .context import HasContext, NodeContext
from .errors import NotAnEndpoint
from .types import ActorInfo, NodeInfo


class ActorRef:
    """A handle to one actor. Cheap to copy, and can be sent to other actors as an argument.

    ``node``: the (started) node whose calls it makes, or that node's ``NodeContext``.
    """

    __slots__ = ("_context", "info", "_cls", "_bound")

    def __init__(self, node: NodeContext | HasContext, info: ActorInfo, cls: type | None = None) -> None:
        self._context = node if isinstance(node, NodeContext) else node.context
        self.info = info
        self._cls = cls
        self._bound: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def node_id(self) -> str:
        return self.info.node.node_id

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        bound = self._bound.get(attr)
        if bound is not None:
            return bound
        streaming = self.info.endpoints.get(attr)
        if streaming is None:
            known = ", ".join(sorted(self.info.endpoints)) or "none"
            raise NotAnEndpoint(
                f"{attr!r} is not an endpoint of actor {self.info.name!r} ({self.info.cls or 'unknown class'}); "
                f"its endpoints: {known}. Mark the method with @rlasync.endpoint to call it remotely."
            )
        convert = None
        if self._cls is not None:
            ep = endpoints_of(self._cls).get(attr)
            convert = ep.result_converter() if ep is not None else None
        if streaming:
            bound = RemoteStream(self, attr, None, convert, self._context.stream)
        else:
            bound = RemoteEndpoint(self, attr, None, convert, self._context.call)
        self._bound[attr] = bound
        return bound

    def __repr__(self) -> str:
        return f"ActorRef({self.info.name!r} on {self.node_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other.info == self.info

    def __hash__(self) -> int:
        return hash((self.info.name, self.info.node.incarnation))


class RemoteEndpoint:
    """A unary endpoint of a remote (or local) actor; ``route`` sends its calls (``NodeContext.call``)."""

    __slots__ = ("ref", "method", "timeout", "convert", "route")

    def __init__(
        self,
        ref: ActorRef,
        method: str,
        timeout: float | None,
        convert: Callable[[Any], Any] | None,
        route: Callable[..., Any],
    ) -> None:
        self.ref = ref
        self.method = method
        self.timeout = timeout
        self.convert = convert
        self.route = route

    def __call__(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self.route(self.ref.info, self.method, list(args), kwargs, self.timeout, self.convert)

    def options(self, *, timeout: float | None = None) -> RemoteEndpoint:
        """The same endpoint with its own deadline (seconds) for the calls made through it."""
        return type(self)(self.ref, self.method, timeout, self.convert, self.route)

    def __repr__(self) -> str:
        return f"<endpoint {self.ref.name}.{self.method}>"


class RemoteStream(RemoteEndpoint):
    """A streaming endpoint; ``timeout`` bounds the wait for each item; ``route``: ``NodeContext.stream``."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        return self.route(self.ref.info, self.method, list(args), kwargs, self.timeout, self.convert)


def actor_info(name: str, cls: type, node: NodeInfo) -> ActorInfo:
    """What a ref to the actor ``name`` of class ``cls`` on ``node`` knows of it: its endpoints
    (streaming or not) and its class's ``module:QualName``."""
    endpoints = {n: ep.streaming for n, ep in endpoints_of(cls).items()}
    return ActorInfo(name, node, endpoints, f"{cls.__module__}:{cls.__qualname__}")
