"""Wire messages of the actor runtime: one msgspec Struct per kind, one kind byte per frame.

A message travels as ZeroMQ frames ``[body, *side_frames]`` (a ROUTER adds the peer's
identity in front). The body is one kind byte naming the Struct, then that Struct as
msgpack; side frames carry large tensors and bytes out of band (see ``codec``).
"""

from __future__ import annotations

from typing import Any

import msgspec


class Call(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Invoke ``actor.method(*args, **kwargs)``. ``id`` 0 means one-way: no reply is sent."""

    id: int
    actor: str
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    stream: bool = False  # the endpoint is an async generator: reply with items
    to: str = ""  # the callee process (incarnation) the caller means; "" = whichever listens
    timeout: float = 0.0  # the caller's deadline in seconds: the callee gives up after it too


class Reply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The return value of a unary call."""

    id: int
    value: Any = None


class Error(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call failed on the callee. ``code`` says how, ``type``/``traceback`` say where."""

    id: int
    code: str  # one of ERROR_CODES
    type: str = ""
    message: str = ""
    traceback: str = ""


class StreamItem(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One value yielded by a streaming endpoint."""

    id: int
    value: Any = None


class StreamEnd(msgspec.Struct, array_like=True, gc=False):
    """A streaming endpoint finished normally."""

    id: int


class Cancel(msgspec.Struct, array_like=True, gc=False):
    """The caller gave up (cancelled, timed out, closed the stream): stop the call."""

    id: int


class StreamAck(msgspec.Struct, array_like=True, gc=False):
    """The caller consumed ``n`` more items: the callee may send ``n`` more (credit)."""

    id: int
    n: int


# gone: the process the caller meant no longer listens there; fenced: the caller's own process
# was declared dead by the head, so it is served no more (and should stop).
ERROR_CODES = (
    "raised",
    "no_actor",
    "no_endpoint",
    "bad_request",
    "timeout",
    "gone",
    "fenced",
    "busy",
    "forbidden",
)

# One byte per kind; the decoder for each is built once for its exact type.
KIND_OF: dict[type[msgspec.Struct], bytes] = {
    Call: b"\x01",
    Reply: b"\x02",
    Error: b"\x03",
    StreamItem: b"\x04",
    StreamEnd: b"\x05",
    Cancel: b"\x06",
    StreamAck: b"\x07",
}
TYPE_OF: dict[bytes, type[msgspec.Struct]] = {kind: cls for cls, kind in KIND_OF.items()}

Message = Call | Reply | Error | StreamItem | StreamEnd | Cancel | StreamAck
