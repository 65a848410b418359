"""``EngineGroup``: engine actors behind a router, driven by a schedule as one engine.

    group = EngineGroup(Router(engine_refs))
    out = await group.generate(request, session_id="traj-3")   # the router picks the engine
    await group.pause("abort"); ...; await group.resume()        # every engine at once

Requests go through the router (least loaded, sticky sessions); ``pause``, ``resume``,
``update_weights``, ``sleep`` and ``wake_up`` fan out to every engine in rotation, so a schedule
written against one engine drives a fleet unchanged. An engine whose node is lost during one of those leaves
rotation (its requests move, as the router moves them) and the others go on; with none left,
``NoEngineError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from .router import NoEngineError, Router
from .types import EngineStats, GenerateOutput, GenerateRequest, PauseMode, TokenChunk

T = TypeVar("T")


class EngineGroup:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._version = 0

    async def generate(self, request: GenerateRequest, *, session_id: str | None = None) -> GenerateOutput:
        return await self.router.generate(request, session_id=session_id)

    def generate_stream(
        self, request: GenerateRequest, *, session_id: str | None = None
    ) -> AsyncIterator[TokenChunk]:
        return self.router.generate_stream(request, session_id=session_id)

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        outs = await self._each(lambda ref: ref.pause(mode, timeout))
        return [out for part in outs for out in part]

    async def resume(self) -> None:
        await self._each(lambda ref: ref.resume())

    async def sleep(self, offload_weights: bool = False) -> int:
        """Every engine sleeps (``cluster.colocate``); the KV cache bytes they then hold, summed."""
        stats = await self._each(lambda ref: ref.sleep(offload_weights))
        return sum(s.kv_cache_bytes for s in stats)

    async def wake_up(self) -> None:
        await self._each(lambda ref: ref.wake_up())

    async def stats(self) -> list[EngineStats]:
        """Every engine's stats now."""
        return await self._each(lambda ref: ref.stats())

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        await self._each(lambda ref: ref.update_weights(dict(named_tensors), version))
        self._version = version

    async def _each(self, call: Callable[[Any], Awaitable[T]]) -> list[T]:
        """``call`` on every engine in rotation, concurrently: the results of those that answered.
        An engine found gone leaves rotation; any other error is raised."""
        refs = self.router.engines
        results = await asyncio.gather(*[call(ref) for ref in refs], return_exceptions=True)
        answered: list[T] = []
        for ref, result in zip(refs, results):
            if not isinstance(result, BaseException):
                answered.append(result)
            elif not self.router.engine_lost(ref.name, result):
                raise result
        if not self.router.engines:
            raise NoEngineError(
                "every engine of the group was lost (their nodes died or they were removed); nothing is left to generate with"
            )
        return answered

    @property
    def weight_version(self) -> int:
        """The version this group last moved every engine to with ``update_weights``."""
        return self._version

    async def close(self) -> None:
        await self.router.close()
