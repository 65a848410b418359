"""The ``gpt-oss`` tool-call format: OpenAI's harmony (``openai/harmony`` ``docs/format.md``).

Messages ``<|start|>{header}<|message|>{body}<|end|>`` (or ``<|call|>``/``<|return|>``/the end of
the text, since engines may drop the stop token); the first message's ``<|start|>assistant`` is
in the prompt. ``analysis`` is reasoning; a message with recipient ``to=functions.NAME`` (in the
role or the channel part of the header, ``<|constrain|>json`` optional) is a call with a JSON
body; other assistant messages (``final``, commentary preambles) are content. Messages of other
roles (a tool reply the model made up) are ignored. Built-in recipients (``python``,
``browser.*``) are reported as errors: only function tools exist here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from ..base import ToolCall, ToolResult
from .base import MAX_CALLS_PER_TURN, MAX_TAGS_PER_TURN, ParsedTurn, ReplyTemplate, ToolParser, reply_pieces
from .decoding import arguments_object, decode_json, dumps, join_stripped, json_error, shown
from .registry import register_parser

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
# A reply to a malformed call has no name: "functions.unknown" keeps the header well-formed.
_REPLY: ReplyTemplate = (
    "<|start|>functions.",
    lambda result: result.name or "unknown",
    " to=assistant<|channel|>commentary<|message|>",
    attrgetter("text"),
    "<|end|>",
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
        turn.content, turn.reasoning = join_stripped(content), join_stripped(reasoning)
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
                f"invalid tool call #{number}: '{shown(recipient)}' is not a function tool; {_HARMONY_HINT}"
            )
            return
        name, raw = recipient[len("functions.") :], body.strip()
        try:
            decoded: Any = decode_json(raw) if raw else {}
        except (ValueError, RecursionError) as e:
            turn.errors.append(
                f"invalid tool call #{number} to {shown(name)}: {json_error(e)}; {_HARMONY_HINT}"
            )
            return
        arguments, problem = arguments_object(decoded)
        if arguments is None:
            turn.errors.append(f"invalid tool call #{number} to {shown(name)}: {problem}; {_HARMONY_HINT}")
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
                f"invalid tool call #{number} to {shown(recipient)}: no <|message|> body; {_HARMONY_HINT}"
            )

    def render_turn(
        self, calls: Sequence[ToolCall], *, content: str = "", reasoning: str | None = None
    ) -> str:
        messages = [] if reasoning is None else [f"<|channel|>analysis<|message|>{reasoning}<|end|>"]
        if calls:
            if content:  # a preamble before the calls
                messages.append(f"<|channel|>commentary<|message|>{content}<|end|>")
            messages += [
                f"<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>{dumps(c.arguments)}<|call|>"
                for c in calls
            ]
        else:
            messages.append(f"<|channel|>final<|message|>{content}<|return|>")
        return "<|start|>assistant".join(messages)  # the first message's header start is in the prompt

    def response_pieces(
        self, results: Sequence[ToolResult], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        return reply_pieces(results, _REPLY, "<|start|>assistant", add_generation_prompt)
