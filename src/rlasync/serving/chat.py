"""``POST /v1/chat/completions``: messages in, the assistant's reply out, whole or streamed.

The model's chat template renders the prompt, and its tool parser (``agent.tool_parser``) reads
calls from the reply. A recorded conversation that the client sends back, with tool or user
turns added, goes on from its own tokens (``Recording.continued``), never from the model's text
tokenised again, so the calls continue one another token for token.

Streaming a request that offers tools sends the reply whole in one chunk at its end: its tool
calls are read from the whole text.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..agents.template import ChatTurns, TemplateError
from .constrained import grammar_of
from .generation import Choice, Generation, Job
from .recording import Recording, text_of
from .responses import DONE, event_stream, json_response, sse
from .schema import APIError, ChatRequest, envelope, usage


class ChatRoute:
    def __init__(
        self, generation: Generation, turns: ChatTurns, parser: Any, tool_format: str = "hermes"
    ) -> None:
        self.generation = generation
        self.turns = turns
        self.parser = parser
        self.tool_format = tool_format

    async def __call__(self, req: ChatRequest, rec: Recording | None) -> Any:
        """The reply to ``req`` (decoded and checked by the server), or its stream."""
        messages = [message_in(m) for m in req.messages]
        tools = req.tools or None
        prompt = self.prompt(rec, messages, tools)
        job = self.generation.prepare(req, rec, prompt, req.new_tokens, grammar=self.grammar(req))
        if req.stream:
            return event_stream(self._stream(req, job, messages))
        choices = await self.generation.all(job)
        out = []
        for i, c in enumerate(choices):
            message, finish, calls = self.reply(req, c, job.rid, i)
            out.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": self.generation.token_logprobs(c)} if req.logprobs else None,
                    "finish_reason": finish,
                }
            )
            self.record(job, messages, tools, c, message, finish, calls)
        counted = usage(len(prompt), sum(len(c.ids) for c in choices))
        return json_response(envelope("chat.completion", job.rid, req.model, out, usage=counted))

    def grammar(self, req: ChatRequest) -> str:
        """What ``req``'s response_format or forced tool_choice constrains the reply to ("": nothing)."""
        return grammar_of(req, self.generation.tokenizer, self.tool_format)

    def prompt(self, rec: Recording | None, messages: list[dict[str, Any]], tools: Any) -> list[int]:
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

    def reply(self, req: ChatRequest, c: Choice, rid: str, index: int) -> tuple[dict[str, Any], str, int]:
        """Choice ``c``'s assistant message, its finish reason and its number of tool calls."""
        text = c.text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not req.parses_tools:
            return message, c.reason, 0
        parsed = self.parser.parse(text, call_id_prefix=f"call_{rid}_{index}_")
        if not parsed.calls:
            return message, c.reason, 0
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

    def record(
        self,
        job: Job,
        messages: list[dict[str, Any]],
        tools: Any,
        c: Choice,
        message: dict[str, Any],
        finish: str,
        calls: int,
    ) -> None:
        """Keep the call in the job's recording (tokens, logprobs, versions), and the conversation's
        tokens when the reply ended its turn, so a request that continues it goes on from them."""
        rec = job.rec
        if rec is None:
            return
        conversation = [*messages, message]
        rec.calls.append(self.generation.call(job.prompt, c, finish, conversation, calls))
        if c.finish == "stop" and not c.stopped and c.ids and c.ids[-1] == self.generation.eos:
            rec.remember(conversation, tools, job.prompt + c.ids)  # it ended its turn: it may be continued

    async def _stream(
        self, req: ChatRequest, job: Job, messages: list[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        token_logprobs = self.generation.token_logprobs

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
        ) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope("chat.completion.chunk", job.rid, req.model, [choice], created=created))

        choices: list[Choice] = []
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        whole = req.parses_tools  # calls are read from the whole reply: it is sent at its end
        async for i, c, done in self.generation.pieces(job, choices, stream=True):
            if not whole:
                delta = c.unsent(done, job.stops)
                fresh = req.logprobs and c.tokens_sent < len(c.ids)
                if delta or fresh:
                    logprobs = {"content": token_logprobs(c, c.unsent_tokens())} if fresh else None
                    yield chunk(i, {"content": delta}, logprobs=logprobs)
            if done:
                message, finish, calls = self.reply(req, c, job.rid, i)
                if whole:
                    final = {k: v for k, v in message.items() if k != "role"}
                    if "tool_calls" in final:  # a streamed call carries its place in the list
                        final["tool_calls"] = [
                            dict(call, index=k) for k, call in enumerate(final["tool_calls"])
                        ]
                    logprobs = {"content": token_logprobs(c)} if req.logprobs else None
                    yield chunk(i, final, logprobs=logprobs)
                yield chunk(i, {}, finish)
                self.record(job, messages, req.tools or None, c, message, finish, calls)
        if req.stream_options is not None and req.stream_options.include_usage:
            counted = usage(len(job.prompt), sum(len(c.ids) for c in choices))
            yield sse(
                envelope("chat.completion.chunk", job.rid, req.model, [], created=created, usage=counted)
            )
        yield DONE


def message_in(message: dict[str, Any]) -> dict[str, Any]:
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
