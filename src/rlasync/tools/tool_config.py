"""Tools from a file in verl's tool-config shape (``agent.tool_config``), offered beside
``agent.tools``: a verl user's ``multi_turn.tool_config_path`` file works as it is.

    tools:
      - class_name: rlasync.tools.PythonTool      # module.Class, module:Class, or a registered tool's name
        config: {type: native, wall_time_s: 5}    # the class's keyword options (verl's ``type`` is dropped)
        tool_schema:                              # optional: what the model is shown, and the tool's name
          type: function
          function:
            name: run_python
            description: Run a Python program and read its output.
            parameters: {type: object, properties: {code: {type: string}}, required: [code]}

A ``tool_schema`` replaces the class's ``name``, ``description`` and ``parameters`` on that
instance (the arguments are checked against the schema the model was shown). A class that
does not take an option, a schema that is not a function, two tools of one name: a
``ToolConfigError`` naming the file and the entry.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import yaml

from ..config.loader import ConfigError, import_object
from .base import Tool, build_tools, get_tool, registered_tools

VERL_ONLY_OPTIONS = ("type",)
"""``config`` keys verl reads itself (``type: native | mcp``) and a tool class does not take."""


class ToolConfigError(ConfigError):
    """``agent.tool_config`` cannot be read, or one of its entries cannot be built."""


class ToolSchema(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    class Function(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
        name: str
        description: str = ""
        parameters: dict[str, Any] = msgspec.field(
            default_factory=lambda: {"type": "object", "properties": {}}
        )
        strict: bool | None = None  # OpenAI's flag; accepted, not enforced

    function: Function
    type: str = "function"


class ToolEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    class_name: str
    config: dict[str, Any] = {}
    tool_schema: ToolSchema | None = None


class ToolConfigFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tools: list[ToolEntry] = []


def load_tool_config(path: str | os.PathLike[str]) -> dict[str, Tool]:
    """The tools a verl tool-config file lists, built, keyed by the name the model calls."""
    where = f"agent.tool_config ({os.fspath(path)})"
    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f) or {}
        spec = msgspec.convert(raw, ToolConfigFile)
    except OSError as exc:
        raise ToolConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{where}: not YAML: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ToolConfigError(
            f"{where}: {exc} (expected tools: [{{class_name, config, tool_schema}}, ...])"
        ) from None
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(spec.tools):
        tool = _build(entry, f"{where}: tools[{i}] ({entry.class_name})")
        if tool.name in tools:
            raise ToolConfigError(f"{where}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def build_agent_tools(
    tools: Iterable[str] | Mapping[str, Mapping[str, Any] | None], tool_config: str = ""
) -> dict[str, Tool]:
    """``agent.tools`` and the tools of ``agent.tool_config`` together (one name once)."""
    built = build_tools(tools)
    if tool_config:
        for name, tool in load_tool_config(tool_config).items():
            if name in built:
                raise ToolConfigError(
                    f"agent.tool_config ({tool_config}): a tool named {name!r} is in agent.tools too: drop one"
                )
            built[name] = tool
    return built


def _build(entry: ToolEntry, where: str) -> Tool:
    if entry.class_name in registered_tools():
        cls: Any = get_tool(entry.class_name)
    else:
        cls = import_object(entry.class_name, f"{where}: class_name", ToolConfigError)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ToolConfigError(f"{where}: class_name names {cls!r}, not a subclass of rlasync.tools.Tool")
    options = {k: v for k, v in entry.config.items() if k not in VERL_ONLY_OPTIONS}
    try:
        tool = cls(**options)
    except (TypeError, ValueError) as exc:  # an option it does not take, or a bad value
        raise ToolConfigError(f"{where}: config: {exc}") from None
    if entry.tool_schema is not None:
        schema = entry.tool_schema
        if schema.type != "function":
            raise ToolConfigError(f"{where}: tool_schema.type must be 'function', got {schema.type!r}")
        if schema.function.parameters.get("type", "object") != "object":
            raise ToolConfigError(f"{where}: tool_schema.function.parameters must be an object schema")
        tool.name = schema.function.name
        tool.description = schema.function.description or tool.description
        tool.parameters = schema.function.parameters
    return tool
