"""The ``calculator`` tool: integer arithmetic by an AST walk (no ``eval``), what the ``calc``
synthetic task teaches a tiny model to call.

    calculator("37*58")                        # "2146"; "error: ZeroDivisionError" for "1//0"
    CalculatorTool().schema() == CALCULATOR    # the calc task's prompts offer exactly this schema
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from .base import Tool, ToolContext, ToolError, register_tool

MAX_EXPRESSION_CHARS = 64

CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",  # no description: every prompt token costs a tiny model's step time
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The tool's schema in the OpenAI function format, as chat templates take it."""

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculator(expression: str) -> str:
    """Integers, + - * // % and parentheses; an ``error: …`` text otherwise."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError("unsupported expression")

    if len(expression) > MAX_EXPRESSION_CHARS:
        return "error: expression too long"
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e.__class__.__name__}"


@register_tool
class CalculatorTool(Tool):
    """``calculator`` as a tool the agent loops call."""

    name = "calculator"
    description = ""  # the calc task's schema has none (prompt tokens cost a tiny model): keep them identical
    parameters = CALCULATOR["function"]["parameters"]
    timeout_s = 1.0

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        result = calculator(arguments["expression"])  # at most 64 characters: microseconds, fine on the loop
        if result.startswith("error: "):
            raise ToolError(
                result.removeprefix("error: ")
            )  # the model reads the same text, counted as an error
        return result
