"""An OpenAI-compatible HTTP endpoint on the node's own event loop, recording every token.

    async with Endpoint(router, tokenizer, EndpointConfig(port=8000), model_name="policy") as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-")
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])

``/v1/chat/completions`` (tools, streaming, ``n``, logprobs, stop strings), ``/v1/completions``
and ``/v1/models``, through an engine or a ``Router`` (a conversation's calls stick to one
engine, which reuses its prefix). The model's chat template renders the prompt and its tool
parser reads calls from the reply (``agent.tool_parser``).

Built on Starlette (requests, and streamed responses that end when the client goes away) and uvicorn
(HTTP/1.1 with the httptools parser), both maintained and small; uvicorn's ``Server`` runs as a
task on the running loop, so the endpoint shares its node's process and loop with the engine,
and its signal handling is left to the node. aiohttp would do as well; Starlette's responses
cancel a stream's generation when the client disconnects, which we would otherwise write.

**Recording** (``recording=True``, what a run starts): each trajectory gets a key
(``record``); calls carrying it (``Authorization: Bearer <key>``, or an ``X-Trajectory-Id``
header) are recorded with their prompt and completion token ids, logprobs and weight versions,
and ``recorded(key)`` hands them over (``rlasync.serving.recording`` turns them into
trajectories). A request without a live key is refused (401).

**A weight sync** (``pause("abort")``) cuts a request's generation: the endpoint goes on from
the tokens it had, once the engines resume, and the client sees one response.

**Metrics** (``metric_families``, on the node's ``/metrics`` where the endpoint is an agent-loop
worker's): requests by route and status, their seconds, requests in progress, completion
tokens, and generations continued after a weight sync (``rlasync_endpoint_*``).

Limits: ``max_request_bytes`` (413), ``max_concurrent_requests`` (429), ``request_timeout_s``
(504). Errors take OpenAI's shape. Streaming a chat request that offers tools sends the reply
whole in one chunk at its end: its tool calls are read from the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from ..agents.base import Generator, takes_session
from ..agents.loops import MAX_ENGINE_ABORTS, turn_seed
from ..agents.template import ChatTurns, TemplateError
from ..config.endpoint import EndpointConfig
from ..engines.protocol import Engine, EngineError, EngineLostError
from ..engines.router import NoEngineError, RouterBusyError
from ..engines.types import GenerateOutput, GenerateRequest, SamplingParams
from ..metrics.timings import Timings
from ..runtime import ActorError
from ..tools.parsers import get_parser
from .recording import Call, Recording, text_of
from .schema import APIError, ChatRequest, CompletionRequest, decode_request

log = logging.getLogger(__name__)

TRAJECTORY_HEADER = "x-trajectory-id"


class EndpointError(RuntimeError):
    """The endpoint could not start (its address is taken, or the server did not come up)."""


class _Choice:
    """One choice being generated: its tokens, and its text as decoded so far."""

    __slots__ = (
        "ids",
        "logprobs",
        "versions",
        "finish",
        "text",
        "sent",
        "stopped",
        "started",
        "aborts",
        "new",
    )

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: str | None = None  # the engine's: stop, length; or "stop" for a stop string
        self.text = ""
        self.sent = 0  # characters of text streamed to the client
        self.stopped = False  # a stop string ended it
        self.started = time.perf_counter()
        self.aborts = 0
        self.new = 0  # tokens that arrived with the last piece (their logprobs go with its delta)


class Endpoint:
    def __init__(
        self,
        generator: Engine | Generator,
        tokenizer: Any,
        config: EndpointConfig | None = None,
        *,
        model_name: str = "policy",
        tool_parser: str = "hermes",
        recording: bool = False,
    ) -> None:
        self.generator: Any = generator  # an engine, or a router (which takes a session id)
        self.tokenizer = tokenizer
        self.config = config or EndpointConfig()
        self.model_name = self.config.served_model_name or model_name
        self.turns = ChatTurns(tokenizer)
        self.parser = get_parser(tool_parser)
        self.eos = tokenizer.eos_token_id
        self.recording = recording
        self._session = takes_session(type(generator))
        self._recordings: dict[str, Recording] = {}
        self._active = 0
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._http: Any = None  # the connection pool of ``client``'s clients
        self.url = ""
        # Counted for Prometheus (``metric_families``): labels are our routes and statuses, so few.
        self._counts: dict[tuple[str, int], int] = {}
        self._seconds: dict[str, Timings] = {}
        self._completion_tokens = 0
        self._continued = 0
        self._routes: dict[tuple[str, str], Callable[[Any], Awaitable[Any]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
        }

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
            handle = functools.partial(self._model, name=path.removeprefix("/v1/models/"))
            route = "/v1/models/{model}"
        if handle is not None:
            response = await handle(request)
        elif route != "other":
            response = self._error(APIError(405, f"{path} does not take {method}", code="method_not_allowed"))
        else:
            response = self._error(APIError(404, f"no route {method} {path}", code="not_found"))
        try:
            await response(scope, receive, send)
        finally:  # a stream is counted when it ends (or its client goes away)
            key = (route, response.status_code)
            self._counts[key] = self._counts.get(key, 0) + 1
            self._seconds.setdefault(route, Timings()).observe(time.perf_counter() - started)

    def metric_families(self, **labels: str) -> list[Any]:
        """The endpoint's counts as Prometheus families, each sample labelled with ``labels``
        (an agent-loop worker adds them to its node's ``/metrics``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names, values = list(labels), list(labels.values())
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
        active.add_metric(values, self._active)
        tokens = CounterMetricFamily(
            "rlasync_endpoint_completion_tokens", "Tokens generated for the endpoint's replies.", labels=names
        )
        tokens.add_metric(values, self._completion_tokens)
        continued = CounterMetricFamily(
            "rlasync_endpoint_sync_continuations",
            "Generations cut by a weight sync and continued inside the endpoint (the client saw one reply).",
            labels=names,
        )
        continued.add_metric(values, self._continued)
        return [requests, seconds, active, tokens, continued]

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> str:
        """Listen (on ``config.host:port``; port 0: a free one) and serve; the base URL."""
        import uvicorn

        class Server(uvicorn.Server):
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
        self._server = Server(config)
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
        if self._http is not None:
            await self._http.aclose()
            self._http = None
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

    async def __aenter__(self) -> Endpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def client(self, api_key: str = "-", **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` for this endpoint (``api_key``: a key from ``record``). Its
        connections come from one pool the endpoint keeps, so making one is cheap (a client of
        its own loads the system's certificates: ~25 ms of CPU). Do not close it: the pool
        closes with the endpoint."""
        import openai

        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient(timeout=self.config.request_timeout_s + 30)
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=api_key, http_client=self._http, **options
        )

    # -- recording ------------------------------------------------------------------------------
    def record(self, params: SamplingParams, trajectory_id: str = "") -> str:
        """A new key: calls made with it are recorded; what they do not set comes from ``params``
        (the seed mixed with ``trajectory_id`` and the call's number, as the loops do)."""
        key = f"rla-{secrets.token_urlsafe(18)}"
        self._recordings[key] = Recording(key, params, trajectory_id or key)
        return key

    def recorded(self, key: str) -> list[Call]:
        """The calls made with ``key`` (which then stops working)."""
        recording = self._recordings.pop(key, None)
        return recording.calls if recording is not None else []

    # -- requests ------------------------------------------------------------------------------
    async def _health(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("ok")

    async def _models(self, request: Any) -> Any:
        return await self._guarded(request, lambda body, rec: self._listing())

    async def _model(self, request: Any, *, name: str) -> Any:

        async def one(body: bytes, rec: Recording | None) -> Any:
            self._check_model(name)
            return _json(self._model_card())

        return await self._guarded(request, one)

    async def _listing(self) -> Any:
        return _json({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlasync"}

    def _check_model(self, name: str) -> None:
        if not self.recording and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist: this endpoint serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _chat(self, request: Any) -> Any:
        return await self._guarded(request, self._chat_body)

    async def _completions(self, request: Any) -> Any:
        return await self._guarded(request, self._completion_body)

    async def _guarded(
        self, request: Any, handle: Callable[[bytes, Recording | None], Awaitable[Any]]
    ) -> Any:
        """Limits, the key, the body; errors in OpenAI's shape."""
        if self._active >= self.config.max_concurrent_requests:
            return self._error(
                APIError(
                    429,
                    f"{self._active} requests are in progress, the most this endpoint takes "
                    "(agent.endpoint.max_concurrent_requests); try again",
                    type="rate_limit_error",
                    code="too_many_requests",
                )
            )
        self._active += 1
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
            return self._error(exc)
        except TimeoutError:
            return self._error(
                APIError(
                    504,
                    f"the request took longer than agent.endpoint.request_timeout_s={self.config.request_timeout_s:g} s",
                    type="server_error",
                    code="timeout",
                )
            )
        except Exception as exc:  # noqa: BLE001  (a bug answers 500 and is logged, the endpoint goes on)
            return self._error(_api_error(exc))  # type: ignore[arg-type]
        finally:
            if not streaming:
                self._active -= 1

    async def _held(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async for chunk in chunks:
                    yield chunk
        except TimeoutError:
            yield _sse(
                APIError(504, "the stream took longer than request_timeout_s", type="server_error").body()
            )
        finally:
            self._active -= 1

    def _authorise(self, request: Any) -> Recording | None:
        headers = request.headers
        auth = headers.get("authorization", "")
        key = headers.get(TRAJECTORY_HEADER) or (auth[7:].strip() if auth[:7].lower() == "bearer " else "")
        if self.recording:
            recording = self._recordings.get(key)
            if recording is None:
                raise APIError(
                    401,
                    "no trajectory in progress has this key: a run's endpoint takes the key its agent loop made "
                    "(the client's api_key)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
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

    def _error(self, exc: APIError) -> Any:
        return _json(exc.body(), status=exc.status)

    # -- chat -------------------------------------------------------------------------------------
    async def _chat_body(self, body: bytes, rec: Recording | None) -> Any:
        req: ChatRequest = decode_request(body, ChatRequest)
        req.check()
        self._check_model(req.model)
        messages = [_message_in(m) for m in req.messages]
        tools = req.tools or None
        prompt = self._chat_prompt(rec, messages, tools)
        params = self._params(req, rec, req.new_tokens)
        stops = req.stops()
        rid = self._request_id(rec)
        if req.stream:
            return _stream(self._chat_stream(req, rec, messages, prompt, params, stops, rid))
        choices = await self._all(prompt, params, stops, rid, req.n, _session(rec, rid))
        out = []
        for i, c in enumerate(choices):
            message, finish, calls = self._reply(req, c, rid, i)
            out.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": self._token_logprobs(c.ids, c.logprobs)}
                    if req.logprobs
                    else None,
                    "finish_reason": finish,
                }
            )
            self._record_chat(rec, messages, tools, prompt, c, message, finish, calls)
        usage = _usage(len(prompt), sum(len(c.ids) for c in choices))
        return _json(_envelope("chat.completion", rid, req.model, out, usage=usage))

    def _chat_prompt(self, rec: Recording | None, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """The conversation's tokens: an answered conversation's own, when these messages go on
        from one (``Recording.continued``); else the chat template's rendering."""
        try:
            if rec is not None and (found := rec.continued(messages, tools)) is not None:
                ids, rest = found
                return ids + self.turns.after_model_turn(rest)
            return self.turns.prompt_ids(messages, tools)
        except TemplateError as exc:
            raise APIError(
                400, f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None
        except Exception as exc:  # noqa: BLE001  (jinja's errors: a message the template does not take)
            raise APIError(
                400,
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                param="messages",
            ) from None

    def _reply(self, req: ChatRequest, c: _Choice, rid: str, index: int) -> tuple[dict[str, Any], str, int]:
        """The assistant message, its finish reason and its number of tool calls."""
        text = c.text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not req.parses_tools:
            return message, "length" if c.finish == "length" else "stop", 0
        parsed = self.parser.parse(text, call_id_prefix=f"call_{rid}_{index}_")
        if not parsed.calls:
            return message, "length" if c.finish == "length" else "stop", 0
        message["content"] = parsed.content or None
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for call in parsed.calls
        ]
        return message, "tool_calls", len(parsed.calls)

    def _record_chat(
        self,
        rec: Recording | None,
        messages: list[dict[str, Any]],
        tools: Any,
        prompt: list[int],
        c: _Choice,
        message: dict[str, Any],
        finish: str,
        calls: int,
    ) -> None:
        if rec is None:
            return
        conversation = [*messages, message]
        rec.calls.append(self._call(prompt, c, finish, conversation, calls))
        if c.finish == "stop" and not c.stopped and c.ids and c.ids[-1] == self.eos:
            rec.remember(conversation, tools, prompt + c.ids)  # it ended its turn: it may be continued

    async def _chat_stream(
        self,
        req: ChatRequest,
        rec: Recording | None,
        messages: list[dict[str, Any]],
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        rid: str,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
        ) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return _sse(_envelope("chat.completion.chunk", rid, req.model, [choice], created=created))

        choices: list[_Choice] = []
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        whole = req.parses_tools  # calls are read from the whole reply: it is sent at its end
        pieces = self._pieces(
            prompt, params, stops, rid, req.n, choices, session_id=_session(rec, rid), stream=True
        )
        async for i, c, done in pieces:
            if not whole:
                delta = c.text[c.sent :] if done else _settled(c.text, stops)[c.sent :]
                if delta or (req.logprobs and c.new):
                    c.sent += len(delta)
                    logprobs = (
                        {"content": self._token_logprobs(c.ids[-c.new :], c.logprobs[-c.new :])}
                        if req.logprobs and c.new
                        else None
                    )
                    yield chunk(i, {"content": delta}, logprobs=logprobs)
            if done:
                message, finish, calls = self._reply(req, c, rid, i)
                if whole:
                    final = {k: v for k, v in message.items() if k != "role"}
                    if "tool_calls" in final:  # a streamed call carries its place in the list
                        final["tool_calls"] = [
                            dict(call, index=k) for k, call in enumerate(final["tool_calls"])
                        ]
                    logprobs = {"content": self._token_logprobs(c.ids, c.logprobs)} if req.logprobs else None
                    yield chunk(i, final, logprobs=logprobs)
                yield chunk(i, {}, finish)
                self._record_chat(rec, messages, req.tools or None, prompt, c, message, finish, calls)
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = _usage(len(prompt), sum(len(c.ids) for c in choices))
            yield _sse(_envelope("chat.completion.chunk", rid, req.model, [], created=created, usage=usage))
        yield b"data: [DONE]\n\n"

    # -- completions --------------------------------------------------------------------------------
    async def _completion_body(self, body: bytes, rec: Recording | None) -> Any:
        req: CompletionRequest = decode_request(body, CompletionRequest)
        req.check()
        self._check_model(req.model)
        prompts = [self._prompt_ids(p) for p in req.prompts()]
        params = self._params(req, rec, req.max_tokens or (None if rec is not None else 16))
        stops = req.stops()
        rid = self._request_id(rec)
        if req.stream:
            if len(prompts) > 1:
                raise APIError(400, "stream takes one prompt", param="prompt")
            return _stream(self._completion_stream(req, rec, prompts[0], params, stops, rid))
        results = await asyncio.gather(
            *[
                self._all(p, params, stops, f"{rid}-{k}", req.n, _session(rec, rid))
                for k, p in enumerate(prompts)
            ]
        )
        out = []
        for k, (prompt, choices) in enumerate(zip(prompts, results)):
            for i, c in enumerate(choices):
                finish = "length" if c.finish == "length" else "stop"
                out.append(
                    {
                        "index": k * req.n + i,
                        "text": c.text,
                        "logprobs": self._text_logprobs(c) if req.logprobs is not None else None,
                        "finish_reason": finish,
                    }
                )
                if rec is not None:
                    rec.calls.append(self._call(prompt, c, finish, [], 0))
        usage = _usage(sum(map(len, prompts)), sum(len(c.ids) for cs in results for c in cs))
        return _json(_envelope("text_completion", rid, req.model, out, usage=usage))

    async def _completion_stream(
        self,
        req: CompletionRequest,
        rec: Recording | None,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        rid: str,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        choices: list[_Choice] = []
        pieces = self._pieces(
            prompt, params, stops, rid, req.n, choices, session_id=_session(rec, rid), stream=True
        )
        async for i, c, done in pieces:
            delta = c.text[c.sent :] if done else _settled(c.text, stops)[c.sent :]
            c.sent += len(delta)
            finish = ("length" if c.finish == "length" else "stop") if done else None
            if delta or finish:
                choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}
                yield _sse(_envelope("text_completion", rid, req.model, [choice], created=created))
            if done and rec is not None:
                rec.calls.append(self._call(prompt, c, str(finish), [], 0))
        yield b"data: [DONE]\n\n"

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise APIError(400, "a prompt of token ids must be a non-empty list of integers", param="prompt")
        return list(prompt)

    # -- generation ---------------------------------------------------------------------------------
    def _params(self, req: Any, rec: Recording | None, max_tokens: int | None) -> SamplingParams:
        """The request's sampling; what it leaves out is the run's (recording) or the defaults."""
        base = (
            rec.params if rec is not None else SamplingParams(max_new_tokens=self.config.default_max_tokens)
        )
        if req.n > self.config.max_n:
            raise APIError(400, f"n is at most {self.config.max_n} (agent.endpoint.max_n)", param="n")
        seed = req.seed
        if seed is None and rec is not None:  # the run's seed, per trajectory and call: reproducible
            seed = turn_seed(base.seed, rec.trajectory_id, rec.requests)
        return msgspec.structs.replace(
            base,
            temperature=base.temperature if req.temperature is None else req.temperature,
            top_p=base.top_p if req.top_p is None else req.top_p,
            max_new_tokens=max_tokens or base.max_new_tokens,
            seed=seed,
        )

    def _request_id(self, rec: Recording | None) -> str:
        if rec is None:
            return uuid.uuid4().hex[:16]
        rec.requests += 1
        return f"{rec.key[-8:]}{rec.requests}"

    async def _all(
        self, prompt: list[int], params: SamplingParams, stops: list[str], rid: str, n: int, session_id: str
    ) -> list[_Choice]:
        """``n`` whole choices (no queue, and no task for one: most requests)."""
        choices = [_Choice() for _ in range(n)]
        runs = [
            self._generate(
                prompt,
                msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + i),
                stops,
                f"{rid}-{i}",
                c,
                _nothing,
                session_id=session_id,
                per_token=False,
            )
            for i, c in enumerate(choices)
        ]
        try:
            await (runs[0] if n == 1 else asyncio.gather(*runs))
        except Exception as exc:  # noqa: BLE001  (as the status a client can act on)
            raise _api_error(exc) from None
        return choices

    async def _pieces(
        self,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        rid: str,
        n: int,
        choices: list[_Choice],
        *,
        session_id: str,
        stream: bool,
    ) -> AsyncIterator[tuple[int, _Choice, bool]]:
        """``n`` choices generated at once (``choices`` filled in), as ``(index, choice, done)``
        each time one grows; token by token when the client streams or ``stops`` must be
        watched, else each arrives whole. A conversation's calls (``session_id``) stick to one engine."""
        choices[:] = [_Choice() for _ in range(n)]
        queue: asyncio.Queue[tuple[int, bool] | BaseException] = asyncio.Queue()
        seeds = [params.seed if params.seed is None else params.seed + i for i in range(n)]

        async def one(i: int) -> None:
            try:
                p = msgspec.structs.replace(params, seed=seeds[i])
                await self._generate(
                    prompt,
                    p,
                    stops,
                    f"{rid}-{i}",
                    choices[i],
                    lambda: queue.put_nowait((i, False)),
                    session_id=session_id,
                    per_token=stream,
                )
                queue.put_nowait((i, True))
            except BaseException as exc:  # noqa: BLE001  (handed to the consumer, which raises it)
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        try:
            left = n
            while left:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise _api_error(item)
                i, done = item
                left -= done
                yield i, choices[i], done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        rid: str,
        c: _Choice,
        grew: Callable[[], None],
        *,
        session_id: str,
        per_token: bool,
    ) -> None:
        """Generate one choice into ``c``, going on after every weight-sync abort as one request,
        ending at a stop string; ``grew`` after each piece."""
        session = {"session_id": session_id} if self._session else {}
        streamed = bool(stops) or per_token
        while True:
            if len(c.ids) >= params.max_new_tokens:  # cut by a sync at its very last token
                c.finish = "length"
                return
            request = GenerateRequest(
                request_id=f"{rid}.{c.aborts}",
                prompt_ids=prompt + c.ids,
                params=msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(c.ids)),
            )
            if streamed:
                async with contextlib.aclosing(self.generator.generate_stream(request, **session)) as stream:
                    async for chunk in stream:
                        self._grow(
                            c, chunk.token_ids, chunk.logprobs, chunk.versions, chunk.finish_reason, stops
                        )
                        grew()
                        if c.stopped:
                            return  # closing the stream aborts the rest in the engine
            else:
                out: GenerateOutput = await self.generator.generate(request, **session)
                self._grow(c, out.token_ids, out.logprobs, out.versions, out.finish_reason, stops)
                grew()
            if c.finish != "abort" or c.stopped:
                return
            c.aborts += 1  # a weight sync cut it: go on from its tokens once the engines resume
            self._continued += 1
            c.finish = None
            if c.aborts >= MAX_ENGINE_ABORTS:  # the tool loop's limit: the engines keep pausing
                raise APIError(
                    503,
                    f"the request was cut by {MAX_ENGINE_ABORTS} weight syncs in a row",
                    type="server_error",
                )

    def _grow(
        self,
        c: _Choice,
        ids: list[int],
        logprobs: list[float],
        versions: list[int],
        finish: str | None,
        stops: list[str],
    ) -> None:
        c.ids += ids
        self._completion_tokens += len(ids)
        c.logprobs += logprobs
        c.versions += versions
        c.new = len(ids)
        c.finish = finish
        shown = c.ids[:-1] if finish == "stop" and c.ids and c.ids[-1] == self.eos else c.ids
        c.text = self.tokenizer.decode(shown, skip_special_tokens=False).removesuffix(self.turns.turn_end)
        for stop in stops:
            at = c.text.find(stop)
            if at >= 0:
                c.text, c.stopped, c.finish = c.text[:at], True, "stop"

    def _call(
        self, prompt: list[int], c: _Choice, finish: str, messages: list[dict[str, Any]], calls: int
    ) -> Call:
        return Call(
            prompt_ids=list(prompt),
            completion_ids=list(c.ids),
            logprobs=list(c.logprobs),
            versions=list(c.versions),
            finish_reason=finish,
            generation_s=time.perf_counter() - c.started,
            aborts=c.aborts,
            messages=messages,
            tool_calls=calls,
        )

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        out = []
        for token, logprob in zip(ids, logprobs):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _text_logprobs(self, c: _Choice) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in c.ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": list(c.logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }


# -- helpers ------------------------------------------------------------------------------------------
def _stream(chunks: AsyncIterator[bytes]) -> Any:
    """A server-sent-events response of ``chunks``. An error once the stream has begun (its
    status already sent) is its last event, in OpenAI's shape: the client raises it."""
    from starlette.responses import StreamingResponse

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:
            yield _sse(exc.body())

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _nothing() -> None:
    pass


def _session(rec: Recording | None, rid: str) -> str:
    """A trajectory's calls share its engine (which keeps their prefix); others spread."""
    return rec.key if rec is not None else rid


def _json(content: Any, status: int = 200) -> Any:
    from starlette.responses import Response

    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json")


def _sse(content: Any) -> bytes:
    return b"data: " + msgspec.json.encode(content) + b"\n\n"


def _envelope(
    kind: str, rid: str, model: str, choices: list[Any], *, created: int = 0, **more: Any
) -> dict[str, Any]:
    """A response (or a streamed chunk) of ``kind``: its id, time and model around ``choices``."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{rid}",
        "object": kind,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        **more,
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _settled(text: str, stops: list[str]) -> str:
    """What may be streamed of ``text`` yet: not a character that may still change (an
    unfinished multi-byte character) or begin a stop string."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[: len(text) - hold] if hold else text


def _message_in(message: dict[str, Any]) -> dict[str, Any]:
    """A client's message as the chat template takes it: text content, ``developer`` as
    ``system``, tool-call arguments as JSON objects."""
    out = dict(message)
    if out.get("role") == "developer":
        out["role"] = "system"
    out["content"] = text_of(out.get("content"))
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def _api_error(exc: BaseException) -> BaseException:
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
