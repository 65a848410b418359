"""Calls other nodes make to this node's actors: the ROUTER socket and the calls in progress.

A call runs its endpoint eagerly up to the first real wait (an endpoint that answers at once
costs no task), then as a task that the caller can cancel (``Cancel``) and that stops when
the caller's node is declared dead. A streaming endpoint sends at most
``runtime.stream_window`` items ahead of the caller's acknowledgements.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import types
from typing import TYPE_CHECKING, Any

import zmq

from ..transport import Call, Cancel, DecodeError, Error, Reply, StreamAck, StreamEnd, StreamItem
from ..transport.zmq_io import SocketPump
from .actor import Actor, endpoints_of
from .errors import ActorNotFound, CallTimeout, NotAnEndpoint

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger(__name__)


class _Serving:
    """A call this node is running for a peer; streaming calls also track send credit."""

    __slots__ = ("task", "credit", "more")

    def __init__(self, task: asyncio.Task[None], credit: int) -> None:
        self.task = task
        self.credit = credit
        self.more: asyncio.Event | None = None


class Server:
    """Serves the calls that reach this node's ROUTER socket."""

    def __init__(self, node: Node, router: zmq.Socket[Any]) -> None:
        self.node = node
        self.loop = node.loop
        self.codec = node.codec
        self.serving: dict[tuple[bytes, int], _Serving] = {}
        self.pump = SocketPump(router, self._on_request, recheck_s=node.config.io_recheck_s, loop=self.loop, routed=True)

    def forget_caller(self, node_id: str) -> None:
        """Stop serving the calls of a node that was declared dead: nobody awaits their answers."""
        ident = node_id.encode()
        for key, serving in list(self.serving.items()):
            if key[0] == ident:
                serving.task.cancel()

    async def stop(self, timeout: float) -> None:
        """Cancel every call in progress and wait up to ``timeout`` s for them to unwind."""
        tasks = [s.task for s in self.serving.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def _on_request(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.node.stats_.malformed_frames += 1
            return
        ident = frames[0] if type(frames[0]) is bytes else frames[0].bytes
        try:
            msg = self.codec.decode(frames[1:])
        except DecodeError as exc:
            self.node.stats_.malformed_frames += 1
            log.debug("dropped malformed request from %r: %s", ident[:32], exc)
            return
        kind = type(msg)
        if kind is Call:
            self._serve(ident, msg)
        elif kind is Cancel:
            serving = self.serving.get((ident, msg.id))
            if serving is not None:
                serving.task.cancel()
        elif kind is StreamAck:
            serving = self.serving.get((ident, msg.id))
            if serving is not None:
                serving.credit += msg.n
                if serving.more is not None:
                    serving.more.set()
        else:
            self.node.stats_.malformed_frames += 1

    def _serve(self, ident: bytes, call: Call) -> None:
        actor = self.node._actors.get(call.actor)
        if actor is None:
            detail = "it was never spawned here, or it stopped"
            return self._fail(ident, call.id, "no_actor", ActorNotFound, f"no actor named {call.actor!r} on {self.node.node_id} ({detail})")
        ep = endpoints_of(type(actor)).get(call.method)
        if ep is None or ep.streaming != call.stream:
            what = "a streaming" if call.stream else "a unary"
            return self._fail(ident, call.id, "no_endpoint", NotAnEndpoint, f"{call.method!r} is not {what} endpoint of actor {call.actor!r}")
        self.node.stats_.calls_served += 1
        if call.stream:
            task = self.loop.create_task(self._run_stream(ident, call, ep, actor))
            self.serving[(ident, call.id)] = _Serving(task, self.node.config.stream_window)
            return
        # Run the endpoint eagerly up to its first real wait: an endpoint that answers
        # without waiting costs no task and no extra loop iteration.
        try:
            args, kwargs = ep.convert_args(call.args, call.kwargs)
            coro = ep.fn(actor, *args, **kwargs)
            blocked_on = coro.send(None)
        except StopIteration as done:
            if call.id:
                self._send(ident, Reply(call.id, self.codec.lift_one(done.value)))
            return
        except Exception as exc:
            if call.id:
                self._send(ident, error_reply(call.id, exc))
            return
        task = self.loop.create_task(self._finish_unary(ident, call.id, _resume(coro, blocked_on)))
        if call.id:
            self.serving[(ident, call.id)] = _Serving(task, 0)

    def _fail(self, ident: bytes, call_id: int, code: str, kind: type, message: str) -> None:
        if call_id:
            self._send(ident, Error(call_id, code, f"{kind.__module__}.{kind.__qualname__}", message))

    def _send(self, ident: bytes, msg: Any) -> None:
        try:
            frames = self.codec.encode(msg)
        except TypeError as exc:  # an unencodable return value: tell the caller why
            frames = self.codec.encode(Error(msg.id, "raised", "TypeError", str(exc), traceback.format_exc()))
        self.pump.send([ident, *frames], copy=False)  # a caller that is gone: counted by the pump

    async def _finish_unary(self, ident: bytes, call_id: int, rest: Any) -> None:
        try:
            result = await rest
        except asyncio.CancelledError:
            return  # the caller cancelled or timed out, or this node is stopping: no reply wanted
        except Exception as exc:
            if call_id:
                self._send(ident, error_reply(call_id, exc))
            return
        finally:
            if call_id:
                self.serving.pop((ident, call_id), None)
        if call_id:
            self._send(ident, Reply(call_id, self.codec.lift_one(result)))

    async def _run_stream(self, ident: bytes, call: Call, ep: Any, actor: Actor) -> None:
        key = (ident, call.id)
        timeout = self.node.config.call_timeout_s
        try:
            args, kwargs = ep.convert_args(call.args, call.kwargs)
            items = ep.fn(actor, *args, **kwargs)
            try:
                async for item in items:
                    serving = self.serving[key]
                    while serving.credit <= 0:  # the caller has not consumed enough: wait for its ack
                        serving.more = asyncio.Event()
                        try:
                            async with asyncio.timeout(timeout):
                                await serving.more.wait()
                        except TimeoutError:
                            raise CallTimeout(f"the caller consumed nothing for {timeout:g}s (runtime.call_timeout_s)") from None
                    serving.credit -= 1
                    self._send(ident, StreamItem(call.id, self.codec.lift_one(item)))
            finally:
                await items.aclose()
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._send(ident, error_reply(call.id, exc))
        else:
            self._send(ident, StreamEnd(call.id))
        finally:
            self.serving.pop(key, None)


@types.coroutine
def _resume(coro: Any, blocked_on: Any) -> Any:
    """Drive a coroutine that was started by hand and is now waiting on ``blocked_on``.

    This is ``yield from`` for a coroutine past its first step: what the task sends or
    throws in goes to ``coro``, what ``coro`` yields goes to the task.
    """
    to_yield = blocked_on
    try:
        while True:
            try:
                sent = yield to_yield
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                to_yield = coro.throw(exc)
            else:
                to_yield = coro.send(sent)
    except StopIteration as done:
        return done.value


def error_reply(call_id: int, exc: BaseException) -> Error:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return Error(call_id, "raised", name, str(exc), "".join(traceback.format_exception(exc)))


