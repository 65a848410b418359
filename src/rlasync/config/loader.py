"""Read a YAML experiment config and apply dotted command-line overrides.

    cfg = load_config("configs/runtime.yaml", ["runtime.call_timeout_s=5"])

A bad value is rejected with its dotted path and what was expected.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from .agent import AgentConfig
from .async_training import AsyncTrainingConfig
from .cluster import ClusterConfig
from .data import CustomRewardFunctionConfig, DataConfig
from .engine import (
    AnyEngineConfig,
    EngineConfig,
    RouterConfig,
    VLLMEngineConfig,
    engine_message,
    with_backend,
)
from .errors import ConfigError
from .launch import LaunchConfig
from .runtime import RuntimeConfig
from .train import TrainConfig, TrainerConfig
from .weights import WeightsConfig

T = TypeVar("T")


RENAMED = {"trainer.call_timeout_s": "trainer.operation_timeout_s"}
"""Settings that have a new name (old dotted path: new one); the old name is an error that
names the new one."""

_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)` - at `([^`]*)`")


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A whole experiment. Each component nests its own section."""

    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    engine: AnyEngineConfig = msgspec.field(default_factory=EngineConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    custom_reward_function: CustomRewardFunctionConfig = msgspec.field(
        default_factory=CustomRewardFunctionConfig
    )
    """A verl reward function as the rows' reward (verl's key, at the top as in verl's config)."""
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    async_training: AsyncTrainingConfig = msgspec.field(default_factory=AsyncTrainingConfig)
    launch: LaunchConfig = msgspec.field(default_factory=LaunchConfig)
    plugins: list[str] = []
    """User code every process of the run imports first: module names (``my_package.rl``) or
    Python files (``./my_plugin.py``) whose registrations (loops, tools, rewards, samplers,
    generators, interactions) the config then names (``rlasync.plugins``); ``rlasync train
    --plugin PATH`` adds one."""

    def __post_init__(self) -> None:
        # Settings one section implies for another, filled in here so that every process of the
        # run reads them the same (``Placement.of`` checks what cannot be filled in).
        lora, engine = self.trainer.lora, self.engine
        if isinstance(engine, VLLMEngineConfig):
            vllm = msgspec.structs.replace(
                engine,
                # a LoRA run whose sync sends adapters has vLLM serve them: its LoRA support sized for them
                max_lora_rank=max(engine.max_lora_rank, lora.rank if lora.sync == "adapter" else 0),
                sleep_mode=engine.sleep_mode or (self.cluster.colocate and engine.device.startswith("cuda")),
            )
            msgspec.structs.force_setattr(self, "engine", vllm)
        if self.cluster.colocate and self.weights.transport == "auto":  # the same-device path
            msgspec.structs.force_setattr(
                self, "weights", msgspec.structs.replace(self.weights, transport="shm")
            )


def registry_choice(
    spec: str | dict[str, Any],
    setting: str,
    registered: Mapping[str, T],
    register: str,
    error: type[ConfigError],
) -> tuple[str, T, dict[str, Any]] | None:
    """A setting that picks from a registry by ``name`` or ``{name: ..., option: value}``: the
    name, what it names and the options; None for "" or ``{}``. An unknown name is ``error``,
    listing the registered ones and how to add one (``register``, e.g. the decorator)."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec} if spec else {}
    if not options:
        return None
    name = options.pop("name", None)
    if not isinstance(name, str) or name not in registered:
        raise error(
            f"{setting}: {'no entry named ' + repr(name) if name else 'give a name'} (registered: "
            f"{', '.join(sorted(registered))}; register yours with {register} in a plugin)"
        )
    return name, registered[name], options


def import_object(path: str, setting: str, error: type[ConfigError]) -> Any:
    """What ``module:attr`` or ``module.attr`` names, imported (a class a setting names by its
    import path); ``error``, naming ``setting``, when it cannot be."""
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not attr:
        raise error(f"{setting}: {path!r} is not an import path (module.Class or module:Class)")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise error(f"{setting}: cannot import {path!r} ({exc})") from exc


def _set_dotted(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value")
    path, _, raw = override.partition("=")
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {override!r} has an empty name in its dotted path")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {key!r} is a value, not a section")
        node = child
    # YAML parsing gives "5" -> 5, "true" -> True, "[1, 2]" -> list, as in the config file.
    node[keys[-1]] = yaml.safe_load(raw)


def convert(tree: Any, kind: type[T]) -> T:
    """Turn plain data into a typed config, or raise ConfigError naming the dotted path."""
    whole = kind is Config and isinstance(tree, dict)
    if whole and "engine" in tree:
        tree = {**tree, "engine": with_backend(tree["engine"])}
    try:
        return msgspec.convert(tree, kind, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec writes paths as `$.runtime.call_timeout_s`; users write them without `$.`.
        message = str(exc).replace("`$.", "`").replace("`$`", "`<top level>`")
        unknown = _UNKNOWN_FIELD.search(message)
        if unknown is not None and kind is Config:
            old = f"{unknown[2]}.{unknown[1]}"
            if old in RENAMED:
                message = f"`{old}` was renamed to `{RENAMED[old]}`"
        if whole:
            message = engine_message(message, tree.get("engine"))
        raise ConfigError(f"invalid config: {message}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load ``path`` (YAML; None means all defaults), then apply ``section.field=value`` overrides."""
    tree: Any = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping of sections, got {type(tree).__name__}"
            )
    for override in overrides:
        _set_dotted(tree, override)
    return convert(tree, Config)
