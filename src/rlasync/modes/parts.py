"""What every schedule is made of: the rows, the nodes and what runs on them (engines, agent
loops, trainer ranks: ``cluster.*``), advantages, the model folder RL starts from, and the
metrics file. A mode (``sync``, ``one_step_off``, ``fully_async``) is only the order in which it
uses them."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from .. import plugins
from ..agents import get_loop
from ..agents.interactions import conversation_score, interaction_factory
from ..algorithms import grpo_advantages, overlong_penalty, reinforce_pp_baseline_advantages, rloo_advantages
from ..config import Config, ConfigError, EngineConfig
from ..config.cluster import with_node_modules
from ..data import (
    DataGenerator,
    Row,
    RowResult,
    Sampler,
    load_rows,
    make_generator,
    make_sampler,
    synthetic_rows,
)
from ..data.synthetic import synthetic_capacity
from ..engines import EngineGroup, SamplingParams
from ..metrics import Rollouts, Stamp, StepRecord
from ..metrics.trackers import Tracker, TrackerUnavailable, open_trackers, tracker_names
from ..runtime.node import rank_of
from ..serving import OpenAIAgentLoop, load_agent
from ..tools import SandboxUnavailable, build_agent_tools
from .placement import Placement
from .traces import TRACES_FILE, trace_lines
from .warmstart import DEFAULT_SETTINGS, warm_start

if TYPE_CHECKING:  # loaded when a run composes them (torch, the trainer's ranks)
    from ..trainer import TrainerActor
    from ..trainer.protocol import Trainer
    from ..weights import ParameterSynchronizer, WeightSync
    from .telemetry import RunMetrics

log = logging.getLogger(__name__)


class TrainResult(msgspec.Struct, kw_only=True):
    initial_accuracy: float
    final_accuracy: float
    steps: int
    wall_s: float


OnStep = (
    Callable[[dict[str, Any]], None] | None
)  # a schedule's ``on_step``: each line of metrics.jsonl as it is written


class RunInterrupted(Exception):
    """The run stopped at the end of a step because it was asked to (``train(stop=...)``: Ctrl-C
    or SIGTERM under ``rlasync train``); ``checkpoint``: the one it saved then, if any."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        saved = f"; resume from its checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped on request after step {step}{saved}")
        self.step, self.checkpoint = step, checkpoint


def build_run_tools(config: Config, rows: list[Row]) -> dict[str, Any]:
    """``agent.tools``, built; fails at start-up, not mid-run, on a loop or tool the rows need
    and the config lacks (tools the rows name may be an MCP server's: then ``check_mcp_servers``
    checks them, once the servers have listed theirs)."""
    try:
        tools = build_agent_tools(config.agent.tools, config.agent.tool_config)
    except ConfigError:  # already names its setting (agent.tool_config); a ValueError, not re-worded below
        raise
    except SandboxUnavailable as exc:
        raise ConfigError(f"agent.tools: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:  # an unknown tool, or settings it does not take
        raise ConfigError(f"agent.tools: {exc.args[0] if isinstance(exc, KeyError) else exc}") from None
    offering = []  # rows whose loop offers agent.tools (an openai agent brings its own)
    for row in rows:
        try:
            loop = get_loop(str(row.get("agent_name") or config.agent.default_loop))
        except KeyError as exc:
            raise ConfigError(f"agent.default_loop or a row's agent_name: {exc.args[0]}") from None
        if issubclass(loop, OpenAIAgentLoop):
            load_agent(config.agent.openai_agent)
        else:
            offering.append(row)
    if not config.agent.mcp_servers:
        check_rows_tools(offering, set(tools))
    return tools


def check_rows_tools(rows: list[Row], provided: set[str]) -> None:
    """A ``ConfigError`` if a row offers the model a tool nothing provides."""
    for row in rows:
        missing = {str(t.get("function", t).get("name")) for t in row.get("tools") or []} - provided
        if missing:
            raise ConfigError(
                f"rows offer the tool(s) {sorted(missing)} that neither agent.tools nor agent.mcp_servers provide: "
                "add them to agent.tools"
            )


async def check_mcp_servers(config: Config, tools: dict[str, Any], rows: list[Row]) -> None:
    """``agent.mcp_servers`` start here once and list their tools, none named like one of
    ``agent.tools`` (``tools``, built), and together they provide every tool ``rows`` offer; a
    ``ConfigError`` naming the server or the tool otherwise."""
    from ..tools.mcp import MCPServers, MCPUnavailable

    try:
        async with MCPServers(config.agent.mcp_servers) as servers:
            offered = {name: tool.server for name, tool in servers.tools.items()}
    except MCPUnavailable as exc:
        raise ConfigError(f"agent.mcp_servers: {exc}") from None
    for name in sorted(set(offered) & set(tools)):
        raise ConfigError(
            f"agent.mcp_servers: server {offered[name]!r} offers a tool named {name!r}, as agent.tools does: drop one"
        )
    check_rows_tools(rows, set(tools) | set(offered))


def tool_loop(config: Config) -> str:
    """The loop of a synthetic task's tool-calling rows (calc): ``agent.default_loop`` when it
    names one other than ``single_turn`` (``openai``: an agent of the user's), else ``tool``."""
    return config.agent.default_loop if config.agent.default_loop != "single_turn" else "tool"


def read_rows(config: Config) -> tuple[list[Row], list[Row]]:
    """Training and validation rows: the data files, or the synthetic task's two splits."""
    cfg, data = config.train, config.data
    if not data.train_files:
        size = min(data.synthetic_train_size, synthetic_capacity(cfg.task, "train"))
        loop = tool_loop(config)
        return synthetic_rows(cfg.task, size, seed=cfg.seed, split="train", tool_loop=loop), synthetic_rows(
            cfg.task, cfg.val_size, seed=cfg.seed, split="val", tool_loop=loop
        )
    if not data.val_files:
        raise ConfigError(
            "data.train_files is set but data.val_files is not: give held-out rows to validate on"
        )

    def read(files: list[str]) -> list[Row]:
        return [
            row
            for f in files
            for row in load_rows(
                f, prompt_key=data.prompt_key, answer_key=data.answer_key, system_prompt=data.system_prompt
            )
        ]

    train, val = read(data.train_files), read(data.val_files)[: cfg.val_size]
    if not train or not val:
        raise ConfigError(f"data.{'train' if not train else 'val'}_files hold no rows")
    return train, val


def checkpoint_to_resume(config: Config) -> tuple[Path, dict[str, Any]]:
    """The newest sound checkpoint in ``train.run_dir`` and its state; it must be this mode's
    (another mode's work in flight would be silently dropped)."""
    from ..trainer.checkpoint import CheckpointError, Checkpoints, read_state

    folder = Checkpoints(config.train.run_dir, keep=config.train.keep_checkpoints).latest()
    state = read_state(folder)
    if state.get("mode", "sync") != config.train.mode:
        raise CheckpointError(
            f"{folder} was written by train.mode={state.get('mode', 'sync')}: resume it with that mode"
        )
    return folder, state


def group_advantages(config: Config, rewards: torch.Tensor) -> torch.Tensor:
    group = config.train.group_size
    if config.train.advantage == "rloo":
        return rloo_advantages(rewards, group)
    if config.train.advantage == "reinforce_pp":
        return reinforce_pp_baseline_advantages(rewards, group)
    return grpo_advantages(rewards, group, std_normalize=config.train.std_normalize)


def with_samples(trajectories: list[Any], advantages: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    """Each trajectory followed by its further samples (``Trajectory.samples``), and each
    sample's advantage: its trajectory's (they share its reward, so its place in its group)."""
    flat = [s for t in trajectories for s in (t, *t.samples)]
    owner = torch.tensor([i for i, t in enumerate(trajectories) for _ in range(1 + len(t.samples))])
    return flat, advantages[owner]


def starting_model_dir(config: Config) -> Path:
    """The folder RL starts from: ``train.model_dir``, or the preset warm-started on the task
    (cached under ``train.run_dir``). Blocking: a warm-start not cached yet takes a minute or more
    of CPU (``model_dir_for`` runs it in a thread); ``rlasync serve CONFIG`` serves this folder."""
    cfg = config.train
    if cfg.model_dir:
        if not (Path(cfg.model_dir) / "config.json").is_file():
            raise ConfigError(
                f"train.model_dir={cfg.model_dir} is not a model folder (no config.json); leave it empty to warm-start train.preset"
            )
        return Path(cfg.model_dir)
    settings = msgspec.structs.replace(
        DEFAULT_SETTINGS[cfg.task], greedy_threshold=cfg.warmstart_greedy_threshold
    )
    return warm_start(cfg.task, run_dir=cfg.run_dir, preset=cfg.preset, seed=cfg.seed, settings=settings)


async def model_dir_for(config: Config) -> Path:
    """``starting_model_dir`` in a thread: the event loop goes on while a warm-start trains."""
    return await asyncio.to_thread(starting_model_dir, config)


def open_metrics(path: Path, *, upto: int | None) -> Any:
    """``metrics.jsonl`` (or ``traces.jsonl``) for writing: fresh, or (resuming) its lines up to
    step ``upto`` kept."""
    if upto is None or not path.is_file():
        return path.open("w")
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= upto
    ]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def as_random_state(value: Any) -> Any:
    version, internal, gauss = value  # JSON turned random.getstate()'s tuples into lists
    return (version, tuple(internal), gauss)


def write_record(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


class Simulated(Protocol):
    """Parts that stand in for real ones (``rlasync.modes.sim``): engines in this process, a
    trainer and a weight sync of modelled durations, a tokenizer. The composition is the same."""

    engines: list[Any]
    tokenizer: Any

    @property
    def trainer(self) -> Trainer: ...

    def synchronizer(self, engines: EngineGroup) -> WeightSync: ...


class Run:
    """The parts of one training run, made and started together from the config, closed in
    order: the rows and their sampler, the nodes (``cluster.*``), the engine replicas on them,
    the agent-loop workers beside the engines, the trainer's ranks, the synchroniser between
    them, and ``metrics.jsonl``. Every schedule drives these.

    One composition for every placement: the local default is the same parts on one node (the
    head's engine and loops in this process, the trainer's ranks in processes it supervises).

    - ``rollout(rows, name)`` is the one rollout path: ``AgentLoopManager`` spreads prompt groups
      over the workers (``agent_loops``: next to their engines, or on the head);
    - ``engine`` drives every engine in rotation as one (pause, resume) for the schedules;
    - ``synchronizer`` moves each version to every engine (shared memory for engines on rank 0's
      machine, a broadcast group for the others); an engine that fails leaves rotation for the
      head's router and for every worker.
    """

    model_dir: Path
    train_rows: list[Row]
    val_rows: list[Row]
    tools: dict[str, Any]  # agent.tools, built (checked against the rows)
    _files: tuple[list[Row], list[Row]] | None  # the rows of data.train_files/val_files, read at once
    sampler: Sampler
    generator: DataGenerator | None  # data.generator: adds rows as the run learns
    _given_rows: int  # rows of the data; those after them were generated during the run
    _sample_rows: list[Row]  # the rows start-up checks stand for (a synthetic task's: one)
    tokenizer: Any
    pad: int
    _reading: asyncio.Future[None]  # the thread reading the rows and tokenizer (_compose)
    cluster: Any  # a LocalCluster or an ExternalCluster: ``cluster.head`` is this process's node
    engines: list[Any]  # EngineActor refs, one per replica
    router: Any  # the head's Router over every engine in rotation
    engine: EngineGroup  # over that router: pause and resume every engine at once
    rollouts: Any  # the AgentLoopManager
    trainer: Trainer  # a TrainerActor, or the simulator's stand-in
    synchronizer: WeightSync  # a ParameterSynchronizer, or the simulator's stand-in
    _trainer_actor: TrainerActor | None  # the real one: checkpoints are saved from it (None: simulated)
    _parameter_sync: ParameterSynchronizer | None  # the real one, started here (None: simulated)
    metrics: Any  # the open metrics.jsonl
    stop: asyncio.Event  # set: stop at the end of the step (``stopping``)

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        cfg = config.train
        self.config = config
        plugins.load_all(config.plugins)  # first: the names below may be theirs
        self.placement = Placement.of(config)  # every placement mistake before anything starts
        self.run_dir = Path(cfg.run_dir)
        # What would make the run fail is found here, before anything starts: the data files are
        # read (their rows, loops and tools checked). A synthetic task's rows are all alike, so one
        # stands for them; its 20 000 are drawn later, in a thread (``_read_inputs``).
        if config.data.val_files and not config.data.train_files:  # else ignored for the task's split
            raise ConfigError(
                "data.val_files is set but data.train_files is not: without training files the rows, "
                f"held-out ones too, come from the synthetic train.task ({cfg.task}); give data.train_files as well"
            )
        self._files = read_rows(config) if config.data.train_files else None
        if self._files is None and cfg.val_size > synthetic_capacity(cfg.task, "val"):
            raise ConfigError(
                f"train.val_size={cfg.val_size}: the {cfg.task} task has {synthetic_capacity(cfg.task, 'val')} distinct held-out problems; ask for at most that"
            )
        interaction_factory(config.agent.interaction, conversation_score(None))  # its name and options
        # data.generator: built here, so a bad name or option fails before anything starts
        self.generator = make_generator(config.data.generator, seed=cfg.seed)
        if cfg.overlong_buffer > config.agent.response_length:
            raise ConfigError(
                f"train.overlong_buffer={cfg.overlong_buffer} is longer than agent.response_length={config.agent.response_length}: "
                "the penalty starts that many tokens before the length limit"
            )
        self._sample_rows = (  # a synthetic task's rows are all alike: one stands for them
            [*self._files[0], *self._files[1]]
            if self._files
            else synthetic_rows(cfg.task, 1, seed=cfg.seed, split="val", tool_loop=tool_loop(config))
        )
        self.tools = build_run_tools(config, self._sample_rows)
        unknown = sorted(set(cfg.trackers) - {"jsonl", *tracker_names()})
        if unknown:
            raise ConfigError(
                f"train.trackers: unknown {unknown}; known: {', '.join(['jsonl', *tracker_names()])}"
            )
        self.trackers: list[Tracker] = []  # train.trackers beside metrics.jsonl, opened by ``start``
        self.traces: Any = None  # the open traces.jsonl (train.trace_every)
        self._traceable: list[Any] = []  # the last training batch's trajectories
        self._trained: list[Any] = []  # every trajectory trained on since the last record (rollout/*)
        self._penalties: list[float] = []  # their overlong penalties (train.overlong_buffer)
        self._sampling: dict[str, int] = {}  # the last step's dynamic sampling (train.dynamic_sampling)
        self.rng = random.Random(cfg.seed)  # the sampling seeds
        self.params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
        self.started = time.perf_counter()
        self._closers: list[Any] = []
        self.reward_errors = 0  # trajectories whose reward failed, over the run (reward/errors)
        self.batches = 0  # training batches made
        self.checkpointing = True  # every mode saves checkpoints (not with simulated parts)
        self.checkpoints: Any = None  # the run's Checkpoints, from the first save
        self.validating = True  # held-out validation (not with simulated parts)
        self.rejoins = 0  # lost nodes that joined again and got their roles back (cluster/rejoins)
        self.stop = stop or asyncio.Event()
        self._trainer_actor = self._parameter_sync = None
        self.telemetry: RunMetrics | None = None  # the run's /metrics families (runtime.metrics_port)
        self._unlist_targets: Callable[[], None] | None = None  # the run out of Prometheus's discovery
        self.router = None  # the head's Router, once the engines have started

    @classmethod
    async def open(
        cls,
        config: Config,
        *,
        metrics_upto: int | None = None,
        simulated: Simulated | None = None,
        stop: asyncio.Event | None = None,
    ) -> Run:
        """Build and start everything (the warm-start first, if ``train.model_dir`` is empty).
        ``simulated``: stand-ins for the engines, trainer and weight sync (the simulator's); the
        run then validates and checkpoints nothing. ``stop``: set, the schedule stops at the end
        of its step (``stopping``), with a checkpoint if ``train.checkpoint_on_interrupt``."""
        run = cls(config, stop=stop)
        await run.start(metrics_upto=metrics_upto, simulated=simulated)
        return run

    async def start(self, *, metrics_upto: int | None = None, simulated: Simulated | None = None) -> None:
        """Build and start everything, as ``open`` describes; closed again if that fails."""
        config = self.config
        if config.agent.mcp_servers:  # a server that does not start is a config error, before anything starts
            await check_mcp_servers(config, self.tools, self._sample_rows)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(config)))
        if simulated is None:
            self.model_dir = await model_dir_for(config)
        else:
            self.model_dir, self.tokenizer = self.run_dir, simulated.tokenizer
            self.checkpointing = self.validating = False
        try:
            await self._compose(simulated)
            self.metrics = open_metrics(self.run_dir / "metrics.jsonl", upto=metrics_upto)
            self._closers.append(self.metrics.close)
            if config.train.trace_every:
                self.traces = open_metrics(self.run_dir / TRACES_FILE, upto=metrics_upto)
                self._closers.append(self.traces.close)
            # In a thread: W&B starts a service process (seconds the nodes' heartbeats cannot spare).
            await asyncio.to_thread(self._open_trackers, resumed_at=metrics_upto)
            if self._parameter_sync is not None:
                await self._parameter_sync.start()
        except BaseException:
            await self.close()
            raise
        # What is alive now (modules, the dataset rows, the model: ~0.5 M objects) lives as long
        # as the run; frozen, the collector never scans it again. Unfrozen, each full collection
        # paused the controller 0.05-0.26 s, every ~30 steps of the quickstart.
        gc.freeze()

    async def _export_metrics(self, head: Any) -> None:
        """The run's families on the head's ``/metrics`` (``modes.telemetry``), and the targets
        file naming every node's, rewritten as nodes join."""
        from ..engines.telemetry import router_families
        from .telemetry import RunMetrics, remove_targets, write_targets

        telemetry = self.telemetry = RunMetrics()

        def families() -> list[Any]:
            router = self.router  # None until the engines have started
            return telemetry.families() + (router_families("head", router.stats()) if router else [])

        self._closers.append(head.metrics.add(families))
        targets = {m.node_id: m for m in await head.members()}
        write_targets(self.run_dir, targets.values())

        def joined(info: Any) -> None:
            targets[info.node_id] = info
            write_targets(self.run_dir, targets.values())

        def unlist() -> None:
            head.join_listeners.remove(joined)  # first: a node joining now must not list the run again
            remove_targets(self.run_dir)

        head.join_listeners.append(joined)
        self._unlist_targets = unlist

    def _open_trackers(self, *, resumed_at: int | None) -> None:
        """``train.trackers`` (``metrics.jsonl`` is written here, whatever the list says)."""
        cfg = self.config.train
        try:
            self.trackers = open_trackers(
                cfg.trackers,
                self.run_dir,
                msgspec.to_builtins(self.config),
                project=cfg.wandb_project,
                resumed_at=resumed_at,
            )
        except TrackerUnavailable as exc:
            raise ConfigError(str(exc)) from None
        for tracker in self.trackers:  # closed in a thread too: W&B flushes for seconds
            self._closers.append(lambda tracker=tracker: asyncio.to_thread(tracker.close))

    def finish(self, result: TrainResult) -> None:
        """The run's result as its summary: ``<run_dir>/summary.json`` and every tracker's."""
        summary = msgspec.to_builtins(result)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        for tracker in self.trackers:
            tracker.finish(summary)

    def _read_inputs(self, load_tokenizer: Callable[[Path], Any] | None) -> None:
        """The rows (the synthetic task's drawn now), their sampler, and the tokenizer (``None``:
        a simulated run's is already set) and its pad id. Blocking: runs in a thread."""
        config = self.config
        self.train_rows, self.val_rows = self._files or read_rows(config)
        self.sampler = make_sampler(
            config.data.sampler, self.train_rows, seed=config.train.seed, shuffle=config.data.shuffle
        )
        self._given_rows = len(self.train_rows)
        if load_tokenizer is not None:
            self.tokenizer = load_tokenizer(self.model_dir)
        self.pad = int(self.tokenizer.pad_token_id or 0)

    async def _compose(self, simulated: Simulated | None) -> None:
        """The nodes; the trainer's group (its rank processes and a first collective: a group that
        cannot talk fails in seconds, before anything heavy loads); then side by side the
        trainer's model, the rows and tokenizer (a thread), and the engines, agent-loop workers
        and router; then the synchroniser. Each is registered to be closed in the reverse order."""
        from ..models.tiny import load_tokenizer
        from ..trainer import TrainerActor
        from ..weights import ParameterSynchronizer

        config, placement = self.config, self.placement
        self.cluster = await open_cluster(config, placement)
        self._closers.append(self.cluster.close)
        head = self.cluster.head
        if head.metrics is not None:
            await self._export_metrics(head)
        loading: asyncio.Future[None] | None = None
        if simulated is None:
            trainer = TrainerActor(
                config.trainer, node=head, hosts=placement.trainer, devices=placement.trainer_devices(config)
            )
            self.trainer = self._trainer_actor = trainer
            self._closers.append(trainer.close)
            await trainer.form()
            loading = asyncio.ensure_future(
                trainer.load_model(self.model_dir, total_steps=config.train.steps * _updates_per_step(config))
            )
            # The rows and the tokenizer are read now, in a thread: read before the cluster opened
            # (~0.8 s for the quickstart's 20 000 synthetic rows), they kept the nodes, which wait
            # for the head to listen, and the first collective waiting.
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._read_inputs, load_tokenizer))
        else:  # in this thread: on the simulator's virtual-time loop a thread's time would pass as simulated time
            self._read_inputs(None)
            self._reading = asyncio.ensure_future(asyncio.sleep(0))
        try:
            await self._compose_rollouts(simulated, head)  # it waits for the reading
        except BaseException:
            self._reading.cancel()  # its thread ends on its own; what it read is dropped
            if loading is not None:
                loading.cancel()
                await asyncio.wait([loading])
            raise
        if loading is not None:
            await loading
            synchronizer = ParameterSynchronizer(
                config.weights, trainer, list(self.engines), router=Rotation(self.router, self.rollouts)
            )
            self.synchronizer = self._parameter_sync = synchronizer
            self._closers.append(synchronizer.close)
            if placement.nodes > 1:
                self._take_back_rejoined(synchronizer)
        else:
            assert simulated is not None  # no trainer is loading: the parts are simulated
            self.trainer = simulated.trainer
            self.synchronizer = simulated.synchronizer(self.engine)

    async def _compose_rollouts(self, simulated: Simulated | None, head: Any) -> None:
        """The engine replicas, the agent-loop workers beside them, the router over them."""
        from ..agents import AgentLoopManager, AgentLoopWorker
        from ..engines import EngineActor, Router

        config, placement = self.config, self.placement
        if simulated is None:
            self.engines = list(
                await asyncio.gather(
                    *[
                        head.spawn(
                            EngineActor, self._engine_config(replica), node=node, name=f"engine-{replica}"
                        )
                        for replica, node in enumerate(placement.engines)
                    ]
                )
            )
            plan, prefer, kwargs = placement.workers(), placement.loops == "engines", {}
        else:  # stand-ins live in this process: every one on the head, one worker driving them all
            if placement.nodes != 1:
                raise ConfigError(
                    "a simulated run lives on the head: leave cluster.* at its defaults (rlasync.modes.sim.simulated_config)"
                )
            self.engines = [
                await head.spawn(EngineActor, engine=engine, name=engine.name) for engine in simulated.engines
            ]
            plan, prefer, kwargs = {0: list(range(len(self.engines)))}, False, {"tokenizer": self.tokenizer}
        self._plan, self._prefer = plan, prefer
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
        self.router = Router(self.engines, config.router)
        self._closers.append(self.router.close)
        await self._reading  # the rows and the pad id, for the manager and the schedules
        self.engine = EngineGroup(self.router)
        self.rollouts = AgentLoopManager(
            workers, local=local, pad_token_id=self.pad, timeout_s=config.agent.rollout_timeout_s
        )
        self._closers.append(self.rollouts.close)

    def _worker_spec(self, local: list[str]) -> Any:
        from ..agents import AgentWorkerSpec

        config, synthetic = self.config, not self.config.data.train_files
        return AgentWorkerSpec(
            model=str(self.model_dir),
            engines=self.engines,
            local=local,
            agent=config.agent,
            router=config.router,
            task=config.train.task if synthetic else "",
            reward="" if synthetic else config.data.reward,
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

    def _engine_config(self, replica: int) -> EngineConfig:
        config = self.config
        return msgspec.structs.replace(
            config.engine, model=str(self.model_dir), device=self.placement.engine_device(config, replica)
        )

    def sampling(self) -> SamplingParams:
        """Sampling parameters with the next seed."""
        return msgspec.structs.replace(self.params, seed=self.rng.getrandbits(62))

    def draw(self, n: int) -> tuple[list[tuple[int, int]], list[Row]]:
        """The next ``n`` training rows and their uses, ``(epoch, row index)``: what the metrics
        record as trained (``data/rows``), so a run's data can be checked across restarts."""
        uses = self.sampler.next_uses(n)
        return uses, [dict(self.train_rows[index]) for _, index in uses]

    def learned(self, uses: list[tuple[int, int]], groups: list[list[Any]]) -> None:
        """A step trained these rows (``uses``) on these groups of trajectories: the sampler
        hears each row's rewards (a curriculum moves on from them)."""
        results = [
            RowResult(index, [float(t.reward) for t in group]) for (_, index), group in zip(uses, groups)
        ]
        self.sampler.update(results)
        if (
            self.generator is not None
            and results
            and (added := self.generator.generate(results, self.train_rows))
        ):
            self.train_rows.extend(added)
            self.sampler.add_rows(added)
            log.info("data.generator added %d rows (%d in all)", len(added), len(self.train_rows))

    def data_state(self) -> dict[str, Any]:
        """Where the data stands, for a checkpoint (JSON-safe): the sampler's position, and the
        generator's state with the rows it made (``restore_data`` adds them back first)."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        if self.generator is not None:
            state["generator"] = {
                "state": self.generator.state_dict(),
                "rows": msgspec.to_builtins(self.train_rows[self._given_rows :]),
            }
        return state

    def restore_data(self, state: dict[str, Any]) -> None:
        """Continue from ``data_state``'s ``state``."""
        if self.generator is not None and "generator" in state:
            made = state["generator"]["rows"]
            self.train_rows.extend(made)
            self.sampler.add_rows(made)
            self.generator.load_state_dict(state["generator"]["state"])
        self.sampler.load_state_dict(state["sampler"])

    async def rollout(
        self,
        rows: list[Row],
        name: str,
        *,
        params: SamplingParams | None = None,
        states: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Every row ``train.group_size`` times, contiguous groups (each group on one worker).
        Trajectory ids (hence sampling seeds) are ``name`` and the index: a resumed run samples
        what the uninterrupted one did, on any placement. ``params``: the sampling (default: the
        next seed); ``states``: trajectories to go on with, by id (a checkpoint's)."""
        group = self.config.train.group_size
        copies = [row for row in rows for _ in range(group)]
        uids = [dict(row, uid=f"{name}/{i}") for i, row in enumerate(copies)]
        return await self.rollouts.trajectories(uids, params or self.sampling(), group=group, states=states)

    def train_batch(self, trajectories: list[Any]) -> tuple[Any, Any]:
        """``(RolloutBatch, TrainBatch)`` of whole groups, with group-relative advantages."""
        from ..agents import collate
        from ..trainer import TrainBatch

        self._count_reward_errors(trajectories)
        self._traceable = trajectories  # the step's, for traces.jsonl (``write``)
        self._trained += trajectories
        batch = collate(trajectories, self.pad)
        rewards = batch.rewards
        if self.config.train.overlong_buffer:  # the trained reward; batch.rewards (reported) stays raw
            penalty = overlong_penalty(
                torch.tensor([len(t.response_ids) for t in trajectories]),
                limit=self.config.agent.response_length,
                buffer=self.config.train.overlong_buffer,
                penalty=self.config.train.overlong_penalty,
            )
            self._penalties += penalty.tolist()
            rewards = rewards + penalty.to(rewards.dtype)
        advantages = group_advantages(self.config, rewards)
        if any(t.samples for t in trajectories):  # an openai agent's further samples
            flat, advantages = with_samples(trajectories, advantages)
            # Tokens and lengths count every sample; the reported reward stays one per trajectory.
            batch = msgspec.structs.replace(collate(flat, self.pad), rewards=batch.rewards)
        return batch, TrainBatch.from_rollout(batch, advantages)

    async def with_signal(
        self, uses: list[tuple[int, int]], trajectories: list[Any], name: str
    ) -> tuple[list[tuple[int, int]], list[Any], dict[str, int]]:
        """DAPO's dynamic sampling (``train.dynamic_sampling``): of these rolled-out rows (``uses``,
        their groups in ``trajectories``), the groups whose rewards differ; more rows are drawn and
        rolled out, as many as ``uses`` at a time, until there are that many such groups or
        ``max_gen_batches`` rounds were made. The sampler hears of the groups left out now (of
        the kept ones when the schedule calls ``learned``). No group with signal at all: the last
        round's are kept (a step that changes nothing but stays a step). Also returns the
        rounds made and the groups dropped, for ``sampled`` when the step trains these."""
        cfg = self.config.train
        want, size = len(uses), cfg.group_size
        kept_uses: list[tuple[int, int]] = []
        kept: list[Any] = []
        left_uses: list[tuple[int, int]] = []
        left: list[list[Any]] = []
        rounds = 1
        while True:
            for use, start in zip(uses, range(0, len(trajectories), size)):
                group = trajectories[start : start + size]
                if len(kept_uses) < want and len({float(t.reward) for t in group}) > 1:
                    kept_uses.append(use)
                    kept += group
                else:
                    left_uses.append(use)
                    left.append(group)
            if len(kept_uses) >= want or rounds >= cfg.max_gen_batches:
                break
            uses, rows = self.draw(want)
            trajectories = await self.rollout(rows, name=f"{name}/{rounds}")
            rounds += 1
        if not kept_uses:
            kept_uses, kept = left_uses[-len(uses) :], [t for group in left[-len(uses) :] for t in group]
            left_uses, left = left_uses[: -len(uses)], left[: -len(uses)]
        self.learned(left_uses, left)
        return kept_uses, kept, {"gen_batches": rounds, "dropped_groups": len(left_uses)}

    def sampled(self, stats: dict[str, int]) -> None:
        """The dynamic sampling (``with_signal``) of the batch this step trains: in its record."""
        self._sampling = stats

    async def restore(self, folder: Path, state: dict[str, Any]) -> tuple[float, float]:
        """Resume from checkpoint ``folder`` (``state``: its ``state.json``): the trainer's
        parameters and optimizer, the engines at its weight version, the data position and the
        sampling RNG. (initial accuracy, accuracy so far)."""
        await self._saving_trainer().load(folder)
        await self.synchronizer.sync(state["weight_version"])
        self.restore_data(state)
        self.rng.setstate(as_random_state(state["rng"]))
        log.info("resumed from %s (step %d)", folder, state["step"])
        return float(state["initial_accuracy"]), float(state["accuracy"])

    def stopping(self) -> bool:
        """Whether the run was asked to stop (``stop``): the schedule ends this step with a
        checkpoint (``checkpoint_due``) and ``stopped``."""
        return self.stop.is_set()

    def stopped(self, record: StepRecord) -> RunInterrupted:
        """The error a schedule raises when ``stopping`` ended its step (``record``)."""
        saved = record.checkpoint
        note = f" (checkpoint {saved})" if saved else ""
        log.warning("stopped on request after step %d%s", record.step, note)
        return RunInterrupted(record.step, saved)

    def checkpoint_due(self, step: int, *, stopping: bool = False) -> bool:
        """Whether step ``step`` ends with a checkpoint: every ``train.checkpoint_every`` steps,
        after the last (every mode ends with its model on disk), and when ``stopping`` with
        ``train.checkpoint_on_interrupt``."""
        cfg = self.config.train
        due = (
            bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or step == cfg.steps
            or (stopping and cfg.checkpoint_on_interrupt)
        )
        return self.checkpointing and due

    async def checkpoint(
        self, step: int, state: dict[str, Any], files: dict[str, Any] | None = None, *, stopping: bool = False
    ) -> str | None:
        """Save checkpoint ``step`` if one is due (``checkpoint_due``); its folder, else None.
        ``state``: the schedule's own (weight version, accuracies); the data position, the
        sampling RNG and the mode are added here, unless ``state`` has them (``sampler``,
        ``rng``: taken at the instant its ``files`` describe). ``files``: the schedule's own, e.g.
        samples in flight (name -> bytes, or an awaitable of them, finished in the background)."""
        from ..trainer.checkpoint import Checkpoints

        cfg = self.config.train
        if not self.checkpoint_due(step, stopping=stopping):
            return None
        full = {
            "mode": cfg.mode,
            **self.data_state(),
            "rng": self.rng.getstate(),
            **state,
        }  # state's own win (taken earlier)
        if self.checkpoints is None:
            self.checkpoints = Checkpoints(self.run_dir, keep=cfg.keep_checkpoints)
            self._closers.append(
                self.checkpoints.wait
            )  # closed first: the last save is sealed before the ranks stop
        # The trainer's state is taken now; its files are written and sealed while the next steps
        # run, on any core. A crash before the seal leaves a `.partial` folder that
        # resuming skips.
        folder = await self.checkpoints.save(
            step, self._saving_trainer(), full, model_source=self.model_dir, files=files, background=True
        )
        return str(folder)

    def _saving_trainer(self) -> TrainerActor:
        """The trainer checkpoints are saved from and restored into (its ranks hold the state)."""
        if self._trainer_actor is None:
            raise RuntimeError("a run of simulated parts saves and restores no checkpoints")
        return self._trainer_actor

    def _count_reward_errors(self, trajectories: list[Any]) -> None:
        """Failed rewards, counted (``reward/errors``); a batch of nothing but failed rewards
        within the first ``train.fail_on_reward_errors`` batches stops the run."""
        from ..rewards import RewardError

        failed = [t.metrics.reward_error for t in trajectories if t.metrics.reward_error]
        self.reward_errors += len(failed)
        self.batches += 1
        limit = self.config.train.fail_on_reward_errors
        if failed and len(failed) == len(trajectories) and self.batches <= limit:
            raise RewardError(
                f"every reward of training batch {self.batches} failed ({len(failed)} trajectories), e.g. {failed[0]}; "
                "fix the reward (train.task, data.reward or the reward function), or set train.fail_on_reward_errors=0 to train on"
            )

    async def validate(self) -> float:
        """Held-out accuracy: the mean reward (the run's) of the validation rows' answers,
        greedy or ``train.val_samples`` sampled at ``train.val_temperature`` each."""
        if not self.validating:
            return 0.0
        cfg = self.config.train
        params = SamplingParams(temperature=cfg.val_temperature, max_new_tokens=cfg.max_new_tokens)
        rows = [
            dict(row, uid=f"val/{i}/{k}")
            for i, row in enumerate(self.val_rows)
            for k in range(cfg.val_samples)
        ]
        trajectories = await self.rollouts.trajectories(rows, params, group=cfg.val_samples)
        return sum(t.reward for t in trajectories) / len(trajectories)

    def write(self, record: StepRecord, on_step: OnStep = None) -> None:
        """One line of ``metrics.jsonl``: ``record`` stamped with the seconds since the run began
        and the fleet's state (``Stamp``), flat, then handed to ``on_step`` (progress lines, tests)."""
        if record.stamp is None:
            record.stamp = Stamp(
                elapsed_s=round(time.perf_counter() - self.started, 3),
                engines=len(self.router.engines),
                rows_retried=self.rollouts.retried,
                rejoins=self.rejoins,
                reward_errors=self.reward_errors,
            )
        if record.step and not record.sampler:  # step 0 (the starting weights' validation) drew nothing
            record.sampler = self.sampler.metrics()
        if record.rollouts is None and self._trained:
            penalty = sum(self._penalties) / len(self._penalties) if self._penalties else None
            record.rollouts = Rollouts.of(self._trained, overlong_penalty=penalty, **self._sampling)
        self._trained, self._penalties, self._sampling = [], [], {}
        if self.telemetry is not None:
            self.telemetry.observe(record)
        line = record.as_dict()
        write_record(self.metrics, line)
        for tracker in self.trackers:
            tracker.log(line)
        every = self.config.train.trace_every
        if self.traces is not None and self._traceable and every and record.step % every == 0:
            for trace in trace_lines(record.step, self._traceable, self.config.train.trace_samples):
                write_record(self.traces, trace)
            self._traceable = []
        if on_step is not None:
            on_step(line)

    async def close(self) -> None:
        """In reverse order of making: metrics file, weight group, trainer ranks, workers,
        router, then the nodes (engines stop with them); each once. Before all of them, the run
        leaves Prometheus's discovery: a scrape of a process already stopped would count it down."""
        if self._unlist_targets is not None:
            self._unlist_targets()
            self._unlist_targets = None
        while self._closers:
            closer = self._closers.pop()
            result = closer()
            if asyncio.iscoroutine(result):
                await result


# A schedule's own way to checkpoint a step (``Steps.end``): (record, weight version, stopping).
Save = Callable[[StepRecord, int, bool], Awaitable[None]]


class Steps:
    """What every schedule does around its steps: the held-out accuracy at the start (step 0's
    record), every ``train.validate_every`` steps and after the last; at the end of each step a
    checkpoint when one is due, the record written (``Run.write``), and a stop asked for obeyed;
    then the result.

        steps = Steps(run, state, on_step)  # state: the checkpoint resumed from's, else {}
        await steps.begin(resume_from)
        for step in steps:
            record = StepRecord(step=step, ...)
            if steps.validating(step):
                await steps.validate(record)
            await steps.end(record, version=step)
        return steps.result()
    """

    def __init__(self, run: Run, state: dict[str, Any], on_step: OnStep = None) -> None:
        self.run, self.state, self.on_step = run, state, on_step
        self.initial = self.accuracy = 0.0  # held-out accuracy: of the starting weights, the latest

    async def begin(self, resume_from: Path | None) -> None:
        """Restore the checkpoint ``resume_from``, or validate the starting weights (step 0)."""
        if resume_from is not None:
            self.initial, self.accuracy = await self.run.restore(resume_from, self.state)
        else:
            self.initial = self.accuracy = await self.run.validate()
            self.run.write(StepRecord(step=0, val_accuracy=self.initial))

    def __iter__(self) -> Iterator[int]:
        """The steps still to run."""
        return iter(range(self.state.get("step", 0) + 1, self.run.config.train.steps + 1))

    def validating(self, step: int) -> bool:
        """Whether step ``step`` ends with a validation: every ``train.validate_every``, and the last."""
        cfg = self.run.config.train
        return step % cfg.validate_every == 0 or step == cfg.steps

    async def validate(self, record: StepRecord) -> None:
        """The held-out accuracy of the weights the engines serve now, into ``record``."""
        self.accuracy = record.val_accuracy = await self.run.validate()

    async def save(
        self,
        record: StepRecord,
        version: int,
        stopping: bool,
        *,
        files: dict[str, Any] | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint step ``record.step`` if due, its folder into ``record``: weight ``version``,
        the accuracies, and the schedule's own ``state`` and ``files`` (``Run.checkpoint``)."""
        own = {"weight_version": version, "initial_accuracy": self.initial, "accuracy": self.accuracy}
        saved = await self.run.checkpoint(record.step, {**own, **(state or {})}, files, stopping=stopping)
        if saved:
            record.checkpoint = saved

    async def end(self, record: StepRecord, version: int, save: Save | None = None) -> None:
        """End step ``record.step``, the engines at weight ``version``: checkpoint it if due (by
        ``save``, the schedule's own way, else ``Steps.save``), write ``record``, and raise
        ``RunInterrupted`` if the run was asked to stop."""
        stopping = self.run.stopping()
        if self.run.checkpoint_due(record.step, stopping=stopping):
            await (save or self.save)(record, version, stopping)
        self.run.write(record, self.on_step)
        if record.step == self.run.config.train.steps:  # the last: the trackers get the summary
            self.run.finish(self.result())  # (while they are open: the run closes them next)
        if stopping:
            raise self.run.stopped(record)

    def result(self) -> TrainResult:
        return TrainResult(
            initial_accuracy=self.initial,
            final_accuracy=self.accuracy,
            steps=self.run.config.train.steps,
            wall_s=time.perf_counter() - self.run.started,
        )


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


def _updates_per_step(config: Config) -> int:
    return 1 if config.train.mode == "sync" else config.async_training.require_batches
