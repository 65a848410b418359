"""The ``hermes`` tool-call format: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.

Any number of calls per turn. ``<think>…</think>`` is reasoning: calls in it are ignored, an
unclosed ``<think>`` makes the rest of the text reasoning, and a first ``</think>`` outside calls
with no ``<think>`` before it closes a ``<think>`` the generation prompt opened (DeepSeek-R1,
QwQ): all before it is reasoning, calls included. ``arguments`` may be a JSON string of an object
(decoded), may be called ``parameters``, or be absent (``{}``). A call whose JSON ends the text
without ``</tool_call>`` is accepted: engines may strip the stop string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from ..base import ToolCall, ToolResult
from .base import MAX_CALLS_PER_TURN, MAX_TAGS_PER_TURN, ParsedTurn, ReplyTemplate, ToolParser, reply_pieces
from .decoding import arguments_object, clean_decoded, dumps, join_stripped, json_error
from .registry import register_parser

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_HERMES_TAG = re.compile(r"<think>|</think>|<tool_call>")
_HERMES_CLOSE = "</tool_call>"
_HERMES_HINT = 'write each call as <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>'
_REPLY: ReplyTemplate = (
    "<|im_start|>user\n<tool_response>",
    attrgetter("text"),
    "</tool_response><|im_end|>\n",
)


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
        turn.content, turn.reasoning = "".join(content).strip(), join_stripped(reasoning)
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
            return None, 0, json_error(e)
        return clean_decoded(obj, block, end), end, ""

    @staticmethod
    def _call(obj: Any, call_id: str) -> tuple[ToolCall | None, str]:
        if not isinstance(obj, dict):
            return None, 'a call must be a JSON object with "name" and "arguments"'
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, 'missing "name" (a non-empty string)'
        arguments, problem = arguments_object(
            obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
        )
        if arguments is None:
            return None, problem
        return ToolCall(name, arguments, call_id), ""

    def render_turn(
        self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None
    ) -> str:
        # The byte layout of rlasync's CHAT_TEMPLATE (rlasync.models.chat_template) for an assistant turn.
        think = "" if reasoning is None else f"<think>{reasoning}</think>"
        rendered = (
            f'<tool_call>{{"name": {dumps(c.name)}, "arguments": {dumps(c.arguments)}}}</tool_call>'
            for c in calls
        )
        return think + content + "".join(rendered)

    def response_pieces(
        self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        # rlasync's CHAT_TEMPLATE: each tool message is a user turn. Other ChatML templates (Qwen's)
        # group them differently: for those, render format_responses with the tokenizer's template.
        return reply_pieces(results, _REPLY, "<|im_start|>assistant\n", add_generation_prompt)
