"""Every check before anything starts: what would make a run fail is found here, before a
process starts or a model loads. The plugins are loaded first (the names checked may be
theirs); then the placement, the data files (read now: their rows, loops and tools are
checked), the settings that must agree with each other, ``data.generator``, ``agent.tools`` and
``train.trackers``. A synthetic task's rows are all alike, so one stands for them; its
20 000 are drawn later, in a thread (``Feed.read``). ``agent.mcp_servers`` are checked by
``check_servers``, once the event loop runs: each starts and lists its tools.

Each mistake is a ``ConfigError`` naming its setting."""

from __future__ import annotations

import importlib.util
from typing import Any

import msgspec

from .. import plugins
from ..agents import get_loop
from ..agents.interactions import conversation_score, interaction_factory
from ..config import Config, ConfigError
from ..data import DataGenerator, Row, make_generator, synthetic_rows
from ..data.synthetic import synthetic_capacity
from ..metrics.trackers import tracker_names
from ..rewards.reward_model import served_options
from ..serving import OpenAIAgentLoop, load_agent
from ..tools import SandboxUnavailable, build_agent_tools
from .feed import read_rows, tool_loop
from .placement import Placement


class Checked(msgspec.Struct, kw_only=True):
    """What the checks made, kept for the run: nothing is read or built twice."""

    placement: Placement
    files: tuple[list[Row], list[Row]] | None  # the rows of data.train_files/val_files, read at once
    generator: DataGenerator | None  # data.generator, built
    sample_rows: list[Row]  # the rows start-up checks stand for (a synthetic task's: one)
    tools: dict[str, Any]  # agent.tools, built (checked against the rows)


def preflight(config: Config) -> Checked:
    """Check ``config`` and its rows, as the module says; what that made."""
    cfg = config.train
    plugins.load_all(config.plugins)  # first: the names below may be theirs
    placement = Placement.of(config)  # every placement mistake before anything starts
    check_sources(config)
    served = served_options(config.data.reward) if config.data.train_files else None  # the files' reward
    node = served["node"] if served else None
    if isinstance(node, int) and not 0 <= node < placement.nodes:
        raise ConfigError(
            f"data.reward.reward_model.node={node}: the run has {placement.nodes} node(s), 0 to {placement.nodes - 1} "
            "(a node of its own: raise cluster.nodes)"
        )
    if config.trainer.lora.rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("trainer.lora needs the peft package: pip install 'rlasync[lora]'")
    files = read_rows(config) if config.data.train_files or config.data.source else None
    if files is None and cfg.val_size > synthetic_capacity(cfg.task, "val"):
        raise ConfigError(
            f"train.val_size={cfg.val_size}: the {cfg.task} task has {synthetic_capacity(cfg.task, 'val')} distinct held-out problems; ask for at most that"
        )
    interaction_factory(config.agent.interaction, conversation_score(None))  # its name and options
    # data.generator: built here, so a bad name or option fails before anything starts
    generator = make_generator(config.data.generator, seed=cfg.seed)
    if cfg.overlong_buffer > config.agent.response_length:
        raise ConfigError(
            f"train.overlong_buffer={cfg.overlong_buffer} is longer than agent.response_length={config.agent.response_length}: "
            "the penalty starts that many tokens before the length limit"
        )
    sample_rows = (  # a synthetic task's rows are all alike: one stands for them
        [*files[0], *files[1]]
        if files
        else synthetic_rows(cfg.task, 1, seed=cfg.seed, split="val", tool_loop=tool_loop(config))
    )
    tools = build_run_tools(config, sample_rows)
    unknown = sorted(set(cfg.trackers) - {"jsonl", *tracker_names()})
    if unknown:
        raise ConfigError(
            f"train.trackers: unknown {unknown}; known: {', '.join(['jsonl', *tracker_names()])}"
        )
    return Checked(
        placement=placement, files=files, generator=generator, sample_rows=sample_rows, tools=tools
    )


def check_sources(config: Config) -> None:
    """Where the rows come from (files, ``data.source``, the synthetic task) and what scores
    them (``data.reward``, ``custom_reward_function``, the environment) agree."""
    data, custom = config.data, config.custom_reward_function
    if data.val_files and not data.train_files:  # else ignored for the task's split
        raise ConfigError(
            "data.val_files is set but data.train_files is not: without training files the rows, "
            f"held-out ones too, come from the synthetic train.task ({config.train.task}) or data.source; "
            "give data.train_files as well"
        )
    if data.source and data.train_files:
        raise ConfigError("data.source and data.train_files both give the rows: keep one")
    if custom.path and not data.train_files:
        raise ConfigError(
            "custom_reward_function scores the rows of data.train_files (a synthetic task or data.source "
            "scores its own): give data.train_files"
        )
    # data.reward and custom_reward_function are checked as the files' environment is built (read_rows).


def build_run_tools(config: Config, rows: list[Row]) -> dict[str, Any]:
    """``agent.tools``, built; fails at start-up, not mid-run, on a loop or tool the rows need
    and the config lacks (tools the rows name may be an MCP server's: then ``check_servers``
    checks them, once the servers have listed theirs)."""
    try:
        tools = build_agent_tools(config.agent.tools, config.agent.tool_config)
    except ConfigError:  # already names its setting (agent.tool_config); a ValueError, not re-worded below
        raise
    except SandboxUnavailable as exc:
        raise ConfigError(f"agent.tools: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:  # an unknown tool, or settings it does not take
        raise ConfigError(f"agent.tools: {exc.args[0] if isinstance(exc, KeyError) else exc}") from None
    offering = []  # rows whose loop offers agent.tools (an openai agent brings its own)
    for row in rows:
        try:
            loop = get_loop(str(row.get("agent_name") or config.agent.default_loop))
        except KeyError as exc:
            raise ConfigError(f"agent.default_loop or a row's agent_name: {exc.args[0]}") from None
        if issubclass(loop, OpenAIAgentLoop):  # an agent (or an environment) of its own brings its tools
            if loop.uses_openai_agent:
                load_agent(config.agent.openai_agent)
        else:
            offering.append(row)
    if not config.agent.mcp_servers:
        check_rows_tools(offering, set(tools))
    return tools


def check_rows_tools(rows: list[Row], provided: set[str]) -> None:
    """A ``ConfigError`` if a row offers the model a tool nothing provides."""
    for row in rows:
        missing = {str(t.get("function", t).get("name")) for t in row.get("tools") or []} - provided
        if missing:
            raise ConfigError(
                f"rows offer the tool(s) {sorted(missing)} that neither agent.tools nor agent.mcp_servers provide: "
                "add them to agent.tools"
            )


async def check_servers(config: Config, checked: Checked) -> None:
    """``agent.mcp_servers`` (if any) start here once and list their tools, none named like one
    of ``agent.tools`` (``checked.tools``), and together they provide every tool the rows
    offer; a ``ConfigError`` naming the server or the tool otherwise."""
    if not config.agent.mcp_servers:
        return
    from ..tools.mcp import MCPServers, MCPUnavailable

    tools = checked.tools
    try:
        async with MCPServers(config.agent.mcp_servers) as servers:
            offered = {name: tool.server for name, tool in servers.tools.items()}
    except MCPUnavailable as exc:
        raise ConfigError(f"agent.mcp_servers: {exc}") from None
    for name in sorted(set(offered) & set(tools)):
        raise ConfigError(
            f"agent.mcp_servers: server {offered[name]!r} offers a tool named {name!r}, as agent.tools does: drop one"
        )
    check_rows_tools(checked.sample_rows, set(tools) | set(offered))
