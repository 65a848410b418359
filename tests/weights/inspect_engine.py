"""An engine actor whose served parameters the weight tests can read back (importable in node
processes through PYTHONPATH)."""

from __future__ import annotations

import os
from typing import Any

from rlasync import endpoint
from rlasync.engines import EngineActor


class InspectableEngine(EngineActor):
    @endpoint
    async def parameters(self) -> dict[str, Any]:
        model = self._engine().model  # type: ignore[attr-defined]  # a TorchEngine
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    @endpoint
    async def pid(self) -> int:
        return os.getpid()
