"""``Fleet``: where a run's parts run, and what a run asks of them. Two fleets, chosen once
(``make_fleet``) when the run is made, so nothing after asks which:

- ``ClusterFleet`` (``cluster_fleet``): the cluster's nodes, one or many, with the real
  engines, agent-loop workers, trainer ranks and synchroniser;
- ``SimFleet`` (``sim_fleet``): the simulator's stand-ins in virtual time, composed the same
  way; it saves no checkpoints and validates nothing (``saves_checkpoints``, ``validates``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import Config
from ..engines import EngineGroup
from .cluster_fleet import Closers, ClusterFleet, OnHead, Read
from .placement import Placement
from .sim_fleet import SimFleet, Simulated

if TYPE_CHECKING:
    from ..trainer import TrainerActor
    from ..trainer.protocol import Trainer
    from ..weights import WeightSync


class Fleet(Protocol):
    """The parts of a run and where they run. ``open`` makes them, each registered in the run's
    closers; ``start`` starts the weight sync once the run's records are open."""

    saves_checkpoints: bool  # whether the trainer holds a state to checkpoint and restore
    validates: bool  # whether held-out validation means anything here
    model_dir: Path  # the model folder the engines and the trainer start from
    pad: int  # the tokenizer's pad id
    cluster: Any  # the nodes: ``cluster.head`` is this process's (None until opened)
    router: Any  # the head's Router over every engine in rotation (None until started)
    engine: EngineGroup  # over that router: pause and resume every engine at once
    rollouts: Any  # the AgentLoopManager: rows to trajectories, on the workers
    trainer: Trainer
    synchronizer: WeightSync
    rejoins: int  # lost nodes that joined again and got their roles back

    async def open(
        self, config: Config, placement: Placement, closers: Closers, read: Read, on_head: OnHead
    ) -> None: ...

    async def start(self) -> None: ...

    def checkpointed_trainer(self) -> TrainerActor: ...


def make_fleet(simulated: Simulated | None = None) -> Fleet:
    """The fleet of a run: the cluster's, or the simulator's stand-ins (``simulated``)."""
    return ClusterFleet() if simulated is None else SimFleet(simulated)
