"""Structured outputs: the grammar a chat request's ``response_format`` or ``tool_choice`` asks
for, which the engine then samples within (``SamplingParams.grammar``,
``rlasync.engines.grammar``). The tokens stay the model's own, drawn from its distribution over
the tokens the grammar allows, so training on them is exact.

- ``response_format: {type: json_object}``: any JSON object;
- ``response_format: {type: json_schema, json_schema: {schema: {...}}}``: an instance of the
  schema;
- ``tool_choice: required`` (a call to one of ``tools``) or ``{type: function, function: {name}}``
  (a call to that one): one call in the tool parser's format (``hermes``:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), its arguments an instance of
  the tool's ``parameters``.

Grammars are Lark in llguidance's dialect: ``%json`` embeds a JSON schema, and a tag that is one
token of the model's vocabulary (``<tool_call>`` in Qwen's and our tiny models') is written as
that token (``<[id]>``), the way the model writes it.
"""

from __future__ import annotations

import json
from typing import Any

from .schema import APIError, ChatRequest


def grammar_of(req: ChatRequest, tokenizer: Any, tool_format: str) -> str:
    """The grammar ``req`` asks for ("" for none); a 400 naming the parameter that cannot be met."""
    choice = req.tool_choice
    if req.tools and (choice == "required" or isinstance(choice, dict)):
        return _tool_call(req, tokenizer, tool_format)
    response_format = req.response_format or {}
    kind = response_format.get("type")
    if kind == "json_object":  # any object: left open
        return _json({"type": "object", "additionalProperties": True}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format json_schema needs {json_schema: {name, schema: {...}}}",
                param="response_format",
            )
        return _json(schema, "response_format")
    return ""


def _json(schema: dict[str, Any], param: str) -> str:
    return _checked("start: %json " + json.dumps(_compact(schema)), param)


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as the grammar follows it: JSON written as ``json.dumps`` and chat templates'
    ``tojson`` write it (``, `` and ``: ``, no other whitespace: the separators models are
    trained on; llguidance's own default is ``,``/``:``), and objects closed unless they say otherwise (``additionalProperties: false``,
    as xgrammar's strict mode and OpenAI's structured outputs take them). A model, an untrained
    one above all, could otherwise fill its token budget with spaces between two tokens of a
    valid document, or with properties nobody asked for (LangChain's and pydantic's schemas
    leave ``additionalProperties`` out)."""
    closed = _closed(schema)
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**closed, "x-guidance": {**layout, **schema.get("x-guidance", {})}}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "additionalProperties", "contains")


def _closed(schema: Any) -> Any:
    """``schema`` with every object schema that does not say otherwise closed, and every
    integer without bounds kept within JSON's safe integers (+-2^53-1, what every JSON parser holds
    exactly): an untrained model otherwise writes digits to its token limit, and never closes the call."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") == "integer":  # an unbounded one: JSON's safe integers, not digits to the token limit
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_SAFE_INTEGER
    return out


_SAFE_INTEGER = 2**53 - 1
"""The largest integer every JSON parser holds exactly (JavaScript's ``Number.MAX_SAFE_INTEGER``;
llguidance cannot compile the full 64-bit range)."""


def _tool_call(req: ChatRequest, tokenizer: Any, tool_format: str) -> str:
    if tool_format != "hermes":
        raise APIError(
            400,
            f"tool_choice required or a named function is met for the hermes tool format only (this endpoint's is {tool_format})",
            param="tool_choice",
        )
    tools = {t["function"]["name"]: t["function"] for t in req.tools or []}
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in tools:
            raise APIError(
                400,
                f"tool_choice names {name!r}, which is not one of tools ({', '.join(tools)})",
                param="tool_choice",
            )
        tools = {name: tools[name]}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, function in tools.items()
    ]
    call = _compact(calls[0] if len(calls) == 1 else {"anyOf": calls})
    grammar = f"start: {_tag(tokenizer, '<tool_call>')} call {_tag(tokenizer, '</tool_call>')}\ncall: %json {json.dumps(call)}"
    return _checked(grammar, "tool_choice")


def _tag(tokenizer: Any, text: str) -> str:
    """``text`` as the grammar must match it: the token itself when the vocabulary has it as one."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (
        f"<[{ids[0]}]>"
        if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == text
        else json.dumps(text)
    )


def _checked(grammar: str, param: str) -> str:
    """``grammar``, once llguidance has read it (a 400 naming ``param`` when it cannot)."""
    try:
        import llguidance
    except ImportError:
        raise APIError(
            400, f"{param} needs constrained decoding: pip install llguidance", param=param
        ) from None
    # (Without a tokenizer it cannot check <[id]> tokens, and says so as a warning, not an error.)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise APIError(
            400, f"{param}: the schema cannot be turned into a grammar: {'; '.join(messages)}", param=param
        )
    return grammar
