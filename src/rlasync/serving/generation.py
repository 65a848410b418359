"""The generation core both routes share: a request's ``n`` choices generated against the
engines, their stop strings, their logprobs, and each one as the ``Call`` a recording keeps.

A choice is generated whole in one engine call, or token by token where the client streams or
a stop string must be watched (its text is cut where the stop string begins; closing the
engine's stream aborts the rest). A conversation's calls (a recording's key) stick to one
engine, which reuses their prefix; other requests spread by their id.

**A weight sync** (``pause("abort")``) cuts a choice's generation: it goes on from the tokens it
had, once the engines resume, as one request (``MAX_ENGINE_ABORTS`` syncs in a row: 503), and
the client sees one response. Such continuations are counted for ``/metrics``.

What a request does not set comes from the recording's sampling (the run's: its seed mixed with
the trajectory and the call's number, as the loops do) or the endpoint's defaults; choice ``i``
of ``n`` takes ``seed + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from ..agents.base import Generator, takes_session
from ..agents.loops import MAX_ENGINE_ABORTS, turn_seed
from ..agents.template import ChatTurns
from ..config.endpoint import EndpointConfig
from ..engines.protocol import Engine
from ..engines.types import Alternatives, GenerateOutput, GenerateRequest, SamplingParams, TokenChunk
from .recording import Call, Recording
from .responses import api_error
from .schema import APIError


class Choice:
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
        "tokens_sent",
        "top",
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
        self.tokens_sent = 0  # tokens whose logprobs were streamed to the client
        self.top: list[Alternatives] = []  # each token's most likely alternatives, when asked for

    @property
    def reason(self) -> str:
        """The API's finish reason for its text: length, or stop."""
        return "length" if self.finish == "length" else "stop"

    def unsent(self, done: bool, stops: list[str]) -> str:
        """The text to stream now (then counted as sent): the rest once ``done``, else what is
        settled: not a character that may still change (an unfinished multi-byte character) or
        begin a stop string."""
        text = self.text
        if not done:
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in stops), default=0)
            text = text[: len(text) - hold] if hold else text
        delta = text[self.sent :]
        self.sent += len(delta)
        return delta

    def unsent_tokens(self) -> int:
        """Where the tokens not yet streamed begin (then counted as sent): their logprobs go
        with the text delta sent now."""
        start, self.tokens_sent = self.tokens_sent, len(self.ids)
        return start


class Job(msgspec.Struct, kw_only=True):
    """A request made ready to generate: its prompt, sampling, stop strings and id."""

    rec: Recording | None
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    rid: str
    n: int
    session_id: str  # a trajectory's calls share its engine (which keeps their prefix); others spread


class Generation:
    def __init__(
        self, generator: Engine | Generator, tokenizer: Any, turns: ChatTurns, config: EndpointConfig
    ) -> None:
        self.generator: Any = generator  # an engine, or a router (which takes a session id)
        self.tokenizer = tokenizer
        self.turns = turns
        self.config = config
        self.eos = tokenizer.eos_token_id
        self._session = takes_session(type(generator))
        # Counted for Prometheus (``metric_families``).
        self.completion_tokens = 0
        self.continued = 0

    def prepare(
        self, req: Any, rec: Recording | None, prompt: list[int], max_tokens: int | None, *, grammar: str = ""
    ) -> Job:
        """``req`` (a chat or completion request) as a job for ``prompt``: its sampling (within
        ``grammar``, when it asks for structured output), stop strings and id (a recording's next)."""
        params = msgspec.structs.replace(self._params(req, rec, max_tokens), grammar=grammar)
        stops = req.stops()
        rid = self._request_id(rec)
        session_id = rec.key if rec is not None else rid
        return Job(
            rec=rec, prompt=prompt, params=params, stops=stops, rid=rid, n=req.n, session_id=session_id
        )

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
            top_logprobs=req.alternatives,
        )

    def _request_id(self, rec: Recording | None) -> str:
        if rec is None:
            return uuid.uuid4().hex[:16]
        rec.requests += 1
        return f"{rec.key[-8:]}{rec.requests}"

    async def all(self, job: Job) -> list[Choice]:
        """The job's ``n`` whole choices (no queue, and no task for one: most requests)."""
        params = job.params
        choices = [Choice() for _ in range(job.n)]
        runs = [
            self._generate(
                job,
                msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + i),
                f"{job.rid}-{i}",
                c,
                _nothing,
                per_token=False,
            )
            for i, c in enumerate(choices)
        ]
        try:
            await (runs[0] if job.n == 1 else asyncio.gather(*runs))
        except Exception as exc:  # noqa: BLE001  (as the status a client can act on)
            raise api_error(exc) from None
        return choices

    async def pieces(
        self, job: Job, choices: list[Choice], *, stream: bool
    ) -> AsyncIterator[tuple[int, Choice, bool]]:
        """The job's ``n`` choices generated at once (``choices`` filled in), as ``(index,
        choice, done)`` each time one grows; token by token when the client streams or stop
        strings must be watched, else each arrives whole."""
        n, params = job.n, job.params
        choices[:] = [Choice() for _ in range(n)]
        queue: asyncio.Queue[tuple[int, bool] | BaseException] = asyncio.Queue()
        seeds = [params.seed if params.seed is None else params.seed + i for i in range(n)]

        async def one(i: int) -> None:
            try:
                p = msgspec.structs.replace(params, seed=seeds[i])
                await self._generate(
                    job,
                    p,
                    f"{job.rid}-{i}",
                    choices[i],
                    lambda: queue.put_nowait((i, False)),
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
                    raise api_error(item)
                i, done = item
                left -= done
                yield i, choices[i], done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(
        self,
        job: Job,
        params: SamplingParams,
        rid: str,
        c: Choice,
        grew: Callable[[], None],
        *,
        per_token: bool,
    ) -> None:
        """Generate one choice into ``c``, going on after every weight-sync abort as one request,
        ending at a stop string; ``grew`` after each piece."""
        session = {"session_id": job.session_id} if self._session else {}
        stops = job.stops
        streamed = bool(stops) or per_token
        while True:
            if len(c.ids) >= params.max_new_tokens:  # cut by a sync at its very last token
                c.finish = "length"
                return
            request = GenerateRequest(
                request_id=f"{rid}.{c.aborts}",
                prompt_ids=job.prompt + c.ids,
                params=msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(c.ids)),
            )
            if streamed:
                async with contextlib.aclosing(self.generator.generate_stream(request, **session)) as stream:
                    async for chunk in stream:
                        self._grow(c, chunk, chunk.finish_reason, stops)
                        grew()
                        if c.stopped:
                            return  # closing the stream aborts the rest in the engine
            else:
                out: GenerateOutput = await self.generator.generate(request, **session)
                self._grow(c, out, out.finish_reason, stops)
                grew()
            if c.finish != "abort" or c.stopped:
                return
            c.aborts += 1  # a weight sync cut it: go on from its tokens once the engines resume
            self.continued += 1
            c.finish = None
            if c.aborts >= MAX_ENGINE_ABORTS:  # the tool loop's limit: the engines keep pausing
                raise APIError(
                    503,
                    f"the request was cut by {MAX_ENGINE_ABORTS} weight syncs in a row",
                    type="server_error",
                )

    def _grow(
        self, c: Choice, piece: TokenChunk | GenerateOutput, finish: str | None, stops: list[str]
    ) -> None:
        ids = piece.token_ids
        c.ids += ids
        self.completion_tokens += len(ids)
        c.logprobs += piece.logprobs
        c.versions += piece.versions
        c.top += piece.top_logprobs
        c.finish = finish
        shown = c.ids[:-1] if finish == "stop" and c.ids and c.ids[-1] == self.eos else c.ids
        c.text = self.tokenizer.decode(shown, skip_special_tokens=False).removesuffix(self.turns.turn_end)
        for stop in stops:
            at = c.text.find(stop)
            if at >= 0:
                c.text, c.stopped, c.finish = c.text[:at], True, "stop"

    def call(
        self, prompt: list[int], c: Choice, finish: str, messages: list[dict[str, Any]], calls: int
    ) -> Call:
        """The choice as its recording keeps it."""
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

    def token_logprobs(self, c: Choice, start: int = 0) -> list[dict[str, Any]]:
        """Chat's logprobs of ``c``'s tokens from ``start``: one entry a token, with its most
        likely alternatives when the request asked for them (``top_logprobs``)."""
        out = []
        for i in range(start, len(c.ids)):
            entry = self._entry(c.ids[i], c.logprobs[i])
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in c.top[i]] if i < len(c.top) else []
            out.append(entry)
        return out

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def text_logprobs(self, c: Choice) -> dict[str, Any]:
        """The legacy completions' logprobs: tokens, their logprobs and where each begins, and
        each position's most likely tokens (text -> logprob) when ``logprobs`` is above 0."""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        tokens = [decode([t]) for t in c.ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = [{decode([t]): lp for t, lp in alternatives} for alternatives in c.top] if c.top else None
        return {
            "tokens": tokens,
            "token_logprobs": list(c.logprobs),
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def metric_families(self, names: list[str], values: list[str]) -> list[Any]:
        """Tokens generated, and generations continued after a weight sync, labelled ``names``."""
        from prometheus_client.core import CounterMetricFamily

        tokens = CounterMetricFamily(
            "rlasync_endpoint_completion_tokens", "Tokens generated for the endpoint's replies.", labels=names
        )
        tokens.add_metric(values, self.completion_tokens)
        continued = CounterMetricFamily(
            "rlasync_endpoint_sync_continuations",
            "Generations cut by a weight sync and continued inside the endpoint (the client saw one reply).",
            labels=names,
        )
        continued.add_metric(values, self.continued)
        return [tokens, continued]


def _nothing() -> None:
    pass
