"""``EngineGroup``: engine actors behind a router, driven by a schedule as one engine.

    group = EngineGroup(Router(engine_refs))
    out = await group.generate(request, session_id="traj-3")   # the router picks the engine
    await group.pause("abort"); ...; await group.resume()        # every engine at once

Requests go through the router (least loaded, sticky sessions); ``pause``, ``resume`` and
``update_weights`` fan out to every engine in rotation, so a schedule written against one
engine drives a fleet unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

from .router import Router
from .types import GenerateOutput, GenerateRequest, PauseMode, TokenChunk


class EngineGroup:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._version = 0

    async def generate(self, request: GenerateRequest, *, session_id: str | None = None) -> GenerateOutput:
        return await self.router.generate(request, session_id=session_id)

    def generate_stream(self, request: GenerateRequest, *, session_id: str | None = None) -> AsyncIterator[TokenChunk]:
        return self.router.generate_stream(request, session_id=session_id)

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        outs = await asyncio.gather(*[ref.pause(mode, timeout) for ref in self.router.engines])
        return [out for part in outs for out in part]

    async def resume(self) -> None:
        await asyncio.gather(*[ref.resume() for ref in self.router.engines])

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        await asyncio.gather(*[ref.update_weights(dict(named_tensors), version) for ref in self.router.engines])
        self._version = version

    @property
    def weight_version(self) -> int:
        """The version this group last moved every engine to with ``update_weights``."""
        return self._version

    async def close(self) -> None:
        await self.router.close()
