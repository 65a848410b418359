"""Tools of MCP servers (Model Context Protocol) over stdio, through the ``mcp`` package.

    agent:
      mcp_servers:
        math: {command: python, args: [servers/math.py], timeout_s: 10}

Each agent-loop worker starts every server in ``agent.mcp_servers`` as a child process (MCP's
stdio transport), asks it for its tools, and offers them to the model beside ``agent.tools``:
a call is the server's ``tools/call``; its text content is what the model reads, and a result
the server marks as an error, or a call past ``timeout_s``, is a tool error the model reads too.
The servers stop with their worker. ``pip install 'rlasync[mcp]'`` (``make test`` installs it).

    async with MCPServers({"math": MCPServerConfig(command="python", args=["math.py"])}) as servers:
        tools = servers.tools                       # name -> Tool, ready for a loop
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
from typing import Any

from ..config.agent import MCPServerConfig
from .base import Tool, ToolContext, ToolError

log = logging.getLogger(__name__)


class MCPUnavailable(RuntimeError):
    """An MCP server did not start, or did not list its tools, in time; or ``mcp`` is missing."""


class MCPTool(Tool):
    """One tool of an MCP server: its name, description and input schema, as the server lists them."""

    def __init__(self, session: Any, listed: Any, server: str, timeout_s: float) -> None:
        self.name = str(listed.name)
        self.description = str(listed.description or "")
        schema = dict(listed.input_schema or {"type": "object", "properties": {}})
        # ``type`` first, as schemas are written: MCP's models send it last, and the chat template
        # renders the keys in order, so the prompt would differ from the same tool's built in.
        self.parameters = {"type": schema.pop("type", "object"), **schema}
        self.timeout_s = timeout_s
        self.server = server
        self._session = session

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        try:
            result = await self._session.call_tool(self.name, arguments)
        except Exception as exc:  # the server died, or answered with a protocol error
            raise ToolError(f"MCP server {self.server!r}: {type(exc).__name__}: {exc}") from None
        text = "\n".join(
            str(block.text) for block in result.content if getattr(block, "text", None) is not None
        )
        if result.is_error:
            raise ToolError(text or "the tool failed")
        return text


class MCPServers:
    """The servers of ``agent.mcp_servers``, started, and their tools (``tools``), until closed.

    Each server's session lives in a task of its own (the ``mcp`` client's streams and process
    belong to the task that opened them); closing ends the tasks, which stop the servers."""

    def __init__(self, servers: dict[str, MCPServerConfig]) -> None:
        self.servers = servers
        self.tools: dict[str, MCPTool] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started: list[asyncio.Future[list[MCPTool]]] = []  # one per task: set once it listed its tools
        self._stop = asyncio.Event()

    async def __aenter__(self) -> MCPServers:
        try:
            for name, config in self.servers.items():
                ready: asyncio.Future[list[MCPTool]] = asyncio.get_running_loop().create_future()
                self._tasks.append(asyncio.create_task(self._serve(name, config, ready), name=f"mcp-{name}"))
                self._started.append(ready)
                try:
                    tools = await asyncio.wait_for(asyncio.shield(ready), config.start_timeout_s)
                except TimeoutError:
                    raise MCPUnavailable(
                        f"MCP server {name!r} ({shlex.join([config.command, *config.args])}) did not list its tools within "
                        f"{config.start_timeout_s:g} s (agent.mcp_servers.{name}.start_timeout_s)"
                    ) from None
                for tool in tools:
                    if tool.name in self.tools:
                        raise MCPUnavailable(
                            f"MCP server {name!r} offers a tool named {tool.name!r}, which another tool has"
                        )
                    self.tools[tool.name] = tool
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, name: str, config: MCPServerConfig, ready: asyncio.Future[list[MCPTool]]) -> None:
        try:
            from mcp import ClientSession, StdioServerParameters
            from mcp.client.stdio import stdio_client
        except ImportError:
            ready.set_exception(
                MCPUnavailable("agent.mcp_servers needs the mcp package: pip install 'rlasync[mcp]'")
            )
            return
        params = StdioServerParameters(
            command=config.command, args=config.args, env=config.env or None, cwd=config.cwd
        )
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                ready.set_result([MCPTool(session, tool, name, config.timeout_s) for tool in listed.tools])
                await self._stop.wait()
        except Exception as exc:  # mcp raises its own errors, OSError for a missing command, grouped ones
            if ready.done():  # it had started: its tools answer every call with an error from now on
                log.warning("MCP server %r stopped: %s; calls of its tools now fail", name, _reason(exc))
            else:
                ready.set_exception(
                    MCPUnavailable(
                        f"MCP server {name!r} ({shlex.join([config.command, *config.args])}) did not start: {_reason(exc)}"
                    )
                )

    async def close(self) -> None:
        """Stop every server (each gets its stdin closed, then is killed if it lingers)."""
        self._stop.set()
        for task, ready in zip(self._tasks, self._started, strict=True):
            if not ready.done():  # still starting (it waits on the server, not on _stop): cut it off now
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 10.0)
        self._tasks, self._started = [], []


def _reason(exc: BaseException) -> str:
    """The innermost exception of a (possibly grouped) failure, as one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
