"""Tools for agent loops: the ``Tool`` interface and its runner, built-in tools, call parsers.

    from rlasync.tools import ToolContext, build_tools, error_result, get_parser, run_tool_call

    tools = build_tools(["calculator", "python"])            # or {"python": {"wall_time_s": 5}}
    parser = get_parser("hermes")                             # or "gpt-oss"
    turn = parser.parse(assistant_text)                       # content, reasoning, calls, errors
    context = ToolContext("traj-0")                           # per trajectory; the loop keeps it
    results = await asyncio.gather(*(run_tool_call(tools, call, context, max_response_chars=256) for call in turn.calls))
    results += [error_result("parse_error", e) for e in turn.errors]   # the model sees these too
    messages = parser.format_responses(results)               # role "tool", for a chat template
    pieces = parser.response_pieces(results)                  # or the format's own text (harmony): encode
                                                              # with ChatTurns.encode_pieces (tool text stays plain)

Importing this package registers the built-in tools and parsers.
"""

from __future__ import annotations

from .base import (
    ErrorKind,
    Tool,
    ToolCall,
    ToolContext,
    ToolError,
    ToolResult,
    TruncateSide,
    build_tools,
    error_result,
    get_tool,
    register_tool,
    registered_tools,
    run_tool_call,
    schemas,
    truncate_text,
    validate_arguments,
)
from .calculator import CALCULATOR, CalculatorTool, calculator
from .parsers import (
    HarmonyParser,
    HermesParser,
    ParsedTurn,
    ToolParser,
    get_parser,
    register_parser,
    registered_parsers,
)
from .python import PythonTool
from .sandbox import PythonRun, SandboxUnavailable, run_python, sandbox_layers
from .tool_config import ToolConfigError, build_agent_tools, load_tool_config

__all__ = [
    "CALCULATOR",
    "CalculatorTool",
    "ErrorKind",
    "HarmonyParser",
    "HermesParser",
    "ParsedTurn",
    "PythonRun",
    "PythonTool",
    "SandboxUnavailable",
    "Tool",
    "ToolConfigError",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolParser",
    "ToolResult",
    "TruncateSide",
    "build_agent_tools",
    "build_tools",
    "calculator",
    "error_result",
    "get_parser",
    "get_tool",
    "load_tool_config",
    "register_parser",
    "register_tool",
    "registered_parsers",
    "registered_tools",
    "run_python",
    "run_tool_call",
    "sandbox_layers",
    "schemas",
    "truncate_text",
    "validate_arguments",
]
