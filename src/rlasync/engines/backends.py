"""The engine backends by name: ``build_engine(config)`` builds the engine ``config.backend`` names.

    engine = await build_engine(VLLMEngineConfig(model="runs/nano"))

Each backend's settings are typed in ``rlasync.config.engine`` (one class per backend, the
union tagged by ``backend``); here each name has an async factory that gets that class. The
GPU engines' modules (and vLLM or SGLang with them) are imported only when one is built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..config.engine import BACKENDS, EngineConfig, SGLangEngineConfig, SimEngineConfig, VLLMEngineConfig
from ..registry import Registry
from .protocol import Engine, EngineError

EngineFactory = Callable[[Any], Awaitable[Engine]]
"""Builds an engine from the settings of its backend (the ``EngineConfig`` subclass whose tag
is the name it is registered under)."""

_BACKENDS = Registry[EngineFactory](
    "engine backend",
    unknown="engine.backend={name!r} is not a registered engine backend (known: {known})",
    error=EngineError,
)


def register_backend(name: str, factory: EngineFactory) -> None:
    """Make the ``name`` backend build its engine with ``await factory(config)``, replacing the
    factory it had (a fake, or a build of your own). The backends are those whose settings
    ``rlasync.config.engine`` types; another name is a ``ValueError``."""
    if name not in BACKENDS:
        raise ValueError(
            f"engine backend {name!r} has no settings class (the backends: {', '.join(BACKENDS)})"
        )
    _BACKENDS.register(name, factory)


async def build_engine(config: EngineConfig) -> Engine:
    if not config.model:
        raise EngineError("engine.model is empty: set it to a Hugging Face model folder on the engine's node")
    return await _BACKENDS.get(config.backend)(config)


async def _build_torch(config: EngineConfig) -> Engine:
    from .torch_engine import TorchEngine

    def load() -> Engine:
        import torch

        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        return TorchEngine.from_pretrained(
            config.model,
            device=config.device,
            dtype=dtype,
            max_batch=config.max_batch,
            max_seq_len=config.max_seq_len or None,
            seed=config.seed,
            cpu_threads=config.cpu_threads,
        )

    # Loading weights blocks for seconds: off the event loop, so the node keeps answering.
    return await asyncio.to_thread(load)


async def _build_vllm(config: VLLMEngineConfig) -> Engine:
    from .vllm import VLLMEngine  # imports vLLM: only when selected

    return await VLLMEngine.create(config)


async def _build_sglang(config: SGLangEngineConfig) -> Engine:
    from .sglang import build_sglang  # imports SGLang only when it builds one

    return await build_sglang(config)


async def _build_sim(config: SimEngineConfig) -> Engine:
    from .sim import LatencyModel, LogNormalLengths, SimClock, SimEngine

    return SimEngine(
        SimClock(scale=config.scale),
        LatencyModel(base_s=config.base_s, per_seq_s=config.per_seq_s, max_batch=config.max_batch),
        LogNormalLengths(median=config.median, sigma=config.sigma, cap=config.cap),
        token_block=config.token_block,
    )


register_backend("torch", _build_torch)
register_backend("sim", _build_sim)
register_backend("vllm", _build_vllm)
register_backend("sglang", _build_sglang)
