"""The SGLang fake as the engine backend ``sglang``: a process that imports this module (a
node, through ``runtime.preload_modules``) builds its ``sglang`` engines through the adapter's
real factory (``build_sglang``) around the fake, from an ``SGLangEngineConfig`` as a run's
placement made it. ``SGLangInspector`` reads back, on that node, what the fake
``sglang.Engine`` was given."""

from __future__ import annotations

import dataclasses
from typing import Any

from fake_sglang import FAKE_API

from rlasync import Actor, endpoint
from rlasync.config import SGLangEngineConfig
from rlasync.engines import Engine, register_backend
from rlasync.engines.sglang import build_sglang


async def _build(config: SGLangEngineConfig) -> Engine:
    return await build_sglang(config, api=FAKE_API)


register_backend("sglang", _build)  # SGLang has no CPU build: the fake stands in


class SGLangInspector(Actor):
    @endpoint
    async def server_args(self, engine: str) -> dict[str, Any]:
        """The ``sglang.Engine`` arguments of the engine actor named ``engine`` on this node."""
        adapter = self.node.local_actor(engine).engine  # type: ignore[attr-defined]
        return dataclasses.asdict(adapter.engine.server_args)
