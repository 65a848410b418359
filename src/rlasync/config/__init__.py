"""Typed configuration (msgspec Structs) read from YAML; imports no torch."""

from .agent import AgentConfig
from .data import DataConfig
from .engine import EngineConfig, RouterConfig
from .loader import Config, ConfigError, convert, load_config
from .runtime import RuntimeConfig
from .train import TrainConfig, TrainerConfig
from .weights import WeightsConfig

__all__ = ["AgentConfig", "Config", "DataConfig", "ConfigError", "EngineConfig", "RouterConfig", "RuntimeConfig", "TrainConfig", "TrainerConfig", "WeightsConfig", "convert", "load_config"]
