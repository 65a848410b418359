"""Inference engines behind one token-in/token-out protocol; the torch engine is the default.

``EngineActor`` hosts any engine on a node; ``Router`` spreads requests over all of them.
"""

from ..config.engine import EngineConfig, RouterConfig, SGLangEngineConfig, SimEngineConfig, VLLMEngineConfig
from .actor import EngineActor
from .backends import build_engine, register_backend
from .group import EngineGroup
from .protocol import Engine, EngineError, EngineLostError
from .router import EngineLoad, NoEngineError, Router, RouterBusyError, RouterStats
from .torch_engine import TorchEngine
from .types import (
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    SamplingParams,
    TokenChunk,
)

__all__ = [
    "Engine",
    "EngineActor",
    "EngineConfig",
    "EngineGroup",
    "EngineError",
    "EngineLoad",
    "EngineLostError",
    "EngineStats",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "NoEngineError",
    "PauseMode",
    "Router",
    "RouterBusyError",
    "RouterConfig",
    "RouterStats",
    "SGLangEngineConfig",
    "SamplingParams",
    "SimEngineConfig",
    "TokenChunk",
    "TorchEngine",
    "VLLMEngineConfig",
    "build_engine",
    "register_backend",
]
