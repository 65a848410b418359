"""``EngineActor``: any engine, hosted on a node of the actor runtime and callable from every node.

    engine = await cluster.spawn(EngineActor, EngineConfig(model="runs/nano"), node=1, name="engine-0")
    out = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=ids))

Which engine it builds comes from ``EngineConfig.backend``: a registry of async factories,
``torch`` built in; the vLLM and SGLang adapters register theirs. A request whose caller
goes away (cancelled, timed out, its node lost) is aborted in the engine, so no sequence
keeps decoding for nobody.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec

from ..runtime import Actor, endpoint
from ..config.engine import EngineConfig
from .protocol import Engine, EngineError
from .types import EngineStats, GenerateOutput, GenerateRequest, PauseMode, TokenChunk

EngineFactory = Callable[[EngineConfig], Awaitable[Engine]]
_BACKENDS: dict[str, EngineFactory] = {}


def register_backend(name: str, factory: EngineFactory) -> None:
    """Make ``EngineConfig(backend=name)`` build its engine with ``await factory(config)``."""
    _BACKENDS[name] = factory


async def build_engine(config: EngineConfig) -> Engine:
    if not config.model:
        raise EngineError("engine.model is empty: set it to a Hugging Face model folder on the engine's node")
    factory = _BACKENDS.get(config.backend)
    if factory is None:
        known = ", ".join(sorted(_BACKENDS))
        raise EngineError(f"engine.backend={config.backend!r} is not a registered engine backend (known: {known})")
    return await factory(config)


async def _build_torch(config: EngineConfig) -> Engine:
    from .torch_engine import TorchEngine

    def load() -> Engine:
        import torch

        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        return TorchEngine.from_pretrained(
            config.model, device=config.device, dtype=dtype, max_batch=config.max_batch,
            max_seq_len=config.max_seq_len or None, seed=config.seed, cpu_threads=config.cpu_threads,
        )  # fmt: skip

    # Loading weights blocks for seconds: off the event loop, so the node keeps answering.
    return await asyncio.to_thread(load)


async def _build_vllm(config: EngineConfig) -> Engine:
    from .vllm import VLLMEngine  # imports vLLM: only when selected

    return await VLLMEngine.create(config)


async def _build_sglang(config: EngineConfig) -> Engine:
    from .sglang import build_sglang  # imports SGLang only when it builds one

    return await build_sglang(config)


register_backend("torch", _build_torch)
register_backend("vllm", _build_vllm)
register_backend("sglang", _build_sglang)


class EngineActor(Actor):
    """Hosts one engine. Spawn it with an ``EngineConfig`` (built on the node), or, in this
    process, hand it a ready engine: ``node.spawn(EngineActor, engine=my_engine)``."""

    def __init__(self, config: EngineConfig | dict[str, Any] | None = None, *, engine: Engine | None = None) -> None:
        if (config is None) == (engine is None):
            raise ValueError("EngineActor needs exactly one of `config` (an EngineConfig) or `engine`")
        # Arguments of a remote spawn arrive as plain data: rebuild the Struct (and check it).
        self.config = msgspec.convert(config, EngineConfig) if isinstance(config, dict) else config
        self.engine: Engine | None = engine

    async def on_start(self) -> None:
        if self.engine is None:
            assert self.config is not None
            self.engine = await build_engine(self.config)

    async def on_stop(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    def _engine(self) -> Engine:
        assert self.engine is not None, "on_start builds the engine before any call is served"
        return self.engine

    @endpoint
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await self._engine().generate(request)
        return msgspec.structs.replace(out, engine=self.name)

    @endpoint
    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        stream = self._engine().generate_stream(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # the engine aborts an unfinished request

    @endpoint
    async def abort(self, request_id: str) -> bool:
        return await self._engine().abort(request_id)

    @endpoint
    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        outs = await self._engine().pause(mode, timeout)
        return [msgspec.structs.replace(out, engine=self.name) for out in outs]

    @endpoint
    async def resume(self) -> None:
        await self._engine().resume()

    @endpoint
    async def update_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        await self._engine().update_weights(named_tensors, version)

    @endpoint
    async def weight_version(self) -> int:
        return self._engine().weight_version

    @endpoint
    async def stats(self) -> EngineStats:
        return self._engine().stats()
