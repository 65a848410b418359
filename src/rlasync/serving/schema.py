"""The OpenAI API's request bodies as msgspec Structs, its response envelope, and its error shape.

Fields clients send that do not change what is generated (``user``, ``metadata``, ``store``…)
are read and ignored, as OpenAI's own server does; a field whose value would change the result
and that the engines cannot honour (a penalty, ``echo``, forced tool choice) is refused with a
400 naming it, never silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """What both endpoints take. None: not given (the endpoint's or the run's default)."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**62)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        return stops

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(
                    400, f"{name} is not supported: the engines sample without penalties", param=name
                )
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by the engines", param="logit_bias")


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    max_completion_tokens: MaxTokens | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    def check(self) -> None:
        self.check_unsupported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        for i, message in enumerate(self.messages):
            if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise APIError(
                    400,
                    f"messages[{i}].role must be system, developer, user, assistant or tool, got {message.get('role')!r}",
                    param=f"messages[{i}].role",
                )
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (
                    None,
                    "text",
                ):  # an image dropped in silence would train on a question never asked
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}] is a {kind} part: the served model reads text only",
                        param=f"messages[{i}].content[{j}]",
                    )
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        choice = self.tool_choice
        if not (choice in (None, "auto", "none", "required") or _named_function(choice)):
            raise APIError(
                400,
                "tool_choice takes auto, none, required or {type: function, function: {name: ...}}",
                param="tool_choice",
            )
        if (choice == "required" or _named_function(choice)) and not self.tools:
            raise APIError(
                400, "tool_choice forces a tool call, but the request offers no tools", param="tool_choice"
            )
        if self.response_format and self.response_format.get("type") not in (
            None,
            "text",
            "json_object",
            "json_schema",
        ):
            raise APIError(
                400, "response_format takes text, json_object or json_schema", param="response_format"
            )
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
                raise APIError(
                    400,
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                    param=f"tools[{i}]",
                )

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def alternatives(self) -> int:
        """How many most likely tokens to return at each position (``top_logprobs``)."""
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def parses_tools(self) -> bool:
        """Whether the model's text is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


def _named_function(choice: Any) -> bool:
    return (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    )


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions`` (the legacy text API): a prompt continued as it is."""

    prompt: str | list[Any]
    """Text, token ids, or a list of either (checked by ``prompts``)."""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")

    @property
    def alternatives(self) -> int:
        """How many most likely tokens to return at each position (``logprobs`` above 0)."""
        return self.logprobs or 0

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [list(p)]
        if p and all(
            isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(t, int) for t in x))
            for x in p
        ):
            return list(p)
        raise APIError(
            400, "prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt"
        )


def decode_request(body: bytes, kind: type[Any]) -> Any:
    """The body as ``kind``, or a 400 naming the field at fault."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rpartition("at `$.")[2].rstrip("`") if "at `$." in text else None
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


def envelope(
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


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
