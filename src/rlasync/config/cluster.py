"""Where each role of a run lives (``cluster.*``): engine replicas, their agent loops, trainer ranks.

A run is a set of node processes numbered by rank; node 0 (the head) runs the controller.
The default is everything on this machine, as one command: the head hosts the engine and its
agent loops, and each trainer rank runs in a process the head starts and supervises.

    cluster:                 # configs/quickstart_cluster.yaml
      engines: [1, 2]        # an engine replica on node 1 and one on node 2
      trainer: [0, 1]        # trainer rank 0 next to the head, rank 1 on node 1
      agent_loops: engines   # each engine's agent loops run on its node
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .runtime import RuntimeConfig

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]

# What a training run's nodes host (engines, agent loops, the model code their engines and ranks
# load): imported before a node joins, while no heartbeat waits on it; imported later, torch and
# transformers hold the GIL for seconds.
NODE_MODULES = ("rlasync.engines", "rlasync.agents", "rlasync.serving", "rlasync.models.model_code")


def with_node_modules(runtime: RuntimeConfig, *extra: str) -> RuntimeConfig:
    """``runtime`` preloading ``NODE_MODULES``, its own ``preload_modules`` and ``extra``, each once."""
    modules = dict.fromkeys((*NODE_MODULES, *runtime.preload_modules, *extra))
    return msgspec.structs.replace(runtime, preload_modules=tuple(modules))


NodeRank = Annotated[int, msgspec.Meta(ge=0)]


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The placement of a run (``cluster.*``); ``rlasync.compose.placement.Placement`` checks it as a whole."""

    nodes: NonNegativeInt = 0
    """Node processes of the run, the head included; 0: as many as the placement names (its
    highest node rank + 1)."""

    start: Literal["local", "external"] = "local"
    """``local``: the head starts nodes 1..N-1 on this machine as child processes (over Unix
    sockets, or loopback TCP with ``runtime.transport=tcp``). ``external``: they are started
    elsewhere (``rlasync node --rank R --head ADDRESS`` on each machine, or a launcher) and the
    head waits ``runtime.join_timeout_s`` for all of them to join at ``cluster.listen``."""

    listen: str = ""
    """The head's address with ``start: external``, e.g. ``tcp://10.0.0.1:29600`` (an address the
    other machines reach; TCP is authenticated with ``RLASYNC_CLUSTER_SECRET``). Local clusters
    pick their own."""

    engines: list[NodeRank] = msgspec.field(default_factory=lambda: [0])
    """The node of each engine replica, one entry per replica (list a node twice for two
    replicas there). ``[0]``: one engine in the head's own process, the local default."""

    engines_per_node: NonNegativeInt = 0
    """Instead of listing ``engines``: this many replicas on every node but the head (on the head
    when the run has one node). 0: use ``engines``."""

    trainer: list[NodeRank] = []
    """The node of each trainer rank, in rank order (list a node twice for two ranks there); it
    must have ``trainer.world_size`` entries. Each rank runs in a process of its own that its
    node starts and supervises (torch.distributed wants a process per rank). Empty: every rank
    on the head."""

    colocate: bool = False
    """The engines and trainer rank 0 share one device (verl's hybrid engine): a GPU, or on a CPU
    machine its cores. During each train step every engine sleeps, its KV cache freed (with
    ``engine.offload_weights`` its weights moved to host memory too), and it wakes for the next
    rollout, the new weights copied in through host shared memory (``weights.transport=shm``,
    which this sets). Needs ``train.mode=sync`` (the other modes generate while they train) and
    the engines on this machine; the step's record says how many KV bytes the engines held while
    the trainer ran (``colocate/kv_bytes_training``: 0)."""

    agent_loops: Literal["engines", "head"] = "engines"
    """Where agent loops run: ``engines``, an ``AgentLoopWorker`` on every engine's node drives
    that node's engines, so a trajectory stays next to its engine and the head only sends
    prompts and receives trajectories (what lets one head drive many engines); ``head``, one
    worker on the head drives every engine through the router (every turn crosses the network)."""
