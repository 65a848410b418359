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

Hostile text: parsing is linear in the text and cheap per tag (a JSON body is decoded from its
own block, never from the whole text; harmony's text is split in C and headers built in lists).
Once ``MAX_CALLS_PER_TURN`` calls and malformed calls, or ``MAX_TAGS_PER_TURN`` tags (Hermes'
``<tool_call>``/``<think>``/``</think>``; harmony's control tokens, and its messages and headers
ended by an end token) are read,
the rest of the turn is not: its calls are counted in ``ParsedTurn.dropped`` (one per
``<tool_call>``, or per ``to=`` recipient) and its text is neither ``content`` nor reasoning. A
turn of 16 harmony calls holds about 80; a flood of tiny messages would otherwise cost Python work
per message, a few microseconds each. A name shown in an error is cut to ``MAX_NAME_CHARS``, and
decoded strings are valid UTF-8 text (a ``"\\ud800"`` escape becomes U+FFFD: a lone surrogate
cannot be tokenised or sent).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec

from ..registry import Registry
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
    dropped: int = 0
    """Calls past ``MAX_CALLS_PER_TURN`` (well-formed or not): counted, never read."""


class ToolParser(abc.ABC):
    """Reads calls from a model's text and writes the texts of its format."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        """Split one assistant turn (the decoded generation, special tokens kept). Never raises."""

    @abc.abstractmethod
    def render_turn(
        self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None
    ) -> str:
        """The text a model of this format generates for this turn (scripted engines, SFT data, tests)."""

    @abc.abstractmethod
    def response_pieces(
        self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        """Tool replies in this format, for a tokenizer whose chat template does not know it: the
        text in pieces, ``(text, True)`` for what came from outside the model (a tool's output, a
        name the model chose), ``(text, False)`` for the format's markup. Tokenise the first kind
        with special tokens split (``ChatTurns.encode_pieces``): a tool printing the format's
        control tokens must not forge a turn.

        The text follows the assistant's end token; with ``add_generation_prompt`` it ends with the
        next assistant turn's header.
        """

    def render_responses(self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True) -> str:
        """``response_pieces`` as one text (for reading; tokenise the pieces, not this)."""
        return "".join(
            text for text, _ in self.response_pieces(results, add_generation_prompt=add_generation_prompt)
        )

    def format_responses(self, results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        """Tool replies as chat messages (role ``tool``) to append before ``apply_chat_template``."""
        return [
            {"role": "tool", "name": r.name, "tool_call_id": r.call_id, "content": r.text} for r in results
        ]


# -- registry --------------------------------------------------------------------------------
P = TypeVar("P", bound=type[ToolParser])
_PARSERS = Registry[type[ToolParser]](
    "tool parser",
    unknown="unknown tool parser '{name}'; registered: {known}",
    taken="parser name '{name}' is taken by {old.__module__}.{old.__qualname__}",
)
_INSTANCES: dict[str, ToolParser] = {}  # parsers are stateless: one shared instance per name


def register_parser(name: str) -> Callable[[P], P]:
    """Class decorator: ``@register_parser("hermes")`` makes the parser available to ``get_parser``."""

    def decorate(cls: P) -> P:
        _PARSERS.register(name, cls)
        cls.name = name
        _INSTANCES.pop(name, None)  # a class registered again: the next get_parser builds it
        return cls

    return decorate


def get_parser(name: str) -> ToolParser:
    """The shared instance of the parser registered under ``name``."""
    if name not in _INSTANCES:
        _INSTANCES[name] = _PARSERS.get(name)()
    return _INSTANCES[name]


def registered_parsers() -> list[str]:
    return _PARSERS.names()


# -- shared helpers --------------------------------------------------------------------------
MAX_CALLS_PER_TURN = 16
"""Calls and malformed calls read from one turn; later ones only count (``ParsedTurn.dropped``)."""
MAX_TAGS_PER_TURN = 128
"""Tags read from one turn (Hermes' tags; harmony's tokens, a run of one counting once, and the
messages and headers its ends close)."""
MAX_NAME_CHARS = 64
"""A name (a recipient, a tool) quoted in an error message is cut to this many characters."""

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (tokenisers and msgspec refuse them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _clean(value: Any) -> Any:
    """A decoded JSON value with lone surrogates replaced, in strings and keys alike."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _decode_json(raw: str) -> Any:
    """``json.loads`` of a call's own text (its errors count lines in it alone), surrogates cleaned."""
    value = json.loads(raw)
    return _clean(value) if _SURROGATE_ESCAPE.search(raw) else value


def _shown(name: str) -> str:
    """A model-chosen name as quoted in an error: cut to ``MAX_NAME_CHARS``."""
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."


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
            raw = _decode_json(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as e:
            return None, f'"arguments" is a string but not JSON: {_json_error(e)}'
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(raw), "a number"
        )
        return None, f'"arguments" must be a JSON object, got {kind}'
    return raw, ""


def _join(pieces: list[str]) -> str:
    return "\n".join(filter(None, map(str.strip, pieces)))  # in C: a turn may hold 100k pieces


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # what transformers' `tojson` writes in chat templates


# -- hermes ----------------------------------------------------------------------------------
_HERMES_TAG = re.compile(r"<think>|</think>|<tool_call>")
_HERMES_CLOSE = "</tool_call>"
_HERMES_HINT = 'write each call as <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>'


@register_parser("hermes")
class HermesParser(ToolParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen, Hermes, rlasync's tiny models)."""

    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        content: list[str] = []
        reasoning: list[str] = []
        turn = ParsedTurn()
        search = _HERMES_TAG.search
        pos, opened, retry, tags = 0, False, True, 0
        closing = -2  # where the first </think> after the calls' cap lies (-1: none; found once)
        while (tag := search(text, pos)) is not None:
            kind, start = tag.group(), tag.start()
            content.append(text[pos:start])
            if (tags := tags + 1) > MAX_TAGS_PER_TURN:  # the rest is not read: its calls only count
                turn.dropped += text.count("<tool_call>", start)
                pos = len(text)
                break
            if kind == "<tool_call>":
                if len(turn.calls) + len(turn.errors) < MAX_CALLS_PER_TURN:
                    pos, retry = self._read_call(text, tag.end(), turn, call_id_prefix, retry)
                elif opened or (closing := text.find("</think>", start) if closing == -2 else closing) == -1:
                    # The turn's calls are read: the rest only counts.
                    turn.dropped += text.count("<tool_call>", start)
                    pos = len(text)
                    break
                else:  # a </think> ahead may yet make all of this reasoning: read on, counting
                    turn.dropped += 1
                    close = text.find(_HERMES_CLOSE, tag.end())
                    pos = len(text) if close == -1 else close + len(_HERMES_CLOSE)
            elif kind == "</think>":
                if (
                    not opened
                ):  # the generation prompt opened <think>: all before is reasoning, calls included
                    turn.calls.clear()
                    turn.errors.clear()
                    turn.dropped = 0
                    content.clear()
                    reasoning.append(text[:start])
                    opened = True
                else:
                    content.append(kind)  # a stray closing tag: text
                pos = tag.end()
            else:  # <think>
                opened = True
                end = text.find("</think>", tag.end())
                if end == -1:  # never closed: everything after is thinking, calls included
                    reasoning.append(text[tag.end() :])
                    pos = len(text)
                    break
                reasoning.append(text[tag.end() : end])
                pos = end + len("</think>")
        content.append(text[pos:])
        turn.content, turn.reasoning = "".join(content).strip(), _join(reasoning)
        return turn

    def _read_call(
        self, text: str, start: int, turn: ParsedTurn, prefix: str, retry: bool
    ) -> tuple[int, bool]:
        """Read one call whose body starts at ``start``; record it or its error. Where to go on,
        and whether the retry is still unspent.

        The JSON is decoded from its block alone (up to the next ``</tool_call>``, or the end of the
        text when the engine stripped it): decoding from the whole text made every error count the
        lines before it, quadratic in the number of calls. A JSON string may hold ``</tool_call>``:
        a block whose string runs past its end is decoded once more over the rest of the text (one
        such retry per turn keeps the parse linear)."""
        number = len(turn.calls) + len(turn.errors) + 1
        body = _WHITESPACE.match(text, start).end()  # type: ignore[union-attr]  # matches the empty string
        close = text.find(_HERMES_CLOSE, body)
        stop = len(text) if close == -1 else close
        obj, end, problem = self._decode(text[body:stop])
        if retry and close != -1 and problem.startswith("invalid JSON (Unterminated string"):
            retry = False  # a string holding </tool_call>: decode the rest of the text, once
            obj, end, problem = self._decode(text[body:])
            if not problem:
                close = text.find(_HERMES_CLOSE, body + end)
                stop = len(text) if close == -1 else close
        if not problem:
            after = _WHITESPACE.match(text, body + end).end()  # type: ignore[union-attr]
            if after == stop:
                call, problem = self._call(obj, f"{prefix}{len(turn.calls)}")
                if call is not None:
                    turn.calls.append(call)
                else:
                    turn.errors.append(f"invalid tool call #{number}: {problem}; {_HERMES_HINT}")
                return min(stop + len(_HERMES_CLOSE), len(text)), retry
            problem = "unexpected text after the JSON object"
        if close == -1:
            turn.errors.append(f"invalid tool call #{number}: {problem}, and no </tool_call>; {_HERMES_HINT}")
            return len(text), retry
        turn.errors.append(f"invalid tool call #{number}: {problem}; {_HERMES_HINT}")
        return close + len(_HERMES_CLOSE), retry

    @staticmethod
    def _decode(block: str) -> tuple[Any, int, str]:
        """(value, where it ended in ``block``, "") or (None, 0, why it is not JSON)."""
        try:
            obj, end = _DECODER.raw_decode(block)
        except (ValueError, RecursionError) as e:
            return None, 0, _json_error(e)
        return (_clean(obj) if _SURROGATE_ESCAPE.search(block, 0, end) else obj), end, ""

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

    def render_turn(
        self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None
    ) -> str:
        # The byte layout of rlasync's CHAT_TEMPLATE (rlasync.models.chat_template) for an assistant turn.
        think = "" if reasoning is None else f"<think>{reasoning}</think>"
        rendered = (
            f'<tool_call>{{"name": {_dumps(c.name)}, "arguments": {_dumps(c.arguments)}}}</tool_call>'
            for c in calls
        )
        return think + content + "".join(rendered)

    def response_pieces(
        self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        # rlasync's CHAT_TEMPLATE: each tool message is a user turn. Other ChatML templates (Qwen's)
        # group them differently: for those, render format_responses with the tokenizer's template.
        pieces: list[tuple[str, bool]] = []
        for r in results:
            pieces += [
                ("<|im_start|>user\n<tool_response>", False),
                (r.text, True),
                ("</tool_response><|im_end|>\n", False),
            ]
        return pieces + ([("<|im_start|>assistant\n", False)] if add_generation_prompt else [])


# -- gpt-oss (harmony) -----------------------------------------------------------------------
# Linear, and cheap per token: the structural tokens are found in C, one at a time (a turn read
# far enough leaves the rest unscanned but for a count); ends (<|end|>, <|call|>, <|return|>) are
# found between them in C too, so text between ends outside any message is taken in bulk, and a
# body is one slice. A run of one token with plain text between counts as one: a second
# <|channel|> (or <|constrain|>) only adds its text to the part, a second <|message|> is body
# text, and a <|start|> after words without a recipient ends a header that holds nothing.
# Greedy, not possessive (*+): each run's text class excludes the '<' its next token starts
# with, so there is nothing to backtrack into and the two match alike, and CPython 3.11.2
# (Debian 12's python3.11) matched `<|start|>x to=y<|channel|>` wrongly with *+ (fixed later in 3.11).
_STRUCTURE = re.compile(
    r"(<\|(?:start\|>(?:(?:(?!to=)[^<])*<\|start\|>)*|message\|>(?:[^<]*<\|message\|>)*"
    r"|channel\|>(?:[^<]*<\|channel\|>)*|constrain\|>(?:[^<]*<\|constrain\|>)*))"
)  # a literal first, so the scan is fast
_ENDS = re.compile(r"<\|(?:end|call|return)\|>")
_MESSAGE, _CHANNEL, _CONSTRAIN = "<|message|>", "<|channel|>", "<|constrain|>"
_RECIPIENT = re.compile(r"(?<!\S)to=(\S*)")
_FIRST_WORD = re.compile(r"\s*(\S+)")
_HARMONY_HINT = (
    "call a function as <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"
)


class _Header:
    """A harmony message header being read: ``role [to=R]<|channel|>channel [to=R] <|constrain|>json``."""

    __slots__ = ("role", "channel", "constrain", "part", "explicit", "to")

    def __init__(self, explicit: bool) -> None:
        self.role: list[str] = []
        self.channel: list[str] = []
        self.constrain: list[str] = []
        self.part = self.role  # the part the next text goes to
        self.explicit = explicit  # opened by <|start|> (rather than implied by the prompt or sloppiness)
        self.to = False  # some part names a recipient (``to=``): a call, or a message to someone else

    def add(self, text: str) -> None:
        if text:
            self.part.append(text)
            if "to=" in text:
                self.to = True

    def fields(self) -> tuple[str, str, str | None]:
        """(role, channel, recipient): the first word of each part, and the first ``to=`` word of any."""
        role_text, channel_text = "".join(self.role), "".join(self.channel)
        to = self.to and (
            _RECIPIENT.search(role_text)
            or _RECIPIENT.search(channel_text)
            or _RECIPIENT.search("".join(self.constrain))
        )
        role = _FIRST_WORD.match(role_text) if role_text else None
        channel = _FIRST_WORD.match(channel_text) if channel_text else None
        return (
            role.group(1) if role and not role.group(1).startswith("to=") else "assistant",
            channel.group(1) if channel and not channel.group(1).startswith("to=") else "",
            to.group(1) if to else None,
        )


@register_parser("gpt-oss")
class HarmonyParser(ToolParser):
    """OpenAI's harmony format (gpt-oss)."""

    def parse(self, text: str, *, call_id_prefix: str = "call_") -> ParsedTurn:
        turn = ParsedTurn()
        content: list[str] = []
        reasoning: list[str] = []
        header = _Header(explicit=False)  # the prompt ends with <|start|>assistant
        body = -1  # where the body being read starts in the text; -1 while reading a header
        pos = steps = 0  # where the text not yet read starts; tokens read and messages and headers ended
        tokens = _STRUCTURE.finditer(text)
        while True:
            token = next(tokens, None)
            stop = len(text) if token is None else token.start()  # the text up to the next token
            if body >= 0:  # a body ends at the first end in it, or at the next <|start|>
                end = _ENDS.search(text, pos, stop)
                if end is not None:
                    self._message(header, text[body : end.start()], turn, content, reasoning, call_id_prefix)
                    header, body, pos, steps = _Header(explicit=False), -1, end.end(), steps + 1
                    if (
                        steps >= MAX_TAGS_PER_TURN or len(turn.calls) + len(turn.errors) >= MAX_CALLS_PER_TURN
                    ):  # read far enough
                        break
                elif token is None:  # cut off, or the engine dropped the stop token
                    self._message(header, text[body:], turn, content, reasoning, call_id_prefix)
                    return self._done(turn, content, reasoning)
            if body < 0 and pos < stop:  # header text
                if _ENDS.search(text, pos, stop) is None:
                    chunk = text[pos:stop]
                    header.part.append(chunk)  # header.add, inlined: the hot path of degenerate headers
                    if "to=" in chunk:
                        header.to = True
                else:  # the header ends: what follows each end up to the next is a header of its own
                    ends = _ENDS.split(text[pos:stop], maxsplit=max(MAX_TAGS_PER_TURN - steps, 1))
                    header.add(ends[0])
                    self._stray(header, turn, content)
                    content += ends[1:-1]  # text between two ends, outside any message: what the model said
                    header, steps = _Header(explicit=False), steps + len(ends) - 1
                    header.add(ends[-1])
                    if (
                        steps >= MAX_TAGS_PER_TURN or len(turn.calls) + len(turn.errors) >= MAX_CALLS_PER_TURN
                    ):  # read far enough
                        break
            if token is None:
                self._stray(header, turn, content)
                return self._done(turn, content, reasoning)
            pos, steps = token.end(), steps + 1
            tag = token.group()
            kind = tag[2]  # s(tart), m(essage), c(hannel) or c(onstrain)
            if body >= 0:
                if kind == "s":  # <|start|>: the body ends, the next message begins
                    self._message(header, text[body:stop], turn, content, reasoning, call_id_prefix)
                    header, body = _Header(explicit=True), -1
                # <|channel|>, <|constrain|> or <|message|> inside a body: its text
            elif kind == "c":
                header.part, name = (
                    (header.channel, _CHANNEL) if tag[3] == "h" else (header.constrain, _CONSTRAIN)
                )
                if len(tag) > len(name):  # a run: the text between its tokens goes to the part
                    header.add(tag.replace(name, ""))
            elif kind == "m":
                body = stop + len(_MESSAGE)  # the run's later <|message|> tokens are body text
            elif header.explicit and not header.to and header.part is header.role and not header.channel:
                header.role.clear()  # <|start|> after a header of words alone: nothing to keep (and cheap)
            else:  # <|start|>: the header so far never got a body
                self._stray(header, turn, content)
                header = _Header(explicit=True)
            if (
                steps >= MAX_TAGS_PER_TURN or len(turn.calls) + len(turn.errors) >= MAX_CALLS_PER_TURN
            ):  # read far enough
                break
        # Read far enough: the rest (the header and any body being read, the text after) only counts.
        turn.dropped += header.to + text.count("to=", pos if body < 0 else body)
        return self._done(turn, content, reasoning)

    @staticmethod
    def _done(turn: ParsedTurn, content: list[str], reasoning: list[str]) -> ParsedTurn:
        turn.content, turn.reasoning = _join(content), _join(reasoning)
        return turn

    def _message(
        self,
        header: _Header,
        body: str,
        turn: ParsedTurn,
        content: list[str],
        reasoning: list[str],
        prefix: str,
    ) -> None:
        role, channel, recipient = header.fields()
        if role != "assistant":
            return  # not the model's own message (e.g. a tool reply it made up)
        if recipient is None:
            (reasoning if channel == "analysis" else content).append(body)
            return
        number = len(turn.calls) + len(turn.errors) + 1
        if number > MAX_CALLS_PER_TURN:
            turn.dropped += 1
            return
        if not recipient.startswith("functions.") or recipient == "functions.":
            turn.errors.append(
                f"invalid tool call #{number}: '{_shown(recipient)}' is not a function tool; {_HARMONY_HINT}"
            )
            return
        name, raw = recipient[len("functions.") :], body.strip()
        try:
            decoded: Any = _decode_json(raw) if raw else {}
        except (ValueError, RecursionError) as e:
            turn.errors.append(
                f"invalid tool call #{number} to {_shown(name)}: {_json_error(e)}; {_HARMONY_HINT}"
            )
            return
        arguments, problem = _arguments(decoded)
        if arguments is None:
            turn.errors.append(f"invalid tool call #{number} to {_shown(name)}: {problem}; {_HARMONY_HINT}")
            return
        turn.calls.append(ToolCall(name, arguments, f"{prefix}{len(turn.calls)}"))

    @staticmethod
    def _stray(header: _Header, turn: ParsedTurn, content: list[str]) -> None:
        """A header that never reached ``<|message|>`` (cut off, or text outside the format)."""
        if not (header.explicit or header.channel or header.constrain):
            content.append("".join(header.role))  # plain text with no harmony structure: what the model said
            return
        if not header.to:
            return
        role, _, recipient = header.fields()
        if recipient is None or role != "assistant":
            return
        number = len(turn.calls) + len(turn.errors) + 1
        if number > MAX_CALLS_PER_TURN:
            turn.dropped += 1
        else:
            turn.errors.append(
                f"invalid tool call #{number} to {_shown(recipient)}: no <|message|> body; {_HARMONY_HINT}"
            )

    def render_turn(
        self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None
    ) -> str:
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

    def response_pieces(
        self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        # A reply to a malformed call has no name: "functions.unknown" keeps the header well-formed.
        pieces: list[tuple[str, bool]] = []
        for r in results:
            pieces += [
                ("<|start|>functions.", False),
                (r.name or "unknown", True),
                (" to=assistant<|channel|>commentary<|message|>", False),
                (r.text, True),
                ("<|end|>", False),
            ]
        return pieces + ([("<|start|>assistant", False)] if add_generation_prompt else [])
