"""An OpenAI-compatible HTTP endpoint on the node's own event loop, recording every token.

    async with Endpoint(router, tokenizer, EndpointConfig(port=8000), model_name="policy") as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-")
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])

``/v1/chat/completions`` (tools, streaming, ``n``, logprobs, stop strings), ``/v1/completions``
and ``/v1/models``, through an engine or a ``Router`` (a conversation's calls stick to one
engine, which reuses its prefix). The model's chat template renders the prompt and its tool
parser reads calls from the reply (``agent.tool_parser``).

``Endpoint`` composes the parts, one concept a module: the HTTP server with its table of routes,
key, limits and errors (``server``), one module a route (``chat``, ``completions``), and the
generation core they share (``generation``: stop strings, logprobs, weight syncs).

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

import secrets
from typing import Any

from ..agents.base import Generator
from ..agents.template import ChatTurns
from ..config.endpoint import EndpointConfig
from ..engines.protocol import Engine
from ..engines.types import SamplingParams
from ..tools.parsers import get_parser
from .chat import ChatRoute
from .completions import CompletionsRoute
from .generation import Generation
from .recording import Call, Recording
from .responses_api import ResponsesRequest, ResponsesRoute
from .schema import ChatRequest, CompletionRequest
from .server import Server


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
        turns = ChatTurns(tokenizer)
        parser = get_parser(tool_parser)
        self.recording = recording
        self._recordings: dict[str, Recording] = {}
        self._http: Any = None  # the connection pool of ``client``'s clients
        self.generation = Generation(generator, tokenizer, turns, self.config)
        self.server = Server(self.config, self.model_name, self._recordings if recording else None)
        chat, completions = (
            ChatRoute(self.generation, turns, parser, tool_parser),
            CompletionsRoute(self.generation),
        )
        self.server.route("POST", "/v1/chat/completions", chat, ChatRequest)
        self.server.route("POST", "/v1/completions", completions, CompletionRequest)
        self.server.route(
            "POST", "/v1/responses", ResponsesRoute(chat, self.config.stored_responses), ResponsesRequest
        )

    @property
    def url(self) -> str:
        """The base URL (``http://host:port``) once started; empty before."""
        return self.server.url

    @property
    def _active(self) -> int:
        """Requests in progress (a stream's until it ends)."""
        return self.server.active

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI application (the server's)."""
        await self.server.app(scope, receive, send)

    def metric_families(self, **labels: str) -> list[Any]:
        """The endpoint's counts as Prometheus families, each sample labelled with ``labels``
        (an agent-loop worker adds them to its node's ``/metrics``)."""
        names, values = list(labels), list(labels.values())
        return [*self.server.metric_families(names, values), *self.generation.metric_families(names, values)]

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> str:
        """Listen (on ``config.host:port``; port 0: a free one) and serve; the base URL."""
        return await self.server.start(timeout)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.server.close()

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
