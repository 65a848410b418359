"""``POST /v1/completions``, the legacy text API: a prompt (text or token ids, or a list of
either) continued as it is, with no chat template; ``n`` choices a prompt, numbered prompt by
prompt. A stream takes one prompt. A recording keeps each choice as a call without messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from .generation import Choice, Generation, Job
from .recording import Recording
from .responses import DONE, event_stream, json_response, sse
from .schema import APIError, CompletionRequest, envelope, usage


class CompletionsRoute:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def __call__(self, req: CompletionRequest, rec: Recording | None) -> Any:
        """The choices for ``req`` (decoded and checked by the server), or their stream."""
        prompts = [self._prompt_ids(p) for p in req.prompts()]
        job = self.generation.prepare(req, rec, [], req.max_tokens or (None if rec is not None else 16))
        if req.stream:
            if len(prompts) > 1:
                raise APIError(400, "stream takes one prompt", param="prompt")
            return event_stream(self._stream(req, msgspec.structs.replace(job, prompt=prompts[0])))
        # Each prompt's choices have ids of their own; all share the request's engine.
        jobs = [msgspec.structs.replace(job, prompt=p, rid=f"{job.rid}-{k}") for k, p in enumerate(prompts)]
        results = await asyncio.gather(*[self.generation.all(j) for j in jobs])
        out = []
        for k, (prompt, choices) in enumerate(zip(prompts, results)):
            for i, c in enumerate(choices):
                finish = c.reason
                out.append(
                    {
                        "index": k * req.n + i,
                        "text": c.text,
                        "logprobs": self.generation.text_logprobs(c) if req.logprobs is not None else None,
                        "finish_reason": finish,
                    }
                )
                if rec is not None:
                    rec.calls.append(self.generation.call(prompt, c, finish, [], 0))
        counted = usage(sum(map(len, prompts)), sum(len(c.ids) for cs in results for c in cs))
        return json_response(envelope("text_completion", job.rid, req.model, out, usage=counted))

    async def _stream(self, req: CompletionRequest, job: Job) -> AsyncIterator[bytes]:
        created = int(time.time())
        choices: list[Choice] = []
        async for i, c, done in self.generation.pieces(job, choices, stream=True):
            delta = c.unsent(done, job.stops)
            finish = c.reason if done else None
            if delta or finish:
                choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}
                yield sse(envelope("text_completion", job.rid, req.model, [choice], created=created))
            if done and job.rec is not None:
                job.rec.calls.append(self.generation.call(job.prompt, c, str(finish), [], 0))
        yield DONE

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.generation.tokenizer.encode(prompt))
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise APIError(400, "a prompt of token ids must be a non-empty list of integers", param="prompt")
        return list(prompt)
