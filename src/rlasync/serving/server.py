"""The endpoint's HTTP server: a table of routes on the node's own event loop, and what every
request passes before its route (the key, the limits, the body) and after (its error in
OpenAI's shape, its count for ``/metrics``).

Built on Starlette (requests, and streamed responses that end when the client goes away) and uvicorn
(HTTP/1.1 with the httptools parser), both maintained and small; uvicorn's ``Server`` runs as a
task on the running loop, so the endpoint shares its node's process and loop with the engine,
and its signal handling is left to the node. aiohttp would do as well; Starlette's responses
cancel a stream's generation when the client disconnects, which we would otherwise write.

A route (``route``) takes the request, decoded from its body and checked, and its recording
(None when not recording). The key: a recording server takes only the live keys of ``recordings`` (``Authorization: Bearer
<key>``, or an ``X-Trajectory-Id`` header), else 401, and keeps a call sent with
``X-Rlasync-Train: false`` aside (answered, not trained on); another takes ``api_key`` where one is
set. Limits: ``max_request_bytes`` (413), ``max_concurrent_requests`` (429; a stream holds its
slot until it ends), ``request_timeout_s`` (504).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..config.endpoint import TRAIN_HEADER, EndpointConfig
from ..metrics.timings import Timings
from .recording import Recording
from .responses import api_error, error_response, json_response, sse
from .schema import APIError, decode_request

log = logging.getLogger(__name__)

TRAJECTORY_HEADER = "x-trajectory-id"

Guarded = Callable[[bytes, Recording | None], Awaitable[Any]]
"""What runs behind the key and the limits: the request's body and recording in, a response out."""

Route = Callable[[Any, Recording | None], Awaitable[Any]]
"""A route: its request (decoded and checked) and recording in, a response out."""


class EndpointError(RuntimeError):
    """The endpoint could not start (its address is taken, or the server did not come up)."""


class Server:
    def __init__(
        self, config: EndpointConfig, model_name: str, recordings: dict[str, Recording] | None
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.recordings = recordings  # the live keys; None: not recording (``api_key`` checked)
        self.url = ""
        self.active = 0
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        # Counted for Prometheus (``metric_families``): labels are our routes and statuses, so few.
        self._counts: dict[tuple[str, int], int] = {}
        self._seconds: dict[str, Timings] = {}
        self._routes: dict[tuple[str, str], Callable[[Any], Awaitable[Any]]] = {
            ("GET", "/v1/models"): functools.partial(self._guarded, handle=self._listing),
            ("GET", "/health"): self._health,
        }

    def route(self, method: str, path: str, handle: Route, request: type[Any]) -> None:
        """Answer ``method path`` with ``handle``, behind the key and the limits; the body is
        decoded as ``request`` and checked (its fields, then its model) before it is handed on."""

        async def decoded(body: bytes, rec: Recording | None) -> Any:
            req = decode_request(body, request)
            req.check()
            self.check_model(req.model)
            return await handle(req, rec)

        self._routes[(method, path)] = functools.partial(self._guarded, handle=decoded)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI application: a table of routes in front of Starlette's requests and
        responses (its router and middleware cost a third of a request's time here)."""
        from starlette.requests import Request

        if scope["type"] != "http":
            return
        started = time.perf_counter()
        request = Request(scope, receive)
        method, path = scope["method"], scope["path"].rstrip("/")
        route = path if any(p == path for _, p in self._routes) else "other"
        handle = self._routes.get((method, path))
        if handle is None and method == "GET" and path.startswith("/v1/models/"):
            model = functools.partial(self._model, name=path.removeprefix("/v1/models/"))
            handle = functools.partial(self._guarded, handle=model)
            route = "/v1/models/{model}"
        if handle is not None:
            response = await handle(request)
        elif route != "other":
            response = error_response(
                APIError(405, f"{path} does not take {method}", code="method_not_allowed")
            )
        else:
            response = error_response(APIError(404, f"no route {method} {path}", code="not_found"))
        try:
            await response(scope, receive, send)
        finally:  # a stream is counted when it ends (or its client goes away)
            key = (route, response.status_code)
            self._counts[key] = self._counts.get(key, 0) + 1
            self._seconds.setdefault(route, Timings()).observe(time.perf_counter() - started)

    def metric_families(self, names: list[str], values: list[str]) -> list[Any]:
        """Requests by route and status, their seconds, and those in progress, labelled ``names``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        requests = CounterMetricFamily(
            "rlasync_endpoint_requests",
            "HTTP requests answered, by route and status.",
            labels=[*names, "route", "status"],
        )
        for (route, status), n in sorted(self._counts.items()):
            requests.add_metric([*values, route, str(status)], n)
        seconds = HistogramMetricFamily(
            "rlasync_endpoint_request_seconds",
            "Seconds from a request's arrival to the end of its response (a stream: its last event).",
            labels=[*names, "route"],
        )
        for route, timings in sorted(self._seconds.items()):
            seconds.add_metric([*values, route], timings.buckets(), timings.sum)
        active = GaugeMetricFamily(
            "rlasync_endpoint_active_requests", "Requests in progress (streams until they end).", labels=names
        )
        active.add_metric(values, self.active)
        return [requests, seconds, active]

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> str:
        """Listen (on ``config.host:port``; port 0: a free one) and serve; the base URL."""
        import uvicorn

        class Uvicorn(uvicorn.Server):
            def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
                return contextlib.nullcontext()  # Ctrl-C stays the node's (rlasync.interrupts)

        host, port = self.config.host, self.config.port
        try:
            self._socket = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=4096
            )
        except OSError as exc:
            raise EndpointError(
                f"the endpoint cannot listen on {host}:{port}: {exc} (agent.endpoint.host/port; port 0 takes a free one)"
            ) from exc
        self._socket.setblocking(False)
        bound = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            interface="asgi3",
            proxy_headers=False,  # loopback clients, or a proxy of the user's that says who they are
            log_level="warning",
            access_log=False,
            http="httptools",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
        self._server = Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="openai-endpoint")
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                await self.close()
                raise EndpointError(f"the endpoint on {host}:{bound} did not start within {timeout:.0f} s")
            await asyncio.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        log.info("OpenAI-compatible endpoint at %s/v1 (model %r)", self.url, self.model_name)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                async with asyncio.timeout(10):
                    await self._task
            except TimeoutError:
                self._task.cancel()
            except Exception:  # noqa: BLE001  (a server that failed is closed all the same)
                log.exception("the endpoint's server failed")
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # -- the models -----------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        """A 404 for a model this endpoint does not serve (a recording one answers any name)."""
        if self.recordings is None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist: this endpoint serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _health(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("ok")

    async def _listing(self, body: bytes, rec: Recording | None) -> Any:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, body: bytes, rec: Recording | None, *, name: str) -> Any:
        self.check_model(name)
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlasync"}

    # -- what every request passes --------------------------------------------------------------
    async def _guarded(self, request: Any, *, handle: Guarded) -> Any:
        """Limits, the key, the body; errors in OpenAI's shape."""
        if self.active >= self.config.max_concurrent_requests:
            return error_response(
                APIError(
                    429,
                    f"{self.active} requests are in progress, the most this endpoint takes "
                    "(agent.endpoint.max_concurrent_requests); try again",
                    type="rate_limit_error",
                    code="too_many_requests",
                )
            )
        self.active += 1
        streaming = False
        try:
            recording = self._authorise(request)
            body = await self._body(request) if request.method == "POST" else b""
            async with asyncio.timeout(self.config.request_timeout_s):
                response = await handle(body, recording)
            if hasattr(response, "body_iterator"):  # a stream: the slot is held until it ends
                response.body_iterator = self._held(response.body_iterator)
                streaming = True
            return response
        except APIError as exc:
            return error_response(exc)
        except TimeoutError:
            return error_response(
                APIError(
                    504,
                    f"the request took longer than agent.endpoint.request_timeout_s={self.config.request_timeout_s:g} s",
                    type="server_error",
                    code="timeout",
                )
            )
        except Exception as exc:  # noqa: BLE001  (a bug answers 500 and is logged, the endpoint goes on)
            return error_response(api_error(exc))  # type: ignore[arg-type]
        finally:
            if not streaming:
                self.active -= 1

    async def _held(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async for chunk in chunks:
                    yield chunk
        except TimeoutError:
            yield sse(
                APIError(504, "the stream took longer than request_timeout_s", type="server_error").body()
            )
        finally:
            self.active -= 1

    def _authorise(self, request: Any) -> Recording | None:
        headers = request.headers
        auth = headers.get("authorization", "")
        key = headers.get(TRAJECTORY_HEADER) or (auth[7:].strip() if auth[:7].lower() == "bearer " else "")
        if self.recordings is not None:
            recording = self.recordings.get(key)
            if recording is None:
                raise APIError(
                    401,
                    "no trajectory in progress has this key: a run's endpoint takes the key its agent loop made "
                    "(the client's api_key)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
            if headers.get(TRAIN_HEADER, "").strip().lower() in ("false", "0", "no"):
                return recording.aside()
            return recording
        if self.config.api_key and not secrets.compare_digest(key, self.config.api_key):
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return None

    async def _body(self, request: Any) -> bytes:
        limit = self.config.max_request_bytes
        too_big = APIError(
            413,
            f"the request body is larger than agent.endpoint.max_request_bytes={limit}",
            code="request_too_large",
        )
        try:
            if int(request.headers.get("content-length") or 0) > limit:
                raise too_big
        except ValueError:
            raise APIError(400, "Content-Length is not a number") from None
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            parts.append(part)
        return b"".join(parts)
