"""Inference engines behind one token-in/token-out protocol; the torch engine is the default."""

from .protocol import Engine, EngineError
from .torch_engine import TorchEngine
from .types import EngineStats, FinishReason, GenerateOutput, GenerateRequest, PauseMode, SamplingParams, TokenChunk

__all__ = [
    "Engine", "EngineError", "EngineStats", "FinishReason", "GenerateOutput", "GenerateRequest", "PauseMode",
    "SamplingParams", "TokenChunk", "TorchEngine",
]  # fmt: skip
