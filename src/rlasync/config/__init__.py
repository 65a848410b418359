"""Typed configuration (msgspec Structs) read from YAML; imports no torch."""

from .agent import AgentConfig
from .async_training import AsyncTrainingConfig
from .cluster import ClusterConfig
from .data import CustomRewardFunctionConfig, DataConfig
from .endpoint import EndpointConfig
from .engine import (
    AnyEngineConfig,
    EngineConfig,
    RouterConfig,
    SGLangEngineConfig,
    SimEngineConfig,
    VLLMEngineConfig,
)
from .errors import ConfigError
from .launch import LaunchConfig
from .loader import Config, convert, load_config
from .runtime import RuntimeConfig
from .train import TrainConfig, TrainerConfig
from .weights import WeightsConfig

__all__ = [
    "AgentConfig",
    "AnyEngineConfig",
    "AsyncTrainingConfig",
    "ClusterConfig",
    "Config",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "ConfigError",
    "EndpointConfig",
    "EngineConfig",
    "LaunchConfig",
    "RouterConfig",
    "RuntimeConfig",
    "SGLangEngineConfig",
    "SimEngineConfig",
    "TrainConfig",
    "TrainerConfig",
    "VLLMEngineConfig",
    "WeightsConfig",
    "convert",
    "load_config",
]
