"""An MCP server over stdio (the ``mcp`` package's low-level ``Server``) offering the calc
task's ``calculator`` with exactly the schema the warm-started model was taught (``CALCULATOR``).
Each call is appended to the file ``MCP_CALLS_LOG`` names (when set), so a test sees that calls
reached this server; the expression ``sleep`` sleeps 5 s (a call past its deadline)."""

from __future__ import annotations

import os

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from rlasync.tools import CALCULATOR, calculator


async def list_tools(ctx: object, params: object) -> types.ListToolsResult:
    function = CALCULATOR["function"]
    return types.ListToolsResult(
        tools=[types.Tool(name=function["name"], input_schema=function["parameters"])]
    )


async def call_tool(ctx: object, params: types.CallToolRequestParams) -> types.CallToolResult:
    expression = str((params.arguments or {}).get("expression", ""))
    if log := os.environ.get("MCP_CALLS_LOG"):
        with open(log, "a") as f:
            f.write(expression + "\n")
    if expression == "sleep":
        await anyio.sleep(5)
    result = calculator(expression)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=result.removeprefix("error: "))],
        is_error=result.startswith("error: "),
    )


async def main() -> None:
    server = Server("calculator", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
