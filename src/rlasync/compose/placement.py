"""``Placement``: the ``cluster`` section of a config, checked as a whole and resolved into
which node runs what.

    placement = Placement.of(load_config("configs/quickstart_cluster.yaml"))
    placement.engines     # [1, 2]: the node of each engine replica
    placement.trainer     # [0, 1]: the node of each trainer rank (in a process that node supervises)
    placement.workers()   # {1: [0], 2: [1]}: agent-loop workers and the replicas each drives

Every mistake is a ``ConfigError`` naming the settings to change, raised before any process
starts.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..config import Config, ConfigError


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int
    """Node processes, the head included."""
    engines: list[int]
    """The node of each engine replica (``engine-<i>``)."""
    trainer: list[int]
    """The node of each trainer rank."""
    loops: Literal["engines", "head"]
    """Where agent loops run: next to their engines, or all on the head."""
    one_machine: bool = False
    """Every node runs on this machine (``cluster.start=local``), so they share its GPUs; else
    each node is a machine of its own (one node process per machine: launch, torchrun, Slurm)."""

    @classmethod
    def of(cls, config: Config) -> Placement:
        c, world = config.cluster, config.trainer.world_size
        trainer = list(c.trainer) or [0] * world
        if len(trainer) != world:
            raise ConfigError(
                f"cluster.trainer places {len(trainer)} trainer rank(s) ({trainer}) but trainer.world_size={world}: "
                f"give one node per rank, or set trainer.world_size={len(trainer)}"
            )
        if c.engines_per_node:
            if c.engines != [0]:
                raise ConfigError("set cluster.engines or cluster.engines_per_node, not both")
            if not c.nodes:
                raise ConfigError(
                    "cluster.engines_per_node needs cluster.nodes (how many nodes get replicas)"
                )
            first = 1 if c.nodes > 1 else 0
            engines = [n for n in range(first, c.nodes) for _ in range(c.engines_per_node)]
        else:
            engines = list(c.engines)
        if not engines:
            raise ConfigError(
                "cluster.engines is empty: a run needs at least one engine replica (e.g. [0], the head)"
            )
        highest = max(engines + trainer)
        nodes = c.nodes or highest + 1
        if highest >= nodes:
            raise ConfigError(
                f"cluster.nodes={nodes} but the placement names node {highest}: raise cluster.nodes or place roles on nodes 0..{nodes - 1}"
            )
        if c.start == "external" and not c.listen.startswith("tcp://"):
            raise ConfigError(
                "cluster.start=external needs cluster.listen, the head's TCP address the other nodes join "
                "(e.g. tcp://10.0.0.1:29600)"
            )
        if c.colocate:
            _check_colocation(config, engines, trainer)
        return cls(
            nodes=nodes, engines=engines, trainer=trainer, loops=c.agent_loops, one_machine=c.start == "local"
        )

    def workers(self) -> dict[int, list[int]]:
        """Node -> the engine replicas its agent-loop worker drives (prefers, for ``engines``)."""
        if self.loops == "head":
            return {0: list(range(len(self.engines)))}
        hosts: dict[int, list[int]] = {}
        for replica, node in enumerate(self.engines):
            hosts.setdefault(node, []).append(replica)
        return hosts

    def _machine(self, node: int) -> int:
        return 0 if self.one_machine else node

    def _on_machine(self, nodes: list[int], machine: int) -> int:
        """How many of ``nodes`` (one entry per replica or rank) run on ``machine``."""
        return sum(1 for node in nodes if self._machine(node) == machine)

    def engine_device(self, config: Config, replica: int) -> str:
        """``engine.device`` for one replica: on GPUs, replica ``j`` of its machine starts at GPU
        ``j * tensor_parallel_size`` (after ``cuda:N``'s ``N``)."""
        device = config.engine.device
        if not device.startswith("cuda"):
            return device
        j = self._on_machine(self.engines[:replica], self._machine(self.engines[replica]))
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + j * config.engine.tensor_parallel_size}"

    def trainer_devices(self, config: Config) -> list[int]:
        """Each rank's GPU on its machine: after the GPUs the machine's engines take."""
        gpu_engines = config.engine.device.startswith("cuda")
        shared = gpu_engines and not config.cluster.colocate  # colocated: rank 0 on the engines' GPU
        devices = []
        for rank, node in enumerate(self.trainer):
            machine = self._machine(node)
            taken = (
                self._on_machine(self.engines, machine) * config.engine.tensor_parallel_size if shared else 0
            )
            devices.append(taken + self._on_machine(self.trainer[:rank], machine))
        return devices

    def describe(self) -> str:
        def where(nodes: list[int]) -> str:
            return ", ".join(f"node-{n}" for n in nodes)

        loops = "next to their engines" if self.loops == "engines" else "on the head"
        return (
            f"{self.nodes} node(s); engine replicas on {where(self.engines)}; agent loops {loops}; "
            f"trainer ranks on {where(self.trainer)}"
        )


def _check_colocation(config: Config, engines: list[int], trainer: list[int]) -> None:
    """What ``cluster.colocate`` needs: one device the engines sleep on while trainer rank 0 steps."""
    if config.train.mode != "sync":
        raise ConfigError(
            f"cluster.colocate needs train.mode=sync (train.mode={config.train.mode} generates while it trains, "
            "so the engines never sleep); set train.mode=sync or cluster.colocate=false"
        )
    if config.weights.transport == "broadcast":
        raise ConfigError(
            "cluster.colocate moves weights through host shared memory (NCCL refuses two ranks on one GPU): "
            "set weights.transport=shm or auto"
        )
    if config.cluster.start == "external" and set(engines) != {trainer[0]}:
        raise ConfigError(
            f"cluster.colocate puts the engines on trainer rank 0's machine: with cluster.start=external set "
            f"cluster.engines to [{trainer[0]}] (its node), not {engines}"
        )
    if config.engine.backend in ("vllm", "sglang") and not config.engine.device.startswith("cuda"):
        raise ConfigError(
            f"cluster.colocate with engine.backend={config.engine.backend} sleeps the engine through its GPU "
            "memory release: use engine.device=cuda, or engine.backend=torch on a CPU"
        )
    if config.engine.backend == "sim":
        raise ConfigError(
            "cluster.colocate: a simulated engine has no memory to free; set cluster.colocate=false"
        )


__all__ = ["Placement"]
