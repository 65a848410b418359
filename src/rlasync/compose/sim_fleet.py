"""``SimFleet``: a run's parts as the simulator's stand-ins (``rlasync.modes.sim``): engines in
this process behind the real engine actors and router, one agent-loop worker driving them all
on the head, a trainer and a weight sync of modelled durations. The composition is the
cluster's (``ClusterFleet``); it saves no checkpoints and validates nothing (its engines
generate token counts, not answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import ConfigError
from ..engines import EngineGroup
from .cluster_fleet import ClusterFleet, Read

if TYPE_CHECKING:
    from ..trainer import TrainerActor
    from ..trainer.protocol import Trainer
    from ..weights import WeightSync


class Simulated(Protocol):
    """Parts that stand in for real ones (``rlasync.modes.sim.SimCluster``): engines in this
    process, a trainer and a weight sync of modelled durations, a tokenizer."""

    engines: list[Any]
    tokenizer: Any

    @property
    def trainer(self) -> Trainer: ...

    def synchronizer(self, engines: EngineGroup) -> WeightSync: ...


class SimFleet(ClusterFleet):
    """``simulated``'s stand-ins, composed as the cluster's parts are, all on the head."""

    saves_checkpoints = False
    validates = False

    def __init__(self, simulated: Simulated) -> None:
        super().__init__()
        self.simulated = simulated

    async def _model_dir(self) -> Path:
        self.tokenizer = self.simulated.tokenizer
        return Path(self.config.train.run_dir)

    async def _open_trainer(self, head: Any) -> None:
        self.trainer = self.simulated.trainer

    def _read(self, read: Read) -> asyncio.Future[None]:
        """In this thread: on the simulator's virtual-time loop a thread's time would pass as
        simulated time."""
        read()
        self.pad = int(self.tokenizer.pad_token_id or 0)
        return asyncio.ensure_future(asyncio.sleep(0))

    async def _spawn_engines(self, head: Any) -> tuple[dict[int, list[int]], bool, dict[str, Any]]:
        """Every stand-in on the head, one worker driving them all (with the tokenizer)."""
        from ..engines import EngineActor

        if self.placement.nodes != 1:
            raise ConfigError(
                "a simulated run lives on the head: leave cluster.* at its defaults (rlasync.modes.sim.simulated_config)"
            )
        self.engines = [
            await head.spawn(EngineActor, engine=engine, name=engine.name)
            for engine in self.simulated.engines
        ]
        return {0: list(range(len(self.engines)))}, False, {"tokenizer": self.tokenizer}

    async def _open_sync(self, loading: asyncio.Future[None] | None) -> None:
        self.synchronizer = self.simulated.synchronizer(self.engine)

    async def start(self) -> None:
        return None

    def checkpointed_trainer(self) -> TrainerActor:
        raise RuntimeError("a run of simulated parts saves and restores no checkpoints")
