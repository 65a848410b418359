"""How the endpoint answers: a JSON body, a stream of server-sent events, and every failure as
an ``APIError`` in OpenAI's shape (``{"error": {...}}``).

A stream's status is sent before its first event, so an error after that cannot change it: it
is the stream's last event, in OpenAI's shape, which the ``openai`` client raises. An engine's
or router's failure becomes the status a client can act on (``api_error``): 429 when the
engines are busy, 503 when none can answer, 400 when the request does not fit the model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from ..engines.protocol import EngineError, EngineLostError
from ..engines.router import NoEngineError, RouterBusyError
from ..runtime import ActorError
from .schema import APIError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
"""A stream's last event."""


def json_response(content: Any, status: int = 200) -> Any:
    from starlette.responses import Response

    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json")


def error_response(exc: APIError) -> Any:
    return json_response(exc.body(), status=exc.status)


def sse(content: Any) -> bytes:
    """One server-sent event holding ``content`` as JSON."""
    return b"data: " + msgspec.json.encode(content) + b"\n\n"


def event_stream(chunks: AsyncIterator[bytes]) -> Any:
    """A server-sent-events response of ``chunks``. An error once the stream has begun (its
    status already sent) is its last event, in OpenAI's shape: the client raises it."""
    from starlette.responses import StreamingResponse

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:
            yield sse(exc.body())

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def api_error(exc: BaseException) -> BaseException:
    """An engine's or router's failure as the status a client can act on."""
    if isinstance(exc, APIError | asyncio.CancelledError):
        return exc
    if isinstance(exc, RouterBusyError):
        return APIError(429, str(exc), type="rate_limit_error", code="engines_busy")
    if isinstance(exc, NoEngineError | EngineLostError | ActorError | ConnectionError):
        return APIError(503, f"{type(exc).__name__}: {exc}", type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineError):
        code = "context_length_exceeded" if "max_seq_len" in str(exc) else None
        return APIError(400, str(exc), code=code)
    log.error("the endpoint failed a request", exc_info=exc)
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error")
