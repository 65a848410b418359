"""Tool-call parsers: a model's text → what it said, what it thought, and the calls it made.

Contract: ``parse`` never raises, whatever the text (property-tested). A malformed call is an
entry in ``ParsedTurn.errors`` (a message for the model, ``error_result("parse_error", msg)``,
and a metric), never an exception or a silently dropped call (verl #3070, #4757). Parsers are
stateless: one instance (``get_parser``) serves every trajectory. Call ids are ``call_0``,
``call_1``… in the order of the turn (deterministic, so a resumed trajectory is identical).

Formats:

- ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number per turn.
  ``<think>…</think>`` is reasoning: calls in it are ignored, an unclosed ``<think>`` makes the
  rest of the text reasoning, and a first ``</think>`` outside calls with no ``<think>`` before
  it closes a ``<think>`` the generation prompt opened (DeepSeek-R1, QwQ): all before it is
  reasoning, calls included. ``arguments`` may be a JSON string of an object (decoded), may be
  called ``parameters``, or be absent (``{}``). A call whose JSON ends the text without
  ``</tool_call>`` is accepted: engines may strip the stop string.
- ``gpt-oss`` (harmony, ``openai/harmony`` ``docs/format.md``): messages
  ``<|start|>{header}<|message|>{body}<|end|>`` (or ``<|call|>``/``<|return|>``/the end of the
  text, since engines may drop the stop token); the first message's ``<|start|>assistant`` is in
  the prompt. ``analysis`` is reasoning; a message with recipient ``to=functions.NAME`` (in the
  role or the channel part of the header, ``<|constrain|>json`` optional) is a call with a JSON
  body; other assistant messages (``final``, commentary preambles) are content. Messages of other
  roles (a tool reply the model made up) are ignored. Built-in recipients (``python``,
  ``browser.*``) are reported as errors: only function tools exist here.

``content`` never contains reasoning or calls: it is what a reward reads. The training tokens
are the model's own, untouched by parsing.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec

from .base import ToolCall, ToolResult


class ParsedTurn(msgspec.Struct, kw_only=True):
    """One assistant turn, split."""

    content: str = ""
    """What the model said outside reasoning and calls, stripped of surrounding whitespace."""
    reasoning: str = ""
    """Its reasoning (``<think>`` blocks; harmony's analysis channel), stripped pieces joined by newlines."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    """One message per malformed call, written for the model (show them; count them)."""


class ToolParser(abc.ABC):
    """Reads calls from a model's text and writes the texts of its format."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        """Split one assistant turn (the decoded generation, special tokens kept). Never raises."""

    @abc.abstractmethod
    def render_turn(self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None) -> str:
        """The text a model of this format generates for this turn (scripted engines, SFT data, tests)."""

    @abc.abstractmethod
    def render_responses(self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True) -> str:
        """Tool replies as text in this format, for a tokenizer whose chat template does not know it.

        The text follows the assistant's end token; with ``add_generation_prompt`` it ends with the
        next assistant turn's header. Contents are inserted verbatim: tokenize them without
        special-token parsing if a tool's output could contain the format's special tokens.
        """

    def format_responses(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        """Tool replies as chat messages (role ``tool``) to append before ``apply_chat_template``."""
        return [{"role": "tool", "name": r.name, "tool_call_id": r.call_id, "content": r.text} for r in results]


# -- registry --------------------------------------------------------------------------------
P = TypeVar("P", bound=type[ToolParser])
_PARSERS: dict[str, type[ToolParser]] = {}
_INSTANCES: dict[str, ToolParser] = {}


def register_parser(name: str) -> Callable[[P], P]:
    """Class decorator: ``@register_parser("hermes")`` makes the parser available to ``get_parser``."""

    def decorate(cls: P) -> P:
        existing = _PARSERS.get(name)
        if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"parser name '{name}' is taken by {existing.__module__}.{existing.__qualname__}")
        cls.name = name
        _PARSERS[name] = cls
        _INSTANCES.pop(name, None)
        return cls

    return decorate


def get_parser(name: str) -> ToolParser:
    """The shared instance of the parser registered under ``name``."""
    if name not in _INSTANCES:
        if name not in _PARSERS:
            raise KeyError(f"unknown tool parser '{name}'; registered: {', '.join(sorted(_PARSERS))}")
        _INSTANCES[name] = _PARSERS[name]()
    return _INSTANCES[name]


def registered_parsers() -> list[str]:
    return sorted(_PARSERS)


# -- shared helpers --------------------------------------------------------------------------
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _json_error(e: Exception, offset: int = 0) -> str:
    """Why JSON did not decode; positions counted from ``offset`` (where the call's JSON starts)."""
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON ({e.msg} at character {e.pos - offset})"
    if isinstance(e, RecursionError):
        return "invalid JSON (nested too deeply)"
    return f"invalid JSON ({e})"  # e.g. an integer past Python's digit limit


def _arguments(raw: Any) -> tuple[dict[str, Any] | None, str]:
    """Arguments as a dict, or None and why; a JSON string of an object is decoded (some models double-encode)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as e:
            return None, f'"arguments" is a string but not JSON: {_json_error(e)}'
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(raw), "a number")
        return None, f'"arguments" must be a JSON object, got {kind}'
    return raw, ""


def _join(pieces: list[str]) -> str:
    return "\n".join(p for p in (piece.strip() for piece in pieces) if p)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # what transformers' `tojson` writes in chat templates


# -- hermes ----------------------------------------------------------------------------------
_HERMES_TAG = re.compile(r"<think>|</think>|<tool_call>")
_HERMES_HINT = 'write each call as <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>'


@register_parser("hermes")
class HermesParser(ToolParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen, Hermes, rlasync's tiny models)."""

    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        content: list[str] = []
        reasoning: list[str] = []
        turn = ParsedTurn()
        pos, opened = 0, False
        while (tag := _HERMES_TAG.search(text, pos)) is not None:
            content.append(text[pos : tag.start()])
            if tag.group() == "</think>":
                if not opened:  # the generation prompt opened <think>: all before is reasoning, calls included
                    turn.calls.clear()
                    turn.errors.clear()
                    content.clear()
                    reasoning.append(text[: tag.start()])
                    opened = True
                else:
                    content.append(tag.group())  # a stray closing tag: text
                pos = tag.end()
            elif tag.group() == "<think>":
                opened = True
                end = text.find("</think>", tag.end())
                if end == -1:  # never closed: everything after is thinking, calls included
                    reasoning.append(text[tag.end() :])
                    pos = len(text)
                    break
                reasoning.append(text[tag.end() : end])
                pos = end + len("</think>")
            else:
                pos = self._read_call(text, tag.end(), turn, call_id_prefix)
        content.append(text[pos:])
        turn.content, turn.reasoning = "".join(content).strip(), _join(reasoning)
        return turn

    def _read_call(self, text: str, start: int, turn: ParsedTurn, prefix: str) -> int:
        """Read one call whose body starts at ``start``; record it or its error; return where to go on."""
        number = len(turn.calls) + len(turn.errors) + 1
        body = _WHITESPACE.match(text, start).end()  # type: ignore[union-attr]  # matches the empty string
        try:
            obj, end = _DECODER.raw_decode(text, body)  # not a regex to </tool_call>: it may be inside a string
        except (ValueError, RecursionError) as e:
            problem = _json_error(e, body)
        else:
            after = _WHITESPACE.match(text, end).end()  # type: ignore[union-attr]
            if text.startswith("</tool_call>", after) or after == len(text):
                call, problem = self._call(obj, f"{prefix}{len(turn.calls)}")
                if call is not None:
                    turn.calls.append(call)
                else:
                    turn.errors.append(f"invalid tool call #{number}: {problem}; {_HERMES_HINT}")
                return min(after + len("</tool_call>"), len(text))
            problem = "unexpected text after the JSON object"
        close = text.find("</tool_call>", start)
        if close == -1:
            turn.errors.append(f"invalid tool call #{number}: {problem}, and no </tool_call>; {_HERMES_HINT}")
            return len(text)
        turn.errors.append(f"invalid tool call #{number}: {problem}; {_HERMES_HINT}")
        return close + len("</tool_call>")

    @staticmethod
    def _call(obj: Any, call_id: str) -> tuple[ToolCall | None, str]:
        if not isinstance(obj, dict):
            return None, 'a call must be a JSON object with "name" and "arguments"'
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, 'missing "name" (a non-empty string)'
        arguments, problem = _arguments(obj["arguments"] if "arguments" in obj else obj.get("parameters", {}))
        if arguments is None:
            return None, problem
        return ToolCall(name, arguments, call_id), ""

    def render_turn(self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None) -> str:
        # The byte layout of rlasync's CHAT_TEMPLATE (rlasync.models.chat_template) for an assistant turn.
        think = "" if reasoning is None else f"<think>{reasoning}</think>"
        rendered = (f'<tool_call>{{"name": {_dumps(c.name)}, "arguments": {_dumps(c.arguments)}}}</tool_call>' for c in calls)
        return think + content + "".join(rendered)

    def render_responses(self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True) -> str:
        # rlasync's CHAT_TEMPLATE: each tool message is a user turn. Other ChatML templates (Qwen's)
        # group them differently: for those, render format_responses with the tokenizer's template.
        turns = "".join(f"<|im_start|>user\n<tool_response>{r.text}</tool_response><|im_end|>\n" for r in results)
        return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# -- gpt-oss (harmony) -----------------------------------------------------------------------
_HARMONY_TOKEN = re.compile(r"<\|(start|end|message|channel|constrain|call|return)\|>")
_HARMONY_HINT = "call a function as <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"


class _Header:
    """A harmony message header being read: ``role [to=R]<|channel|>channel [to=R] <|constrain|>json``."""

    __slots__ = ("parts", "part", "explicit")

    def __init__(self, explicit: bool) -> None:
        self.parts = {"role": "", "channel": "", "constrain": ""}
        self.part = "role"
        self.explicit = explicit  # opened by <|start|> (rather than implied by the prompt or sloppiness)

    def fields(self) -> tuple[str, str, str | None]:
        """(role, channel, recipient)."""
        role_words, channel_words = self.parts["role"].split(), self.parts["channel"].split()
        words = role_words + channel_words + self.parts["constrain"].split()
        recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        role = role_words[0] if role_words and not role_words[0].startswith("to=") else "assistant"
        channel = channel_words[0] if channel_words and not channel_words[0].startswith("to=") else ""
        return role, channel, recipient


@register_parser("gpt-oss")
class HarmonyParser(ToolParser):
    """OpenAI's harmony format (gpt-oss)."""

    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        turn = ParsedTurn()
        content: list[str] = []
        reasoning: list[str] = []
        header = _Header(explicit=False)  # the prompt ends with <|start|>assistant
        in_body = False
        body: list[str] = []
        pos = 0
        for token in _HARMONY_TOKEN.finditer(text):
            chunk, kind = text[pos : token.start()], token.group(1)
            pos = token.end()
            if not in_body:
                header.parts[header.part] += chunk
                if kind in ("channel", "constrain"):
                    header.part = kind
                elif kind == "message":
                    in_body, body = True, []
                else:  # <|start|>, or a terminator: this header never got a body
                    self._stray(header, turn, content)
                    header = _Header(explicit=kind == "start")
            elif kind in ("end", "call", "return", "start"):
                body.append(chunk)
                self._message(header, "".join(body), turn, content, reasoning, call_id_prefix)
                header, in_body = _Header(explicit=kind == "start"), False
            else:  # <|channel|>, <|constrain|> or <|message|> inside a body: literal text
                body.append(chunk + token.group())
        tail = text[pos:]
        if in_body:  # cut off, or the engine dropped the stop token
            body.append(tail)
            self._message(header, "".join(body), turn, content, reasoning, call_id_prefix)
        else:
            header.parts[header.part] += tail
            self._stray(header, turn, content)
        turn.content, turn.reasoning = _join(content), _join(reasoning)
        return turn

    def _message(
        self, header: _Header, body: str, turn: ParsedTurn, content: list[str], reasoning: list[str], prefix: str
    ) -> None:
        role, channel, recipient = header.fields()
        if role != "assistant":
            return  # not the model's own message (e.g. a tool reply it made up)
        if recipient is None:
            (reasoning if channel == "analysis" else content).append(body)
            return
        number = len(turn.calls) + len(turn.errors) + 1
        if not recipient.startswith("functions.") or recipient == "functions.":
            turn.errors.append(f"invalid tool call #{number}: '{recipient}' is not a function tool; {_HARMONY_HINT}")
            return
        name, raw = recipient[len("functions.") :], body.strip()
        try:
            decoded: Any = json.loads(raw) if raw else {}
        except (ValueError, RecursionError) as e:
            turn.errors.append(f"invalid tool call #{number} to {name}: {_json_error(e)}; {_HARMONY_HINT}")
            return
        arguments, problem = _arguments(decoded)
        if arguments is None:
            turn.errors.append(f"invalid tool call #{number} to {name}: {problem}; {_HARMONY_HINT}")
            return
        turn.calls.append(ToolCall(name, arguments, f"{prefix}{len(turn.calls)}"))

    @staticmethod
    def _stray(header: _Header, turn: ParsedTurn, content: list[str]) -> None:
        """A header that never reached ``<|message|>`` (cut off, or text outside the format)."""
        if not any(part.strip() for part in header.parts.values()):
            return
        role, _, recipient = header.fields()
        if header.explicit or header.parts["channel"] or header.parts["constrain"]:
            if recipient is not None and role == "assistant":
                number = len(turn.calls) + len(turn.errors) + 1
                turn.errors.append(f"invalid tool call #{number} to {recipient}: no <|message|> body; {_HARMONY_HINT}")
            return
        content.append(header.parts["role"])  # plain text with no harmony structure: what the model said

    def render_turn(self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None) -> str:
        messages = [] if reasoning is None else [f"<|channel|>analysis<|message|>{reasoning}<|end|>"]
        if calls:
            if content:  # a preamble before the calls
                messages.append(f"<|channel|>commentary<|message|>{content}<|end|>")
            messages += [
                f"<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>{_dumps(c.arguments)}<|call|>"
                for c in calls
            ]
        else:
            messages.append(f"<|channel|>final<|message|>{content}<|return|>")
        return "<|start|>assistant".join(messages)  # the first message's header start is in the prompt

    def render_responses(self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True) -> str:
        # A reply to a malformed call has no name: "functions.unknown" keeps the header well-formed.
        replies = "".join(
            f"<|start|>functions.{r.name or 'unknown'} to=assistant<|channel|>commentary<|message|>{r.text}<|end|>"
            for r in results
        )
        return replies + ("<|start|>assistant" if add_generation_prompt else "")
