"""``TorchSequence``: one request in the torch engine, and the chunks its worker hands the loop.

Which thread writes what is the torch engine's rule (``torch_engine``): the worker thread
appends a sequence's tokens, logprobs and versions and never touches them once it has ended;
the event loop sets ``finish`` when it tells the caller the request ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .types import Alternatives, FinishReason, GenerateRequest, RequestProgress, TokenChunk

SequenceEvent = tuple["TorchSequence", TokenChunk]
"""What the worker hands to the event loop: a chunk for one request's caller."""

_NO_TOKEN: list[Any] = []


class TorchSequence(RequestProgress):
    """A request in the torch engine. Its tokens, logprobs and versions are written by the
    worker thread only, and never again once it has ended; ``finish`` is set by the event
    loop when the caller is told it ended."""

    __slots__ = ("stream", "queue", "stop_ids", "matcher")

    def __init__(self, request: GenerateRequest, eos: int | None, stream: bool) -> None:
        super().__init__(request)
        self.stream = stream  # a streaming caller gets a chunk per token; others one at the end
        self.queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        stop = set(request.params.stop_token_ids)
        if eos is not None and not request.params.ignore_eos:
            stop.add(eos)
        self.stop_ids = stop
        self.matcher: Any = None  # the grammar's state, a constrained request's (engines.grammar)

    def token(self, token: int, logprob: float, version: int, alternatives: Alternatives) -> SequenceEvent:
        """(worker) A streaming caller's chunk of one new token that does not end the request."""
        chunk = TokenChunk(
            request_id=self.request.request_id,
            token_ids=[token],
            logprobs=[logprob],
            versions=[version],
            top_logprobs=[alternatives] if self.request.params.top_logprobs else _NO_TOKEN,
        )
        return self, chunk

    def end(self, reason: FinishReason, version: int) -> SequenceEvent:
        """(worker) The last chunk: the final token for a stream, and the finish reason."""
        if self.stream and reason != "abort":
            last = TokenChunk(
                request_id=self.request.request_id,
                token_ids=self.tokens[-1:],
                logprobs=self.logprobs[-1:],
                versions=[version],
                finish_reason=reason,
                top_logprobs=self.top_logprobs[-1:],
            )
            return self, last
        return self, TokenChunk(
            request_id=self.request.request_id,
            token_ids=_NO_TOKEN,
            logprobs=_NO_TOKEN,
            versions=_NO_TOKEN,
            finish_reason=reason,
        )


def oldest_version(sequences: list[TorchSequence]) -> int:
    """The oldest weight version among the tokens of the running ``sequences``; -1: none runs."""
    return min((seq.versions[0] for seq in sequences if seq.finish is None and seq.versions), default=-1)
