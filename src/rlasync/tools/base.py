"""Tools the model calls during a rollout: the interface, the call runner and the registry.

Contract (what an agent loop relies on):

- ``run_tool_call`` never raises except ``asyncio.CancelledError``. An unknown tool, arguments
  that do not fit the schema, a tool that raises, hangs past its timeout or returns a non-string:
  each becomes a ``ToolResult`` with ``ok=False``, an ``error_kind`` for metrics, and a ``text``
  starting with ``"error: "`` that tells the model what went wrong and how to fix it. A tool
  error is something the model learns from, never a crashed trajectory (verl #3070: a KeyError).
- Cancellation propagates, so a loop can be interrupted mid-call (a weight update, a shutdown);
  tools must clean up in ``finally`` (the python tool kills its process there).
- One ``Tool`` instance serves every trajectory of a worker concurrently: tools keep no
  per-trajectory state on ``self``; what a trajectory needs across calls lives in
  ``ToolContext.scratch``, which the loop owns (and saves with its state when it is interrupted).
- Tools are async and must not block the event loop: blocking work goes to a thread
  (``asyncio.to_thread``) or a child process. A blocking tool cannot be timed out.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from ..registry import Registry

logger = logging.getLogger(__name__)

ErrorKind = Literal[
    "unknown_tool", "bad_arguments", "timeout", "tool_error", "exception", "output_limit", "parse_error"
]
"""Why a call failed (a metrics label): ``tool_error`` is a failure the tool reported on purpose
(``ToolError``), ``exception`` is a bug (any other exception), ``parse_error`` a malformed call
that never reached a tool (see ``error_result``)."""

TruncateSide = Literal["left", "right", "middle"]
"""Which part of a too-long text is cut: ``right`` keeps the start, ``left`` keeps the end,
``middle`` keeps both ends (tracebacks and logs put what matters at both ends)."""

TRUNCATION_MARKER = "...(truncated)"


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model asked for, as a parser read it."""

    name: str
    arguments: dict[str, Any]
    """Already decoded from JSON (a parser turns a JSON-string ``arguments`` into a dict)."""
    id: str = ""
    """Deterministic per turn (``call_0``, ``call_1``…) so a resumed trajectory is identical."""


class ToolResult(msgspec.Struct, kw_only=True):
    """What came back from one call: the text the model sees, and labels for metrics."""

    text: str
    """What the model is shown (already capped by ``max_response_chars``)."""
    name: str = ""
    """The tool's name as the model called it ("" for a call too malformed to name one)."""
    call_id: str = ""
    ok: bool = True
    error_kind: ErrorKind | None = None
    error_message: str = ""
    """Detail for logs and metrics (may hold what the model is not shown, e.g. the exception type)."""
    elapsed_s: float = 0.0
    truncated: bool = False
    """The text was cut to ``max_response_chars``."""


@dataclasses.dataclass
class ToolContext:
    """Per-trajectory state handed to every call of that trajectory."""

    trajectory_id: str = ""
    turn: int = 0
    """The assistant turn that made the call (0-based)."""
    scratch: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form state a tool keeps across the calls of one trajectory (the loop owns it)."""
    tool_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The row's settings for this tool: its ``tools_kwargs[<tool name>]`` (verl's layout:
    ``{create_kwargs: {ground_truth: ...}, execute_kwargs: {...}}``), {} when it has none."""


class ToolError(Exception):
    """Raised by a tool to report a failure to the model with this exact message.

    Use it for expected failures (bad input, a limit hit); any other exception counts as a bug
    (``error_kind="exception"``) and the model sees only its type and message.
    """

    def __init__(self, message: str, *, kind: ErrorKind = "tool_error") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


class Tool(abc.ABC):
    """A function the model can call. Subclasses set the class attributes and ``call``."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # shared default: never mutated
    """JSON schema of the arguments (an object schema; ``run_tool_call`` checks the basics)."""
    timeout_s: float | None = 30.0
    """Deadline of one call in ``run_tool_call``; None when the tool enforces its own limits."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function format, what chat templates take as ``tools=[…]``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:  # omitted when empty: a prompt token saved, and the calc task's schema has none
            function["description"] = self.description
        function["parameters"] = self.parameters  # shared, not copied: callers must not mutate it
        return {"type": "function", "function": function}

    @abc.abstractmethod
    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        """Run the call on validated arguments; return the text for the model, or raise ``ToolError``."""


def schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` list for a chat template, in a stable (sorted) order."""
    return [tools[name].schema() for name in sorted(tools)]


# -- argument checks -------------------------------------------------------------------------
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _is_type(value: Any, json_type: str) -> bool:
    if json_type not in _JSON_TYPES:
        return True  # a type we do not know: the tool checks it
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False  # bool is an int in Python, not in JSON
    return isinstance(value, _JSON_TYPES[json_type])


def _type_name(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name):
            return name
    return type(value).__name__


def validate_arguments(schema: Mapping[str, Any], arguments: Any) -> list[str]:
    """The problems of ``arguments`` against an object schema's basics (empty when fine).

    Checks: an object; ``required`` keys present; each known property's ``type`` (or list of
    types) and ``enum``; no unknown keys when ``additionalProperties`` is false. Nested schemas
    are left to the tool: this is a guard against the common mistakes, not a JSON-schema engine.
    """
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {_type_name(arguments)}"]
    properties: Mapping[str, Any] = schema.get("properties") or {}
    problems = [
        f"missing required argument '{key}'" for key in schema.get("required", ()) if key not in arguments
    ]
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if schema.get("additionalProperties") is False:
                problems.append(f"unexpected argument '{key}'")
            continue
        types = spec.get("type")
        if types is not None:
            types = [types] if isinstance(types, str) else list(types)
            if not any(_is_type(value, t) for t in types):
                problems.append(f"argument '{key}' must be {' or '.join(types)}, got {_type_name(value)}")
                continue
        if "enum" in spec and value not in spec["enum"]:
            problems.append(f"argument '{key}' must be one of {spec['enum']}")
    return problems


def usage(tool: Tool) -> str:
    """A one-line signature for error messages: ``python(code: string)``."""
    properties: Mapping[str, Any] = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required", ()))
    parts = []
    for key, spec in properties.items():
        types = spec.get("type", "any") if isinstance(spec, Mapping) else "any"
        types = types if isinstance(types, str) else "|".join(types)
        parts.append(f"{key}{'' if key in required else '?'}: {types}")
    return f"{tool.name}({', '.join(parts)})"


# -- running a call --------------------------------------------------------------------------
def truncate_text(text: str, max_chars: int | None, side: TruncateSide = "middle") -> tuple[str, bool]:
    """``text`` cut to at most ``max_chars`` characters, marker included; and whether it was cut."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    keep = max(max_chars - len(TRUNCATION_MARKER), 0)
    if side == "right":
        cut = text[:keep] + TRUNCATION_MARKER
    elif side == "left":
        cut = TRUNCATION_MARKER + text[len(text) - keep :]
    else:
        head = keep // 2
        cut = text[:head] + TRUNCATION_MARKER + text[len(text) - (keep - head) :]
    return cut[:max_chars] if keep == 0 else cut, True


def error_result(
    kind: ErrorKind,
    message: str,
    *,
    name: str = "",
    call_id: str = "",
    detail: str = "",
    elapsed_s: float = 0.0,
) -> ToolResult:
    """A failed call: the model sees ``error: {message}``; ``detail`` (or the message) goes to metrics.

    Loops use it for a parser's errors too: ``error_result("parse_error", msg)``.
    """
    return ToolResult(
        text=f"error: {message}",
        name=name,
        call_id=call_id,
        ok=False,
        error_kind=kind,
        error_message=detail or message,
        elapsed_s=elapsed_s,
    )


async def run_tool_call(
    tools: Mapping[str, Tool],
    call: ToolCall,
    context: ToolContext,
    *,
    max_response_chars: int | None = None,
    truncate_side: TruncateSide = "middle",
) -> ToolResult:
    """Run one call; every failure is an error result, only cancellation propagates."""
    start = time.perf_counter()
    name = call.name if isinstance(call.name, str) else repr(call.name)
    try:
        result = await _run(tools, call, name, context)
    except asyncio.CancelledError:
        raise  # the loop is being interrupted: the tool already cleaned up in its finally blocks
    except Exception as e:  # a bug in the checks above a tool (e.g. an unhashable name): still a result
        logger.debug("tool call %s failed before reaching the tool", name, exc_info=True)
        result = error_result("exception", f"{name} failed: {type(e).__name__}", name=name, detail=repr(e))
    result.text, result.truncated = truncate_text(result.text, max_response_chars, truncate_side)
    result.call_id, result.elapsed_s = (
        call.id if isinstance(call.id, str) else "",
        time.perf_counter() - start,
    )
    return result


async def _run(tools: Mapping[str, Tool], call: ToolCall, name: str, context: ToolContext) -> ToolResult:
    tool = tools.get(name)
    if tool is None:
        available = ", ".join(sorted(tools)) or "none"
        return error_result("unknown_tool", f"unknown tool '{name}'; available: {available}", name=name)
    problems = validate_arguments(tool.parameters, call.arguments)
    if problems:
        return error_result("bad_arguments", f"{'; '.join(problems)}. Usage: {usage(tool)}", name=name)
    timeout = asyncio.timeout(tool.timeout_s)
    try:
        async with timeout:
            text = await tool.call(call.arguments, context)
    except TimeoutError as e:
        if not timeout.expired():  # the tool's own TimeoutError (e.g. from a socket): its failure
            return error_result(
                "exception", f"{name} failed: TimeoutError: {e}"[:500], name=name, detail=repr(e)
            )
        return error_result("timeout", f"{name} timed out after {tool.timeout_s:g}s", name=name)
    except ToolError as e:
        return error_result(e.kind, str(e), name=name)
    except (Exception, SystemExit) as e:  # SystemExit too: a tool calling sys.exit must not stop the node
        logger.debug("tool %s raised", name, exc_info=True)
        return error_result(
            "exception", f"{name} failed: {type(e).__name__}: {e}"[:500], name=name, detail=repr(e)
        )
    if not isinstance(text, str):
        return error_result(
            "exception", f"{name} failed: it returned {type(text).__name__}, not text", name=name
        )
    return ToolResult(text=text, name=name)


# -- registry --------------------------------------------------------------------------------
# The same class defined again (a module re-imported) replaces itself; another class may not.
_TOOLS = Registry[type[Tool]](
    "tool",
    unknown="unknown tool '{name}'; registered: {known} "
    "(import the module that defines it with @register_tool before building tools)",
    taken="tool name '{name}' is taken by {old.__module__}.{old.__qualname__}",
)


def register_tool(cls: type[Tool]) -> type[Tool]:
    """Class decorator: make a tool buildable by its ``name`` (from configs: ``build_tools``)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{cls.__qualname__} needs a class attribute `name` (a non-empty str) to be registered"
        )
    return _TOOLS.register(name, cls)


def get_tool(name: str) -> type[Tool]:
    """The registered tool class of this name."""
    return _TOOLS.get(name)


def registered_tools() -> list[str]:
    return _TOOLS.names()


def build_tools(specs: Iterable[str] | Mapping[str, Mapping[str, Any] | None]) -> dict[str, Tool]:
    """Instances keyed by name: ``["calculator", "python"]`` or ``{"python": {"wall_time_s": 5}}``."""
    items = specs.items() if isinstance(specs, Mapping) else ((name, None) for name in specs)
    tools: dict[str, Tool] = {}
    for name, kwargs in items:
        tool = get_tool(name)(**(kwargs or {}))
        if tool.name in tools:
            raise ValueError(f"tool '{tool.name}' listed twice")
        tools[tool.name] = tool
    return tools
