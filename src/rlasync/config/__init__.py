"""Typed configuration (msgspec Structs) read from YAML; imports no torch."""

from .engine import EngineConfig, RouterConfig
from .loader import Config, ConfigError, convert, load_config
from .runtime import RuntimeConfig

__all__ = ["Config", "ConfigError", "EngineConfig", "RouterConfig", "RuntimeConfig", "convert", "load_config"]
