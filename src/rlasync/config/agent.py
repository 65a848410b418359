"""Settings of the agent loops (``agent.*``): which loop, turn and token budgets, tools."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .endpoint import EndpointConfig

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class MCPServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One MCP server started over stdio (``agent.mcp_servers.<name>``; ``rlasync.tools.mcp``)."""

    command: str
    """The program, e.g. ``python``, ``npx``, ``uvx``."""
    args: list[str] = []
    """Its arguments, e.g. ``["-m", "my_mcp_server"]``."""
    env: dict[str, str] = {}
    """Added to the few variables MCP passes on (``PATH``, ``HOME``...)."""
    cwd: str | None = None
    """The folder it starts in; None: the node's own."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Deadline of one tool call (the model then reads a timeout error)."""
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """Deadline for the server to start and list its tools."""


class AgentConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How trajectories are rolled out (``agent.*``; verl's ``rollout.multi_turn.*`` names)."""

    default_loop: str = "single_turn"
    """The loop of a dataset row without an ``agent_name`` field (``single_turn``, ``tool``, or
    one registered with ``rlasync.agents.register``)."""

    response_length: PositiveInt = 1024
    """Token budget of everything after the prompt: model turns and tool/user turns together.
    A turn that would pass it is cut, and the trajectory ends ("response_length")."""

    max_assistant_turns: NonNegativeInt = 0
    """Model turns per trajectory; 0: no limit but the token budget."""

    max_user_turns: NonNegativeInt = 0
    """Tool-response and simulated-user turns per trajectory; 0: no limit."""

    max_parallel_calls: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    """Tool calls of one model turn that run (concurrently); later ones are counted and answered
    with one message. As many malformed calls get their error message; the rest are counted in
    that one message too. At most 16: a parser reads at most 16 calls of a turn."""

    max_tool_response_length: PositiveInt = 256
    """Characters of one tool response (or error message) shown to the model; longer ones are cut."""

    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of a long tool response is cut (``middle`` keeps its start and its end)."""

    tool_parser: str = "hermes"
    """How tool calls are read from model text: ``hermes`` (``<tool_call>{json}</tool_call>``)
    or ``gpt-oss`` (the harmony format)."""

    tools: list[str] | dict[str, dict[str, Any]] = []
    """Built-in or registered tools offered to the model: by name (``[calculator, python]``), or
    name -> its settings (``{python: {wall_time_s: 5, isolation: weaker}}``; see each tool's
    class, e.g. ``rlasync.tools.PythonTool``)."""

    tool_config: str = ""
    """A tool file in verl's shape (``multi_turn.tool_config_path``): ``tools: [{class_name,
    config, tool_schema}]``; its tools are offered beside ``tools`` (``rlasync.tools.tool_config``).
    Relative to the working directory; every host of a launched run reads it at that path."""

    mcp_servers: dict[str, MCPServerConfig] = {}
    """MCP servers (Model Context Protocol, stdio) whose tools are offered beside ``tools``: name
    -> ``{command: python, args: [server.py], env: {...}, timeout_s: 30}``. Each agent-loop
    worker starts its own and stops them with it (``rlasync.tools.mcp``; needs ``rlasync[mcp]``)."""

    rollout_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    """Deadline of one call from the head to an agent-loop worker: every trajectory of the rows
    it was given, all their turns and tool calls. A worker that has not answered by then fails
    the step with ``CallTimeout`` (a lost worker's rows run again on another at once)."""

    interaction: str | dict[str, Any] = ""
    """A simulated user, by name, or name and options: ``retry`` (a wrong answer is told so and
    tried again; options ``max_attempts``, ``feedback``, ``pass_reward``), or one registered with
    ``rlasync.agents.register_interaction`` (``{name: retry, max_attempts: 2}``). It answers
    each model turn that calls no tool (``max_user_turns`` caps its turns); needs a loop that
    talks with one (``default_loop: tool``). "": none, the model's answer ends the trajectory."""

    openai_agent: str = ""
    """The ``openai`` loop's agent: the import path (``my_package.agents:solve``) of
    ``async def agent(client, row) -> float | None``, which talks to the policy through
    ``client`` (an ``openai.AsyncOpenAI`` pointed at this worker's endpoint) and returns the
    reward (None: the run's reward scores the conversation; ``rlasync.serving``)."""

    endpoint: EndpointConfig = msgspec.field(default_factory=EndpointConfig)
    """The OpenAI-compatible endpoint each worker running ``openai`` loops starts (on loopback)."""

    stream: bool = False
    """Stream each model turn into its loop token by token. On: a turn cut by a lost engine or a
    cancelled loop keeps the tokens it had and resumes where it stopped, at one controller
    wake-up per token per trajectory. Off (verl's way): a turn arrives whole; one lost with its
    engine is generated again from its start on another (the same tokens when seeded). A turn
    cut by a weight sync (``pause("abort")``) keeps its tokens either way."""

    def __post_init__(self) -> None:
        if self.interaction and self.default_loop == "single_turn":
            raise ValueError(
                "agent.interaction needs a loop that talks with a simulated user: set agent.default_loop: tool "
                "(single_turn ends at the model's first answer)"
            )
        if self.default_loop == "openai" and not self.openai_agent:
            raise ValueError(
                "agent.default_loop: openai runs an agent function: set agent.openai_agent to its import path "
                "(my_package.agents:solve, an `async def agent(client, row) -> float | None`)"
            )
