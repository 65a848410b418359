"""Where a node's calls go: to an actor of this node, or through the peer of the process it lives on.

``Calls.route`` is the route behind ``NodeContext.call`` and ``.stream``. It owns the node's
connections out (one ``peer.Peer`` per process it calls, made on first use) and what it knows
of the processes gone: a call to one of those fails at once with ``NodeLostError``, and one to
a restarted process at the same address is refused there (``Call.to``) instead of answered for
its predecessor. A call to an actor of this node skips sockets and serialisation, but its
arguments are checked as a remote call's are, so that a wrong argument is the same error
wherever the actor lives. An ``ActorRef`` travels on the wire as its ``ActorInfo``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from .actor import Actor, endpoints_of
from .caller import current_caller
from .context import Convert, NodeView
from .errors import CallTimeout, NodeLostError, NotAnEndpoint, RuntimeErrorBase, actor_error
from .peer import CallTask, Peer
from .ref import ActorRef
from .types import ActorInfo, NodeInfo

EXT_ACTOR_REF = 16  # the codec's extension type of an ActorRef


class CallsHost(NodeView, Protocol):
    """What routing needs of its node besides a ``NodeView`` (every peer shares its context;
    a stopping node connects to no one new): its own actors."""

    def local_actor(self, name: str) -> Actor: ...


class Calls:
    """The calls of the node ``node`` describes, and its connections to the other processes."""

    def __init__(self, node: CallsHost) -> None:
        self._node = node
        self.peers: dict[str, Peer] = {}  # by incarnation: one connection per process
        self.dead: dict[str, str] = {}  # process (incarnation) -> why it is dead
        self.left: set[str] = set()  # processes (incarnations) that shut down cleanly

    def peer(self, info: NodeInfo) -> Peer:
        """The connection to ``info``'s process, made on first use.

        A process the head declared dead fails fast. Any other call names the process it
        means (``Call.to``), so a restarted process at the same address refuses it instead
        of answering for its predecessor.
        """
        reason = self.dead.get(info.incarnation)
        if reason is not None:
            raise NodeLostError(
                info.node_id,
                f"{reason} (that process is gone; look its actors up again)",
                graceful=info.incarnation in self.left,
            )
        peer = self.peers.get(info.incarnation)
        if peer is not None:
            return peer
        if self._node.stopping:
            raise NodeLostError(self._node.node_id, "this node is stopping")
        peer = self.peers[info.incarnation] = Peer(self._node.context, info)
        return peer

    def route(
        self,
        actor: ActorInfo,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout: float | None,
        convert: Convert,
        *,
        stream: bool = False,
    ) -> Any:
        """Send a call to an actor here, or through the peer of its node: a unary one
        (``NodeContext.call``: its answer, an ``asyncio.Future``), or with ``stream`` a streaming
        one (``NodeContext.stream``: its items, an async iterator)."""
        timeout = timeout or self._node.config.call_timeout_s
        here = actor.node.node_id == self._node.node_id
        if stream:
            if here:
                return self._stream_local(actor.name, method, args, kwargs, timeout)
            return self.peer(actor.node).stream(actor.name, method, args, kwargs, timeout, convert)
        if here:
            return CallTask(self._call_local(actor.name, method, args, kwargs, timeout), loop=self._node.loop)
        try:
            peer = self.peer(actor.node)
        except NodeLostError as exc:
            return CallTask(_raise(exc), loop=self._node.loop)
        return peer.call(actor.name, method, args, kwargs, timeout, convert)

    async def _call_local(
        self, name: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float
    ) -> Any:
        # A call to an actor of this node is made by this process, whoever this task serves
        # (the head spawning for node-1 registers its actor as the head, not as node-1). The call
        # runs in a task of its own (``route``), so this does not leak into the caller's.
        current_caller.set(None)
        node_id = self._node.node_id
        actor = self._node.local_actor(name)
        ep = endpoints_of(type(actor)).get(method)
        if ep is None or ep.streaming:
            raise NotAnEndpoint(f"{method!r} is not a unary endpoint of actor {name!r}")
        try:
            async with asyncio.timeout(timeout) as deadline:
                # The checks a remote call's arguments get on arrival, so that a wrong argument is
                # the same error wherever the actor lives (and the callee gets what it annotated).
                args, kwargs = ep.convert_args(args, kwargs)
                return await ep.fn(actor, *args, **kwargs)
        except TimeoutError as exc:
            if deadline.expired():
                raise CallTimeout(
                    f"call to {name}.{method} on {node_id} got no answer within {timeout:.3g}s; "
                    "raise runtime.call_timeout_s or pass .options(timeout=...)"
                ) from None
            raise actor_error(exc, name, method, node_id) from None
        except RuntimeErrorBase:
            raise
        except Exception as exc:
            raise actor_error(exc, name, method, node_id) from exc

    async def _stream_local(
        self, name: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: float
    ) -> AsyncIterator[Any]:
        node_id = self._node.node_id
        actor = self._node.local_actor(name)
        ep = endpoints_of(type(actor)).get(method)
        if ep is None or not ep.streaming:
            raise NotAnEndpoint(f"{method!r} is not a streaming endpoint of actor {name!r}")
        try:
            args, kwargs = ep.convert_args(args, kwargs)  # as a remote stream's arguments are checked
        except Exception as exc:
            raise actor_error(exc, name, method, node_id) from exc
        items = ep.fn(actor, *args, **kwargs)
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        item = await items.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise CallTimeout(
                        f"stream {name}.{method} sent no item for {timeout:.3g}s; raise runtime.call_timeout_s"
                    ) from None
                except RuntimeErrorBase:
                    raise
                except Exception as exc:
                    raise actor_error(exc, name, method, node_id) from exc
                yield item
        finally:
            await items.aclose()

    def tell_service(self, info: NodeInfo, method: str, args: list[Any]) -> None:
        """Send a one-way call to ``info``'s ``_node`` service (no reply, no wait)."""
        if info.node_id != self._node.node_id and not self._node.stopping:
            self.peer(info).send_oneway("_node", method, args)

    # -- processes gone ---------------------------------------------------------------------
    def forget(self, incarnation: str, reason: str, graceful: bool) -> None:
        """The process ``incarnation`` is gone: calls to it fail fast from now on."""
        self.dead[incarnation] = reason
        if graceful:
            self.left.add(incarnation)

    def lost(self, node_id: str, incarnation: str | None, reason: str, graceful: bool) -> None:
        """Fail the calls pending to ``node_id``'s process ``incarnation`` (None: any of its)."""
        for peer in list(self.peers.values()):
            if peer.info.node_id == node_id and incarnation in (None, peer.info.incarnation, peer.to or None):
                peer.mark_lost(NodeLostError(node_id, reason, graceful=graceful))

    def close(self) -> None:
        """This node stops: every call still pending fails (gracefully)."""
        for peer in self.peers.values():
            peer.mark_lost(NodeLostError(peer.info.node_id, f"{self._node.node_id} stopped", graceful=True))

    def in_flight(self) -> dict[str, int]:
        """Unary calls sent and not answered yet, by the node they went to."""
        counts: dict[str, int] = {}
        for peer in self.peers.values():
            counts[peer.info.node_id] = counts.get(peer.info.node_id, 0) + peer.inflight
        return counts

    def adopt(self, placeholder: str, info: NodeInfo) -> None:
        """The connection made to an address before knowing whose it is (``placeholder``) is
        ``info``'s process."""
        peer = self.peers.pop(placeholder, None)
        if peer is not None:
            peer.info = info
            self.peers[info.incarnation] = peer

    # -- actor refs on the wire -------------------------------------------------------------
    @staticmethod
    def ref_to_wire(ref: ActorRef) -> Any:
        return ref.info

    def ref_from_wire(self, data: Any) -> ActorRef:
        info = msgspec.convert(data, ActorInfo)
        return ActorRef(self._node.context, info, _loaded_class(info.cls))


async def _raise(exc: BaseException) -> Any:
    raise exc


def _loaded_class(path: str) -> type | None:
    """The actor class ``module:QualName`` if its module is loaded here (a ref that arrived as an
    argument then decodes results into their annotated types, like one from ``spawn``)."""
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if obj is not None and qualname else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None
