"""What every parser does with the model's text: decode a call's JSON, check its arguments, say
what was wrong (for the model), and keep decoded strings valid text.

Decoded strings are valid UTF-8 text: a ``"\\ud800"`` escape becomes U+FFFD (a lone surrogate
cannot be tokenised or sent). A name shown in an error is cut to ``MAX_NAME_CHARS``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import MAX_NAME_CHARS

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


def clean_decoded(value: Any, raw: str, end: int | None = None) -> Any:
    """``value``, decoded from ``raw[:end]``, with lone surrogates replaced if that text escapes one."""
    return _clean(value) if _SURROGATE_ESCAPE.search(raw, 0, len(raw) if end is None else end) else value


def decode_json(raw: str) -> Any:
    """``json.loads`` of a call's own text (its errors count lines in it alone), surrogates cleaned."""
    return clean_decoded(json.loads(raw), raw)


def shown(name: str) -> str:
    """A model-chosen name as quoted in an error: cut to ``MAX_NAME_CHARS``."""
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."


def json_error(e: Exception, offset: int = 0) -> str:
    """Why JSON did not decode; positions counted from ``offset`` (where the call's JSON starts)."""
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON ({e.msg} at character {e.pos - offset})"
    if isinstance(e, RecursionError):
        return "invalid JSON (nested too deeply)"
    return f"invalid JSON ({e})"  # e.g. an integer past Python's digit limit


def arguments_object(raw: Any) -> tuple[dict[str, Any] | None, str]:
    """Arguments as a dict, or None and why; a JSON string of an object is decoded (some models double-encode)."""
    if isinstance(raw, str):
        try:
            raw = decode_json(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as e:
            return None, f'"arguments" is a string but not JSON: {json_error(e)}'
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(raw), "a number"
        )
        return None, f'"arguments" must be a JSON object, got {kind}'
    return raw, ""


def join_stripped(pieces: list[str]) -> str:
    """The non-blank pieces, stripped, one per line (``ParsedTurn.content`` and ``reasoning``)."""
    return "\n".join(filter(None, map(str.strip, pieces)))  # in C: a turn may hold 100k pieces


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # what transformers' `tojson` writes in chat templates
