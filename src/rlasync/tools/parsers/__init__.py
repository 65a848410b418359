"""Tool-call parsers: a model's text → what it said, what it thought, and the calls it made.

    from rlasync.tools.parsers import get_parser

    turn = get_parser("hermes").parse(text)     # ParsedTurn: content, reasoning, calls, errors, dropped

Contract: ``parse`` never raises, whatever the text (property-tested). A malformed call is an
entry in ``ParsedTurn.errors`` (a message for the model, ``error_result("parse_error", msg)``,
and a metric), never an exception or a silently dropped call (verl #3070, #4757). Parsers are
stateless: one instance (``get_parser``) serves every trajectory. Call ids are ``call_0``,
``call_1``… in the order of the turn (deterministic, so a resumed trajectory is identical).

Formats, one module each: ``hermes`` (``<tool_call>`` JSON, ``<think>`` reasoning: ``hermes.py``)
and ``gpt-oss`` (harmony: ``harmony.py``); the interface is in ``base.py``, the registry in ``registry.py``, the
JSON and text handling they share in ``decoding.py``. Importing this package registers both.

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

from .base import MAX_CALLS_PER_TURN, MAX_NAME_CHARS, MAX_TAGS_PER_TURN, ParsedTurn, ToolParser
from .decoding import clean_text
from .harmony import HarmonyParser
from .hermes import HermesParser
from .registry import get_parser, register_parser, registered_parsers

__all__ = [
    "MAX_CALLS_PER_TURN",
    "MAX_NAME_CHARS",
    "MAX_TAGS_PER_TURN",
    "HarmonyParser",
    "HermesParser",
    "ParsedTurn",
    "ToolParser",
    "clean_text",
    "get_parser",
    "register_parser",
    "registered_parsers",
]
