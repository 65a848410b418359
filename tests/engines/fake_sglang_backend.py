"""The SGLang fake as the engine backend ``sglang-fake``: a node that imports this module
(``runtime.preload_modules``) builds SGLang engines through the adapter's real factory
(``build_sglang``) around the fake, from an ``EngineConfig`` as a run's placement made it.
``SGLangInspector`` reads back, on that node, what the fake ``sglang.Engine`` was given."""

from __future__ import annotations

import dataclasses
from typing import Any

from fake_sglang import FAKE_API

from rlasync import Actor, endpoint
from rlasync.config import EngineConfig
from rlasync.engines import Engine, register_backend
from rlasync.engines.sglang import build_sglang


async def _build(config: EngineConfig) -> Engine:
    return await build_sglang(config, api=FAKE_API)


register_backend("sglang-fake", _build)


class SGLangInspector(Actor):
    @endpoint
    async def server_args(self, engine: str) -> dict[str, Any]:
        """The ``sglang.Engine`` arguments of the engine actor named ``engine`` on this node."""
        adapter = self.node.local_actor(engine).engine  # type: ignore[attr-defined]
        return dataclasses.asdict(adapter.engine.server_args)
