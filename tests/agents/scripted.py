"""A scripted "model" for agent-loop tests: it answers with fixed texts, token by token.

It finds the turn it is in from the prompt (how many assistant headers it holds) and what
it already said in that turn (the tokens after the last header), so a loop that resumes a
turn from its partial tokens gets the rest of the same turn, as from a real seeded model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rlasync.engines import GenerateOutput, GenerateRequest, TokenChunk

HEADER = "<|im_start|>assistant\n"


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        turns: list[str],
        *,
        chunk: int = 2,
        version: int = 0,
        abort_first: int = 0,
        by_request_id: bool = False,
    ) -> None:
        self.by_request_id = (
            by_request_id  # read the turn from the loop's request id (formats without ChatML headers)
        )
        self.tokenizer = tokenizer
        self.turns = [tokenizer.encode(t + tokenizer.eos_token, add_special_tokens=False) for t in turns]
        self.header = tokenizer.encode(HEADER, add_special_tokens=False)
        self.chunk = chunk
        self.version = version
        self.abort_first = abort_first  # end this many requests with "abort" after one chunk
        self.requests: list[GenerateRequest] = []
        self.gate: asyncio.Event | None = None  # when set, each chunk waits for it

    def _position(self, ids: list[int]) -> tuple[int, int]:
        n, h, turn, last = len(ids), len(self.header), -1, 0
        for i in range(n - h + 1):
            if ids[i : i + h] == self.header:
                turn, last = turn + 1, i + h
        return turn, n - last

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        if self.by_request_id:  # "<trajectory>.<turn>.<tokens already said>.<aborts>-<interrupts>"
            _, turn_s, said_s, _ = request.request_id.rsplit(".", 3)
            turn, said = int(turn_s), int(said_s)
        else:
            turn, said = self._position(list(request.prompt_ids))
        script = self.turns[min(turn, len(self.turns) - 1)]
        rest = script[said:][: request.params.max_new_tokens]
        complete = len(script) - said <= request.params.max_new_tokens  # ends with its eos here
        aborting = self.abort_first > 0
        self.abort_first -= 1
        for i in range(0, len(rest), self.chunk):
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            piece = rest[i : i + self.chunk]
            finish = None
            if aborting:
                finish = "abort"
            elif i + self.chunk >= len(rest):
                finish = "stop" if complete else "length"
            yield TokenChunk(
                request_id=request.request_id,
                token_ids=piece,
                logprobs=[-0.5] * len(piece),
                versions=[self.version] * len(piece),
                finish_reason=finish,
            )  # type: ignore[arg-type]
            if finish is not None:
                return

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        tokens: list[int] = []
        finish = "abort"
        async for chunk in self.generate_stream(request):
            tokens += chunk.token_ids
            finish = chunk.finish_reason or finish
        return GenerateOutput(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            versions=[self.version] * len(tokens),
            finish_reason=finish,  # type: ignore[arg-type]
        )
