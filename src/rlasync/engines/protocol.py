"""The one protocol every inference engine speaks (torch, vLLM, SGLang).

Token-in/token-out, so agent loops never re-tokenise model output. Every engine keeps a
weight version and tags each generated token with the version that produced it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Container, Mapping
from typing import Any, Protocol, runtime_checkable

from .types import (
    Alternatives,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    TokenChunk,
)


class EngineError(RuntimeError):
    """A request the engine cannot take (bad ids, too long, duplicate id, engine closed)."""


class EngineLostError(EngineError, ConnectionError):
    """The engine serving a request died (its node was lost) and the request was not moved
    (raised by the router, ``router.on_engine_lost="fail"``)."""


async def until_finished(queue: asyncio.Queue[TokenChunk | BaseException]) -> AsyncIterator[TokenChunk]:
    """The chunks an engine puts in a request's queue, up to the one with a finish reason; an
    exception put there instead (the engine failed the request) is raised."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return


async def collect(request: GenerateRequest, chunks: AsyncIterator[TokenChunk]) -> GenerateOutput:
    """``generate`` of an engine whose output is its stream's chunks put together."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    top: list[Alternatives] = []
    finish: FinishReason = "abort"
    async for chunk in chunks:
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        top += chunk.top_logprobs
        finish = chunk.finish_reason or finish
    return GenerateOutput(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        token_ids=tokens,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        top_logprobs=top,
    )


async def wait_until_idle(idle: asyncio.Event, timeout: float | None) -> None:
    """``pause("wait")``: until no request is in flight (``idle`` set), at most ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            await idle.wait()
    except TimeoutError:
        raise TimeoutError(
            f"in-flight requests did not finish within pause(timeout={timeout}); pause('abort') ends them at once"
        ) from None


def check_request(
    request: GenerateRequest, *, vocab_size: int, max_seq_len: int, running: Container[str]
) -> None:
    """Refuse a request every engine would refuse, with the same message whichever engine it is."""
    rid = request.request_id
    if not request.prompt_ids:
        raise EngineError(f"request {rid!r} has an empty prompt")
    if rid in running:
        raise EngineError(f"request id {rid!r} is already running; ids must be unique")
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise EngineError(f"request {rid!r} has token ids outside the vocabulary [0, {vocab_size})")
    if request.params.max_new_tokens < 1:
        raise EngineError(f"request {rid!r}: max_new_tokens must be at least 1")
    if len(request.prompt_ids) >= max_seq_len:
        raise EngineError(
            f"request {rid!r}: prompt of {len(request.prompt_ids)} tokens does not fit max_seq_len={max_seq_len}"
        )


@runtime_checkable
class Engine(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Run one request to its end (stop, length or abort)."""
        ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """The same, chunk by chunk as tokens are produced."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End a request now; its caller gets the tokens so far with finish reason "abort"."""
        ...

    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        """Stop admitting requests. "abort": end every in-flight request now and return the
        partial outputs (to resume them after a weight update); "wait": let in-flight
        requests finish (up to ``timeout`` s); "keep": freeze in-flight requests where they
        are (their KV cache kept) and go on with them at ``resume``. Waiting requests stay
        queued until ``resume``."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Load these parameters (all or some, by name) and set the weight version."""
        ...

    @property
    def weight_version(self) -> int: ...

    def stats(self) -> EngineStats: ...

    async def close(self) -> None: ...


@runtime_checkable
class SleepingEngine(Engine, Protocol):
    """An engine that can give its device memory to a trainer on the same device
    (``cluster.colocate``): the torch engine, vLLM (sleep mode), SGLang (memory release)."""

    async def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV cache and, with ``offload_weights``, move the weights to host memory, until
        ``wake_up``; requests that arrive meanwhile wait. Only an idle engine sleeps: one with
        requests in flight is an ``EngineError`` (pause it with "wait" or "abort" first)."""
        ...

    async def wake_up(self) -> None:
        """The weights back on the device and the engine serving again."""
        ...
