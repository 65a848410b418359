"""``POST /v1/responses`` (OpenAI's Responses API) on the same generation as the chat route: the
request's input items become chat messages, the reply becomes output items, and the call is
recorded with its tokens as a chat call is (an agent's Responses calls continue one another token
for token, and train exactly).

Taken: ``input`` (a string, or items: messages with ``input_text``/``output_text`` parts,
``function_call`` and ``function_call_output`` items; ``reasoning`` items are skipped),
``previous_response_id`` (the conversation of a response this endpoint kept, the latest
``agent.endpoint.stored_responses``; its instructions are not carried over, as OpenAI's are not),
``instructions``, function ``tools``, ``tool_choice``, ``text.format`` (text, json_object,
json_schema: structured outputs), ``temperature``, ``top_p``, ``max_output_tokens``, ``stream``.
A stream sends a reply's text delta by delta as it is generated; a reply that may hold
function calls (tools offered) arrives whole at its end, as on the chat route. Refused with a
400 naming them: a ``previous_response_id`` not kept here, tools other than functions, non-text
input parts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import msgspec

from .chat import ChatRoute, message_in
from .generation import Choice, Job
from .recording import Recording
from .responses import event_stream, json_response
from .schema import APIError, ChatRequest, MaxTokens, Temperature, TopP

LOGPROBS = "message.output_text.logprobs"
"""What ``include`` names to have each text token's logprob returned."""


class ResponsesRequest(msgspec.Struct, kw_only=True, dict=True):
    """``POST /v1/responses``. Fields that do not change what is generated (``metadata``,
    ``user``, ``truncation``, ``reasoning``...) are read and ignored; of ``include``, only
    ``message.output_text.logprobs`` means something here (each text token's logprob, with
    ``top_logprobs`` alternatives)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_output_tokens: MaxTokens | None = None
    stream: bool = False
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None

    def check(self) -> None:
        with _named_as_responses():
            self.as_chat.check()

    @property
    def logprobs(self) -> bool:
        """Whether the text comes with its tokens' logprobs (``include``, or ``top_logprobs``)."""
        return LOGPROBS in (self.include or ()) or bool(self.top_logprobs)

    @functools.cached_property
    def as_chat(self) -> ChatRequest:
        """The same request as the chat route takes it (converted once, at its check)."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function" or not tool.get("name"):
                raise APIError(
                    400,
                    f"tools[{i}]: only function tools are served, got {tool.get('type')!r}",
                    param=f"tools[{i}]",
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fmt = (self.text or {}).get("format") or {"type": "text"}
        response_format: dict[str, Any] | None = None
        if fmt.get("type") == "json_schema":
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")},
            }
        elif fmt.get("type") == "json_object":
            response_format = {"type": "json_object"}
        elif fmt.get("type") != "text":
            raise APIError(
                400,
                f"text.format: text, json_object or json_schema, got {fmt.get('type')!r}",
                param="text.format",
            )
        return ChatRequest(
            model=self.model,
            messages=messages_of(self.input, self.instructions),
            tools=tools or None,
            tool_choice=choice,
            response_format=response_format,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_output_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else None,
        )


@contextlib.contextmanager
def _named_as_responses() -> Iterator[None]:
    """A chat request's 400 with the Responses API's name of the parameter at fault."""
    try:
        yield
    except APIError as exc:
        exc.param = {"response_format": "text.format", "max_tokens": "max_output_tokens"}.get(
            exc.param or "", exc.param
        )
        raise


def messages_of(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: an assistant's text and its function calls are one
    assistant message (as the chat route answered it), a call's output a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            text = content if isinstance(content, str) else _text(content, f"input[{i}].content")
            if item.get("role") == "assistant" and messages and _open_assistant(messages[-1]):
                messages[-1]["content"] = (messages[-1]["content"] or "") + text
            else:
                messages.append({"role": item.get("role", "user"), "content": text})
        elif kind == "function_call":
            if not (messages and _open_assistant(messages[-1])):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not served", param=f"input[{i}]")
    return messages


def _open_assistant(message: dict[str, Any]) -> bool:
    return message.get("role") == "assistant"


def _text(parts: Any, param: str) -> str:
    texts = []
    for j, part in enumerate(parts or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                400, f"{param}[{j}] is a {kind} part: the served model reads text only", param=f"{param}[{j}]"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


class ResponsesRoute:
    """``POST /v1/responses`` through a ``ChatRoute`` (its prompt, grammar, generation and
    recording). ``stored``: how many latest responses' conversations are kept for
    ``previous_response_id``."""

    def __init__(self, chat: ChatRoute, stored: int = 1024) -> None:
        self.chat = chat
        self.stored = stored
        # response id -> its conversation (instructions left out: they are not carried over)
        self._conversations: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def _earlier(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation ``previous_response_id`` names ([] when none is named)."""
        if not req.previous_response_id:
            return []
        found = self._conversations.get(req.previous_response_id)
        if found is None:
            raise APIError(
                400,
                f"previous_response_id {req.previous_response_id!r}: no such response is kept here (the latest "
                f"agent.endpoint.stored_responses={self.stored} are, unless sent with store: false); "
                "send the whole conversation as input",
                param="previous_response_id",
            )
        self._conversations.move_to_end(req.previous_response_id)
        return found

    def _keep(self, req: ResponsesRequest, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if req.store is False or not self.stored:
            return
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.stored:
            self._conversations.popitem(last=False)

    async def __call__(self, req: ResponsesRequest, rec: Recording | None) -> Any:
        chat_req = req.as_chat
        earlier = self._earlier(req)
        if earlier:  # the instructions (this request's), then the kept conversation, then the input
            system = chat_req.messages[:1] if req.instructions else []
            chat_req = msgspec.structs.replace(
                chat_req, messages=[*system, *earlier, *chat_req.messages[len(system) :]]
            )
        messages = [message_in(m) for m in chat_req.messages]
        prompt = self.chat.prompt(rec, messages, chat_req.tools or None)
        with _named_as_responses():
            grammar = self.chat.grammar(chat_req)
        job = self.chat.generation.prepare(chat_req, rec, prompt, chat_req.new_tokens, grammar=grammar)
        if req.stream:
            return event_stream(self._stream(req, job, messages))
        (c,) = await self.chat.generation.all(job)
        return json_response(self._finish(req, job, messages, c))

    def _finish(
        self, req: ResponsesRequest, job: Job, messages: list[dict[str, Any]], c: Choice
    ) -> dict[str, Any]:
        """The response to a finished choice, recorded as the chat route records its replies."""
        chat_req = req.as_chat
        message, finish, calls = self.chat.reply(chat_req, c, job.rid, 0)
        self.chat.record(job, messages, chat_req.tools or None, c, message, finish, calls)
        self._keep(req, f"resp_{job.rid}", [*messages[1 if req.instructions else 0 :], message])
        logprobs = self.chat.generation.token_logprobs(c) if req.logprobs else []
        return _response(req, job.rid, message, finish, len(job.prompt), len(c.ids), logprobs)

    async def _stream(
        self, req: ResponsesRequest, job: Job, messages: list[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """The Responses API's events: a reply's text delta by delta as it is generated; a reply
        that may hold function calls (tools offered) whole at its end, its calls read from it."""
        event = _Events()
        started = {
            **_response(req, job.rid, {}, "stop", len(job.prompt), 0),
            "status": "in_progress",
            "usage": None,
        }
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        live = not req.as_chat.parses_tools
        opened = False
        token_logprobs = self.chat.generation.token_logprobs
        async for _, c, done in self.chat.generation.pieces(job, [], stream=True):
            delta = c.unsent(done, job.stops) if live else ""
            fresh = live and req.logprobs and c.tokens_sent < len(c.ids)
            if delta or fresh:
                if not opened:
                    opened = True
                    for chunk in event.text_opened(f"msg_{job.rid}"):
                        yield chunk
                logprobs = token_logprobs(c, c.unsent_tokens()) if fresh else []
                yield event(
                    "response.output_text.delta",
                    **_text_ids(f"msg_{job.rid}"),
                    delta=delta,
                    logprobs=logprobs,
                )
            if done:
                response = self._finish(req, job, messages, c)
                for index, item in enumerate(response["output"]):
                    for chunk in event.item(index, item, opened=opened and index == 0):
                        yield chunk
                yield event("response.completed", response=response)


def _response(
    req: ResponsesRequest,
    rid: str,
    message: dict[str, Any],
    finish: str,
    prompt: int,
    completion: int,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid}",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": message["content"],
                        "annotations": [],
                        "logprobs": logprobs or [],
                    }
                ],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    incomplete = finish == "length"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "model": req.model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": req.instructions,
        "output": output,
        "parallel_tool_calls": bool(req.parallel_tool_calls),
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": req.text or {"format": {"type": "text"}},
        "metadata": req.metadata or {},
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def _text_ids(item_id: str) -> dict[str, Any]:
    return {"item_id": item_id, "output_index": 0, "content_index": 0}


class _Events:
    """Server-sent events of one response, numbered in order, as the Responses API streams them."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **data: Any) -> bytes:
        self.number += 1
        body = msgspec.json.encode({"type": kind, "sequence_number": self.number, **data})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"

    def text_opened(self, item_id: str) -> Iterator[bytes]:
        """A message item and its text part begun (the first output item: text comes first)."""
        item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
        yield self("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        yield self("response.content_part.added", **_text_ids(item_id), part=part)

    def item(self, index: int, item: dict[str, Any], *, opened: bool) -> Iterator[bytes]:
        """The events of a finished output item; ``opened``: its text was already streamed."""
        if item["type"] == "message":
            text, logprobs = item["content"][0]["text"], item["content"][0]["logprobs"]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if not opened:  # (a message is the first item: its text comes before any call)
                yield from self.text_opened(item["id"])
                yield self("response.output_text.delta", **ids, delta=text, logprobs=logprobs)
            yield self("response.output_text.done", **ids, text=text, logprobs=logprobs)
            yield self("response.content_part.done", **ids, part=item["content"][0])
        else:
            yield self(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress"}
            )
            ids = {"item_id": item["id"], "output_index": index}
            yield self("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield self("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        yield self("response.output_item.done", output_index=index, item=item)
