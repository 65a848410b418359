"""``ClusterFleet``: a run's parts on the cluster's nodes (``cluster.*``), one node or many.

The nodes are started here (``cluster.start=local``) or joined from elsewhere; on them, the
trainer's ranks (in processes the nodes supervise), the engine replicas, an agent-loop worker
beside the engines (or on the head), the head's router over every engine in rotation, and the
synchroniser between the trainer and the engines. A node that is lost and joins again gets its
roles back (``_take_back``). The simulator's fleet (``sim_fleet``) is this composition with
stand-ins for the engines, the trainer and the weight sync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .. import plugins
from ..config import Config, EngineConfig
from ..config.cluster import with_node_modules
from ..engines import EngineGroup
from ..runtime.node import rank_of
from .feed import environment_source
from .model_dir import model_dir_for
from .placement import Placement

if TYPE_CHECKING:  # loaded when a run composes them (torch, the trainer's ranks)
    from ..trainer import TrainerActor
    from ..trainer.protocol import Trainer
    from ..weights import ParameterSynchronizer, WeightSync

log = logging.getLogger(__name__)

BACKEND_MODULES = {
    "vllm": ("rlasync.engines.vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm"),
    "sglang": ("rlasync.engines.sglang",),
}


async def open_cluster(config: Config, placement: Placement) -> Any:
    """The run's nodes: started here (``cluster.start=local``), or joined from elsewhere."""
    from ..runtime import ExternalCluster, LocalCluster

    # Engine nodes import torch and the engines (vLLM's big C extensions too) before joining,
    # when no heartbeat waits on them: loaded later, they hold the GIL for seconds.
    runtime = with_node_modules(
        config.runtime, *BACKEND_MODULES.get(config.engine.backend, ()), *plugins.resolved(config.plugins)
    )
    if config.cluster.start == "external":
        cluster: Any = ExternalCluster(placement.nodes, config.cluster.listen, config=runtime)
    else:
        cluster = LocalCluster(nodes=placement.nodes, config=runtime)
    await cluster.__aenter__()
    log.info("cluster: %s", placement.describe())
    return cluster


class Rotation:
    """Which engines serve, kept in step on the head's router and on every worker's router:
    the synchroniser takes a failed engine out (and brings a re-synced one back) here."""

    def __init__(self, router: Any, rollouts: Any) -> None:
        self.router, self.rollouts = router, rollouts

    def remove_engine(self, name: str) -> None:
        self.router.remove_engine(name)
        self.rollouts.engine_removed(name)

    def add_engine(self, ref: Any) -> None:
        self.router.add_engine(ref)
        self.rollouts.engine_added(ref)


Closers = list[Callable[[], Any]]  # the run's, closed in the reverse order of registering
Read = Callable[[], None]  # reads the rows (blocking: ``Feed.read``)
OnHead = Callable[[Any], Awaitable[None]]  # the head is up: the run's records meet it (its /metrics)


def _updates_per_step(config: Config) -> int:
    return 1 if config.train.mode == "sync" else config.async_training.require_batches


class ClusterFleet:
    """The parts of a run on its nodes (``open``), each registered in the run's closers to be
    closed in the reverse order. What a fleet of stand-ins does differently is a method of its
    own (``_model_dir``, ``_open_trainer``, ``_read``, ``_spawn_engines``, ``_open_sync``,
    ``start``, ``checkpointed_trainer``): ``SimFleet`` overrides those, and only those."""

    saves_checkpoints = True  # the trainer's ranks hold a state to save
    validates = True
    model_dir: Path
    tokenizer: Any
    pad: int  # the tokenizer's pad id
    cluster: Any  # a LocalCluster or an ExternalCluster: ``cluster.head`` is this process's node
    engines: list[Any]  # EngineActor refs, one per replica
    engine: EngineGroup  # over the router: pause and resume every engine at once
    rollouts: Any  # the AgentLoopManager
    trainer: Trainer
    synchronizer: WeightSync
    _plan: dict[int, list[int]]  # node -> the engine replicas its agent-loop worker drives
    _prefer: bool  # whether a worker prefers its own node's engines

    def __init__(self) -> None:
        self.cluster: Any = None  # the nodes, once opened (``open_cluster``)
        self.router: Any = None  # the head's Router over every engine in rotation, once started
        self.rejoins = 0  # lost nodes that joined again and got their roles back (cluster/rejoins)

    async def open(
        self, config: Config, placement: Placement, closers: Closers, read: Read, on_head: OnHead
    ) -> None:
        """The model folder (the warm-start first, if ``train.model_dir`` is empty); the nodes
        (``on_head``: the head is up, with its ``/metrics``); the trainer's group (its rank
        processes and a first collective: a group that cannot talk fails in seconds, before
        anything heavy loads); then side by side the trainer's model, the rows (``read``) and
        the tokenizer (a thread), and the engines, agent-loop workers and router; then the
        synchroniser. Each is registered in ``closers``."""
        self.config, self.placement, self._closers = config, placement, closers
        self.model_dir = await self._model_dir()
        self.cluster = await open_cluster(config, placement)
        closers.append(self.cluster.close)
        head = self.cluster.head
        if head.metrics is not None:
            await on_head(head)
        loading = await self._open_trainer(head)
        reading = self._read(read)
        try:
            await self._open_rollouts(head, reading)  # it waits for the reading
        except BaseException:
            reading.cancel()  # its thread ends on its own; what it read is dropped
            if loading is not None:
                loading.cancel()
                await asyncio.wait([loading])
            raise
        await self._open_sync(loading)

    async def _model_dir(self) -> Path:
        return await model_dir_for(self.config)

    async def _open_trainer(self, head: Any) -> asyncio.Future[None] | None:
        """The trainer's ranks, formed; its model loading (the future returned)."""
        from ..trainer import TrainerActor

        config, placement = self.config, self.placement
        trainer = TrainerActor(
            config.trainer, node=head, hosts=placement.trainer, devices=placement.trainer_devices(config)
        )
        self.trainer = self._trainer_actor = trainer
        self._closers.append(trainer.close)
        await trainer.form()
        return asyncio.ensure_future(
            trainer.load_model(self.model_dir, total_steps=config.train.steps * _updates_per_step(config))
        )

    def _read(self, read: Read) -> asyncio.Future[None]:
        """The rows and the tokenizer, read now, in a thread: read before the cluster opened
        (~0.8 s for the quickstart's 20 000 synthetic rows), they kept the nodes, which wait for
        the head to listen, and the first collective waiting."""
        from ..models.tiny import load_tokenizer

        def inputs() -> None:
            read()
            self.tokenizer = load_tokenizer(self.model_dir)
            self.pad = int(self.tokenizer.pad_token_id or 0)

        return asyncio.ensure_future(asyncio.to_thread(inputs))

    async def _spawn_engines(self, head: Any) -> tuple[dict[int, list[int]], bool, dict[str, Any]]:
        """The engine replicas on their nodes; the workers' plan, whether each prefers its own
        node's engines, and what else the workers are spawned with."""
        from ..engines import EngineActor

        placement = self.placement
        self.engines = list(
            await asyncio.gather(
                *[
                    head.spawn(EngineActor, self._engine_config(replica), node=node, name=f"engine-{replica}")
                    for replica, node in enumerate(placement.engines)
                ]
            )
        )
        return placement.workers(), placement.loops == "engines", {}

    async def _open_rollouts(self, head: Any, reading: asyncio.Future[None]) -> None:
        """The engine replicas, the agent-loop workers beside them, the router over them."""
        from ..agents import AgentLoopManager, AgentLoopWorker
        from ..engines import Router

        plan, prefer, kwargs = await self._spawn_engines(head)
        self._plan, self._prefer = plan, prefer
        self._source = await self._serve_reward_model(head)
        local: dict[str, list[str]] = {}
        workers = []
        for node, replicas in plan.items():
            name = f"agent-loops-{node}"
            local[name] = [self.engines[r].name for r in replicas] if prefer else []
            workers.append(
                await head.spawn(
                    AgentLoopWorker, self._worker_spec(local[name]), node=node, name=name, **kwargs
                )
            )
        self.router = Router(self.engines, self.config.router)
        self._closers.append(self.router.close)
        await reading  # the rows and the pad id, for the manager and the schedules
        self.engine = EngineGroup(self.router)
        self.rollouts = AgentLoopManager(
            workers, local=local, pad_token_id=self.pad, timeout_s=self.config.agent.rollout_timeout_s
        )
        self._closers.append(self.rollouts.close)

    async def _open_sync(self, loading: asyncio.Future[None] | None) -> None:
        """The synchroniser, once the trainer's model is loaded; nodes that rejoin, watched."""
        from ..weights import ParameterSynchronizer

        assert loading is not None
        await loading
        synchronizer = ParameterSynchronizer(
            self.config.weights,
            self._trainer_actor,
            list(self.engines),
            router=Rotation(self.router, self.rollouts),
        )
        self.synchronizer = self._parameter_sync = synchronizer
        self._closers.append(synchronizer.close)
        if self.placement.nodes > 1:
            self._take_back_rejoined(synchronizer)

    async def start(self) -> None:
        """Start the weight sync (once the run's records are open)."""
        await self._parameter_sync.start()

    def checkpointed_trainer(self) -> TrainerActor:
        """The trainer checkpoints are saved from and restored into (its ranks hold the state)."""
        return self._trainer_actor

    def _worker_spec(self, local: list[str]) -> Any:
        from ..agents import AgentWorkerSpec

        config = self.config
        return AgentWorkerSpec(
            model=str(self.model_dir),
            engines=self.engines,
            local=local,
            agent=config.agent,
            router=config.router,
            source=self._source,
            seed=config.train.seed,
        )

    async def _serve_reward_model(self, head: Any) -> str | dict[str, Any]:
        """The environment the agent-loop workers build (``environment_source``); a reward model
        on a node of its own (``data.reward: {reward_model: {node: N}}``) started there first, its
        ref put into the reward's options, so every worker's calls go to that one model."""
        from ..rewards.reward_model import served_options

        source = environment_source(self.config)
        files: dict[str, Any] = (source.get("files") or {}) if isinstance(source, dict) else {}
        options = served_options(files.get("reward", ""))
        if options is None:
            return source
        from ..agents.reward_server import RewardModelServer

        server = await head.spawn(RewardModelServer, options, node=int(options["node"]), name="reward-model")
        return {"files": {**files, "reward": {**options, "served_by": server}}}

    def _engine_config(self, replica: int) -> EngineConfig:
        config = self.config
        return msgspec.structs.replace(
            config.engine, model=str(self.model_dir), device=self.placement.engine_device(config, replica)
        )

    def _take_back_rejoined(self, synchronizer: ParameterSynchronizer) -> None:
        """Watch for nodes that were lost and join again (``rlasync node`` rejoins after a
        partition, as a new process): their engines and agent-loop worker start there again."""
        head = self.cluster.head
        self._rejoining: set[asyncio.Task[None]] = set()

        def joined(info: Any) -> None:
            if "." in info.node_id:  # a supervised child (a trainer rank): the trainer decides
                return
            task = asyncio.ensure_future(self._take_back(rank_of(info.node_id), synchronizer))
            self._rejoining.add(task)
            task.add_done_callback(self._rejoining.discard)

        head.join_listeners.append(joined)

        async def stop_watching() -> None:
            head.join_listeners.remove(joined)
            for task in list(self._rejoining):
                task.cancel()
            if self._rejoining:
                await asyncio.wait(self._rejoining)

        self._closers.append(stop_watching)

    async def _take_back(self, rank: int, synchronizer: ParameterSynchronizer) -> None:
        """Node ``rank`` joined again: its engines start from their config, join the weight group
        and enter rotation at the next sync (the late-join path); its agent-loop worker starts
        again and takes rows. The run goes on without them if any of that fails."""
        from ..agents import AgentLoopWorker
        from ..engines import EngineActor

        replicas = [r for r, node in enumerate(self.placement.engines) if node == rank]
        if not replicas and rank not in self._plan:  # a node with no role here (an extra one)
            return
        head = self.cluster.head
        try:
            fresh = await asyncio.gather(
                *[
                    head.spawn(EngineActor, self._engine_config(r), node=rank, name=f"engine-{r}")
                    for r in replicas
                ]
            )
            for replica, ref in zip(replicas, fresh):
                self.engines[replica] = ref
            if rank in self._plan:
                name = f"agent-loops-{rank}"
                local = [self.engines[r].name for r in self._plan[rank]] if self._prefer else []
                self.rollouts.add_worker(
                    await head.spawn(AgentLoopWorker, self._worker_spec(local), node=rank, name=name), local
                )
            for ref in fresh:
                await synchronizer.replace_engine(ref)
        except Exception as exc:  # a node that rejoins badly is a node still lost
            log.warning(
                "node-%d joined again, but its roles could not start there (%s); the run goes on without it",
                rank,
                exc,
            )
            return
        self.rejoins += 1
        log.warning(
            "node-%d joined again: %s start there and enter rotation at the next weight sync",
            rank,
            ", ".join(r.name for r in fresh) or "no engines",
        )
