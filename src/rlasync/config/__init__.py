"""Typed configuration (msgspec Structs) read from YAML; imports no torch."""

from .loader import Config, ConfigError, convert, load_config
from .runtime import RuntimeConfig

__all__ = ["Config", "ConfigError", "RuntimeConfig", "convert", "load_config"]
