"""``Run``: the parts of one training run, made and started together from the config, closed
in order; every schedule (``rlasync.modes``) drives these and only these.

    run = await Run.open(config)
    uses, rows = run.draw(config.train.prompts_per_step)
    trajectories = await run.rollout(rows, name="step1")
    batch, train_batch = await run.train_batch(trajectories)
    await run.trainer.step(train_batch)

What it is made of, each part in its own module: the checks before anything starts
(``preflight``), where the parts run (``fleet``: the engines, agent-loop workers, trainer ranks
and synchroniser), the rows (``feed``), the training batches (``batch``), the checkpoints
(``checkpoints``) and the records (``record``). A ``Run`` delegates to them; it holds what they
share: the config, the closers and the moment the run began.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import Config
from ..data import Row, Sampler
from ..engines import EngineGroup, SamplingParams
from ..metrics import Stamp, StepRecord
from ..runtime.stall import off_loop
from .batch import Batches
from .checkpoints import Saver, checkpoint_due
from .feed import Feed
from .fleet import Fleet, make_fleet
from .preflight import check_servers, preflight
from .record import OnStep, Recorder
from .result import RunInterrupted, TrainResult

if TYPE_CHECKING:
    from ..trainer.protocol import Trainer
    from ..weights import WeightSync

log = logging.getLogger(__name__)
FULL_COLLECTION_EVERY = 1000  # middle-generation collections before a full one is looked at (Python: 10)


class Run:
    """The parts of one training run: the rows and their sampler, the nodes (``cluster.*``),
    the engine replicas on them, the agent-loop workers beside the engines, the trainer's
    ranks, the synchroniser between them, and ``metrics.jsonl``.

    One composition for every placement: the local default is the same parts on one node (the
    head's engine and loops in this process, the trainer's ranks in processes it supervises).

    - ``rollout(rows, name)`` is the one rollout path: ``AgentLoopManager`` spreads prompt groups
      over the workers (``agent_loops``: next to their engines, or on the head);
    - ``engine`` drives every engine in rotation as one (pause, resume) for the schedules;
    - ``synchronizer`` moves each version to every engine (shared memory for engines on rank 0's
      machine, a broadcast group for the others); an engine that fails leaves rotation for the
      head's router and for every worker.
    """

    def __init__(
        self, config: Config, *, stop: asyncio.Event | None = None, fleet: Fleet | None = None
    ) -> None:
        """Every check before anything starts (``preflight``); nothing starts here. ``fleet``:
        where the parts run (default: the cluster's nodes, ``make_fleet``)."""
        self.config = config
        self.checked = preflight(config)
        self.placement = self.checked.placement
        self.run_dir = Path(config.train.run_dir)
        self.feed = Feed(config, self.checked.files, self.checked.generator)
        self.batches = Batches(config)
        self.recorder = Recorder(config)
        self._closers: list[Callable[[], Any]] = []
        self.saver = Saver(config, self._closers)
        self.fleet = fleet or make_fleet()
        self.stop = stop or asyncio.Event()  # set: stop at the end of the step (``stopping``)
        self.started = time.perf_counter()

    @classmethod
    async def open(
        cls,
        config: Config,
        *,
        metrics_upto: int | None = None,
        fleet: Fleet | None = None,
        stop: asyncio.Event | None = None,
    ) -> Run:
        """Build and start everything (the warm-start first, if ``train.model_dir`` is empty).
        ``metrics_upto``: a resumed run's step (its records after it are dropped). ``fleet``:
        where the parts run (``Fleet``). ``stop``: set, the schedule stops at the end of its
        step (``stopping``), with a checkpoint."""
        run = cls(config, stop=stop, fleet=fleet)
        await run.start(metrics_upto=metrics_upto)
        return run

    async def start(self, *, metrics_upto: int | None = None) -> None:
        """Build and start everything, as ``open`` describes; closed again if that fails."""
        config = self.config
        await check_servers(config, self.checked)  # a server that does not start: before anything starts
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(config)))
        try:
            await self.fleet.open(
                config,
                self.placement,
                self._closers,
                self.feed.read,
                lambda head: self.recorder.export(head, lambda: self.fleet.router, self._closers),
            )
            await self.recorder.open(self._closers, resumed_at=metrics_upto)
            await self.fleet.start()
        except BaseException:
            self.ended_early()
            await self.close()
            raise
        # What is alive now (modules, the dataset rows, the model: ~0.5 M objects) lives as long
        # as the run; frozen, the collector never scans it again. Unfrozen, each full collection
        # paused the controller 0.05-0.26 s, every ~30 steps of the quickstart.
        gc.freeze()
        # What the run holds later is mostly token lists (tens of millions of references at
        # scale), which a full collection walks: 0.4-0.65 s of a held loop each time, about once
        # a step at 256 simulated GPUs. Young generations still collect cycles as before.
        # Python's own setting comes back when the run closes (a script may run on after it).
        threshold = gc.get_threshold()
        gc.set_threshold(*threshold[:2], FULL_COLLECTION_EVERY)
        self._closers.insert(0, lambda: gc.set_threshold(*threshold))

    # The parts the schedules drive, as the fleet opened them (``Fleet``) and the feed's sampler.
    @property
    def cluster(self) -> Any:
        """The nodes: ``cluster.head`` is this process's node."""
        return self.fleet.cluster

    @property
    def router(self) -> Any:
        """The head's Router over every engine in rotation."""
        return self.fleet.router

    @property
    def engine(self) -> EngineGroup:
        """Over that router: pause and resume every engine at once."""
        return self.fleet.engine

    @property
    def rollouts(self) -> Any:
        """The AgentLoopManager: rows to trajectories, on the workers."""
        return self.fleet.rollouts

    @property
    def trainer(self) -> Trainer:
        """A TrainerActor, or a stand-in."""
        return self.fleet.trainer

    @property
    def synchronizer(self) -> WeightSync:
        """A ParameterSynchronizer, or a stand-in."""
        return self.fleet.synchronizer

    @property
    def sampler(self) -> Sampler:
        """The training rows' sampler (``Feed``)."""
        return self.feed.sampler

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """Sampling parameters with ``seed``, else the next seed."""
        return self.feed.sampling(seed)

    def draw(self, n: int) -> tuple[list[tuple[int, int]], list[Row]]:
        """The next ``n`` training rows and their uses, ``(epoch, row index)`` (``Feed.draw``)."""
        return self.feed.draw(n)

    def learned(self, uses: list[tuple[int, int]], groups: list[list[Any]]) -> None:
        """A step trained these rows on these groups: the sampler hears their rewards."""
        self.feed.learned(uses, groups)

    def position(self) -> dict[str, Any]:
        """Where the data and the sampling seeds stand, for a checkpoint (``Feed.position``)."""
        return self.feed.position()

    async def with_signal(
        self, uses: list[tuple[int, int]], trajectories: list[Any], name: str
    ) -> tuple[list[tuple[int, int]], list[Any], dict[str, int]]:
        """Only the groups whose rewards differ, refilled (``Feed.with_signal``)."""
        return await self.feed.with_signal(uses, trajectories, name, self.rollout)

    def sampled(self, stats: dict[str, int]) -> None:
        """The dynamic sampling (``with_signal``) of the batch this step trains: in its record."""
        self.recorder.sampled(stats)

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

    async def train_batch(self, trajectories: list[Any]) -> tuple[Any, Any]:
        """``(RolloutBatch, TrainBatch)`` of whole groups, with group-relative advantages, made
        off the loop (``off_loop``)."""
        batch, train_batch, penalties = await off_loop(self.batches.make, trajectories, self.fleet.pad)
        self.recorder.trained(trajectories, penalties)
        return batch, train_batch

    async def validate(self) -> float:
        """Held-out accuracy: the mean reward (the run's) of the validation rows' answers,
        greedy or ``train.val_samples`` sampled at ``train.val_temperature`` each."""
        if not self.fleet.validates:
            return 0.0
        cfg = self.config.train
        params = SamplingParams(temperature=cfg.val_temperature, max_new_tokens=cfg.max_new_tokens)
        rows = [
            dict(row, uid=f"val/{i}/{k}")
            for i, row in enumerate(self.feed.val_rows)
            for k in range(cfg.val_samples)
        ]
        trajectories = await self.rollouts.trajectories(rows, params, group=cfg.val_samples)
        return sum(t.reward for t in trajectories) / len(trajectories)

    def checkpoint_due(self, step: int, *, stopping: bool = False) -> bool:
        """Whether step ``step`` ends with a checkpoint (``checkpoints.checkpoint_due``), where
        the fleet saves them."""
        return self.fleet.saves_checkpoints and checkpoint_due(self.config, step, stopping=stopping)

    async def checkpoint(
        self, step: int, state: dict[str, Any], files: dict[str, Any] | None = None, *, stopping: bool = False
    ) -> str | None:
        """Save checkpoint ``step`` if one is due (``checkpoint_due``); its folder, else None.
        ``state``: the schedule's own (weight version, accuracies); the data position, the
        sampling RNG and the mode are added here, unless ``state`` has them (``sampler``,
        ``rng``: taken at the instant its ``files`` describe). ``files``: the schedule's own, e.g.
        samples in flight (name -> bytes, or an awaitable of them, finished in the background)."""
        if not self.checkpoint_due(step, stopping=stopping):
            return None
        full = {"mode": self.config.train.mode, **self.feed.position(), **state}  # state's own win
        trainer = self.fleet.checkpointed_trainer()
        return await self.saver.save(step, trainer, full, model_source=self.fleet.model_dir, files=files)

    async def restore(self, folder: Path, state: dict[str, Any]) -> tuple[float, float]:
        """Resume from checkpoint ``folder`` (``state``: its ``state.json``): the trainer's
        parameters and optimizer, the engines at its weight version, the data position and the
        sampling RNG. (initial accuracy, accuracy so far)."""
        await self.fleet.checkpointed_trainer().load(folder)
        await self.synchronizer.sync(state["weight_version"])
        self.feed.restore(state)
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

    def write(self, record: StepRecord, on_step: OnStep = None) -> None:
        """One line of ``metrics.jsonl`` (``Recorder.write``): ``record`` stamped with the seconds
        since the run began and the fleet's state (``Stamp``), and the sampler's numbers."""
        if record.stamp is None:
            record.stamp = Stamp(
                elapsed_s=round(time.perf_counter() - self.started, 3),
                engines=len(self.router.engines),
                rows_retried=self.rollouts.retried,
                rejoins=self.fleet.rejoins,
                reward_errors=self.batches.reward_errors,
            )
        if record.step and not record.sampler:  # step 0 (the starting weights' validation) drew nothing
            record.sampler = self.sampler.metrics()
        self.recorder.write(record, on_step)

    def finish(self, result: TrainResult) -> None:
        """The run's result as its summary: ``<run_dir>/summary.json`` and every tracker's."""
        self.recorder.finish(result)

    def ended_early(self) -> None:
        """The run stops before its last step (an error, an interrupt): the nodes it stops exit
        with ``EX_ENDED_EARLY``, not 0, so a launcher that restarts a failed group (``torchrun
        --max-restarts``) starts every node again, and the same command resumes."""
        from ..runtime.joining import EX_ENDED_EARLY

        if self.fleet.cluster is not None:  # None: no node was started, none to tell
            self.fleet.cluster.head.nodes_exit_code = EX_ENDED_EARLY

    async def close(self) -> None:
        """In reverse order of making: metrics file, weight group, trainer ranks, workers,
        router, then the nodes (engines stop with them); each once. Before all of them, the run
        leaves Prometheus's discovery: a scrape of a process already stopped would count it down."""
        self.recorder.unlist()
        while self._closers:
            closer = self._closers.pop()
            result = closer()
            if asyncio.iscoroutine(result):
                await result
