"""The tool-parser interface (``ToolParser``, what it returns: ``ParsedTurn``) and its limits.

A parser is stateless: one instance (``registry.get_parser``) serves every trajectory. ``parse`` never
raises; ``MAX_CALLS_PER_TURN`` and ``MAX_TAGS_PER_TURN`` bound the work one turn may cost (see
``rlasync.tools.parsers``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec

from ..base import ToolCall, ToolResult

MAX_CALLS_PER_TURN = 16
"""Calls and malformed calls read from one turn; later ones only count (``ParsedTurn.dropped``)."""
MAX_TAGS_PER_TURN = 128
"""Tags read from one turn (Hermes' tags; harmony's tokens, a run of one counting once, and the
messages and headers its ends close)."""
MAX_NAME_CHARS = 64
"""A name (a recipient, a tool) quoted in an error message is cut to this many characters."""


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


ReplyTemplate = tuple[str | Callable[[ToolResult], str], ...]
"""One tool reply in a format: its strings are the format's markup, its functions take from a
``ToolResult`` what came from outside the model (its text, a name the model chose)."""


def reply_pieces(
    results: Sequence[ToolResult],
    template: ReplyTemplate,
    generation_prompt: str,
    add_generation_prompt: bool,
) -> list[tuple[str, bool]]:
    """``ToolParser.response_pieces`` of a format: ``template`` filled from each result, in order,
    then the next assistant turn's header (``generation_prompt``: markup) if asked."""
    pieces = [
        (part, False) if isinstance(part, str) else (part(result), True)
        for result in results
        for part in template
    ]
    return pieces + ([(generation_prompt, False)] if add_generation_prompt else [])
