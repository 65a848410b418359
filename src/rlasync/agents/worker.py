"""Rolling out: ``AgentLoopWorker`` actors run the loops (``AgentLoopManager``, in
``rlasync.agents.manager``, spreads the rows over them).

    workers = [await cluster.spawn(AgentLoopWorker, AgentWorkerSpec(model="runs/nano", engines=refs, local=["engine-1"]), node=1)]
    manager = AgentLoopManager(workers, local={"worker-1": ["engine-1"]})
    trajectories = await manager.trajectories(rows, SamplingParams(temperature=1.0, seed=step), group=8)

This is the one rollout path of a run, whatever the placement. A worker hosts thousands of
loops as coroutines on its node's event loop and generates through a ``Router`` that prefers
the engines of its own node (``local``): a trajectory stays next to its engine, and the head
only sends rows and receives finished trajectories. The manager gives each unit of rows (one
prompt's GRPO group, kept together so the engine reuses its prefix) to the worker with the
fewest rows outstanding, in one call per worker; a worker whose node dies has its units run
again on the others, so no row is lost. Trajectory ids (hence sampling seeds) are the rows'
``uid``: a row samples the same tokens wherever it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from ..config.agent import AgentConfig
from ..config.engine import RouterConfig
from ..engines.router import Router
from ..engines.types import SamplingParams
from ..envs.base import Environment
from ..rewards import RewardOutput
from ..runtime import Actor, ActorRef, endpoint
from ..runtime.stall import off_loop
from .base import AgentLoop, Interaction, RewardFn, get_loop, registered_reward
from .interactions import RowInteractions, conversation_score
from .loops import LoopState, ResumableLoop
from .telemetry import LoopCounters
from .trajectory import Trajectory, TrajectoryMetrics

log = logging.getLogger(__name__)


class AgentWorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What an ``AgentLoopWorker`` is built from (it travels to the worker's node)."""

    model: str
    """The model folder whose tokenizer and chat template the loops use."""
    engines: list[Any] = []
    """``EngineActor`` refs to generate with (through a router)."""
    local: list[str] = []
    """Names of the engines on the worker's own node: its router uses them while any is in
    rotation, the others only after that (empty: all alike)."""
    agent: AgentConfig = AgentConfig()
    router: RouterConfig = RouterConfig()
    source: str | dict[str, Any] = ""
    """The run's environment (``rlasync.envs``: ``data.source``, or the ``files`` or ``synthetic``
    one the run made of its data, ``rlasync.compose.feed.environment_source``), built here from
    its options and ``seed``: its ``score`` is the reward, its ``interaction`` the user's turns.
    "": none (reward 0, unless the worker is given a ``reward_fn``)."""
    seed: int = 0
    """The environment's seed unless its options give one (``train.seed``)."""


class AgentLoopWorker(Actor):
    """Runs agent loops on its node. In this process it also takes a ready ``engine`` (an engine
    or a router), ``tokenizer`` and ``reward_fn`` instead of building them from the spec."""

    def __init__(
        self,
        spec: AgentWorkerSpec | dict[str, Any],
        *,
        engine: Any = None,
        tokenizer: Any = None,
        reward_fn: RewardFn | None = None,
    ) -> None:
        self.spec = msgspec.convert(spec, AgentWorkerSpec) if isinstance(spec, dict) else spec
        self._engine = engine
        self.tokenizer = tokenizer
        self._reward_fn = reward_fn
        self._interactions: RowInteractions | None = None  # the config's and rows' simulated users
        self._environment: Any = None  # the run's environment, built and opened on start (rlasync.envs)
        self._scores_groups = False  # whether it has group rewards (Environment.score_group) to ask for
        self._mcp: Any = None  # agent.mcp_servers, started (rlasync.tools.mcp.MCPServers)
        self.rolled_out = 0
        self._loops: dict[str, AgentLoop] = {}  # trajectory id -> its loop, while its call runs
        self.counters = LoopCounters()  # what finished trajectories did (rlasync_agent_* on /metrics)
        self._unexport: Callable[[], None] | None = None
        # What loop classes share on this worker (AgentLoop.shared_resource), opened on first use.
        self._shared: dict[type[AgentLoop], Any] = {}
        self._shared_stack = contextlib.AsyncExitStack()
        self._shared_lock = asyncio.Lock()

    async def on_start(self) -> None:
        from ..tools.tool_config import build_agent_tools

        if self.tokenizer is None:
            from ..models.tiny import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.spec.model)
        self.tools = build_agent_tools(self.spec.agent.tools, self.spec.agent.tool_config)
        if self.spec.agent.mcp_servers:  # their tools beside agent.tools; the servers stop with this worker
            from ..tools.mcp import MCPServers

            self._mcp = MCPServers(self.spec.agent.mcp_servers)
            await self._mcp.__aenter__()
            self.tools = {**self._mcp.tools, **self.tools}  # a clash is refused at start-up (the run's check)
        self.counters.offer(self.tools)
        if self._engine is None:
            if not self.spec.engines:
                raise ValueError("AgentLoopWorker needs engines: AgentWorkerSpec(engines=[engine refs])")
            self._engine = Router(self.spec.engines, self.spec.router, prefer=self.spec.local)
        if self.spec.source:  # may import a package, load a dataset: off the loop
            from ..envs import make_environment

            self._environment = await off_loop(
                functools.partial(make_environment, self.spec.source, seed=self.spec.seed)
            )
            await self._environment.open()
            self._scores_groups = type(self._environment).score_group is not Environment.score_group
        if self._reward_fn is None:
            self._reward_fn = self._spec_reward()
        self._interactions = RowInteractions(self.spec.agent.interaction, conversation_score(self._reward_fn))
        if self.node.metrics is not None:
            self._unexport = self.node.metrics.add(self._metric_families)

    def _spec_reward(self) -> RewardFn | None:
        """The environment's score as the loops' reward (none without an environment)."""
        environment = self._environment
        if environment is None:
            return None
        return registered_reward(environment.score, timeout_s=environment.score_timeout_s)

    def _metric_families(self) -> list[Any]:
        from ..engines.telemetry import router_families

        families = self.counters.families(self.name)
        if isinstance(self._engine, Router):
            families += router_families(self.name, self._engine.stats())
        for resource in self._shared.values():  # what the loops share may count too (the endpoint)
            if hasattr(resource, "metric_families"):
                families += resource.metric_families(worker=self.name)
        return families

    async def on_stop(self) -> None:
        if self._unexport is not None:
            self._unexport()
        if isinstance(self._engine, Router):
            # Its load poll first: a node stopping has left the cluster by now (Node.stop), so
            # other nodes refuse its calls, and a poll refused while the endpoint below takes
            # its second to stop read as a lost engine. Requests in flight still finish.
            await self._engine.close()
        await self._shared_stack.aclose()
        if self._mcp is not None:
            await self._mcp.close()
        if self._environment is not None:
            await self._environment.close()

    @endpoint
    async def generate(
        self,
        rows: list[dict[str, Any]],
        params: SamplingParams,
        states: dict[str, LoopState] | None = None,
        group: int = 1,
    ) -> list[Trajectory]:
        """One trajectory per row, in order; rows pick their loop with ``agent_name``, and their
        ``uid`` is the trajectory's id. ``states``: trajectories to go on with (uid -> the
        ``LoopState`` a checkpoint saved, see ``loop_states``); the other rows start afresh.
        ``group``: every that many consecutive rows are one prompt's group, which the run's
        environment may score together (``Environment.score_group``)."""
        await self._open_shared({self._loop_class(row) for row in rows})
        loops = [self._loop(row, (states or {}).get(str(row.get("uid") or ""))) for row in rows]
        for loop in loops:
            self._loops[loop.trajectory_id] = loop
        try:
            trajectories = list(
                await asyncio.gather(*[self._run(loop, row, params) for loop, row in zip(loops, rows)])
            )
        finally:
            for loop in loops:
                self._loops.pop(loop.trajectory_id, None)
        if self._scores_groups:  # the groups at once (a group reward may call a judge)
            size = max(1, group)
            uids = [loop.trajectory_id for loop in loops]
            spans = range(0, len(trajectories), size)
            await asyncio.gather(
                *[self._score_group(uids[i : i + size], trajectories[i : i + size]) for i in spans]
            )
        for trajectory in trajectories:
            self.counters.observe(trajectory)
        return trajectories

    async def _score_group(self, uids: list[str], trajectories: list[Trajectory]) -> None:
        """The environment's group rewards (``Environment.score_group``) in place of the ones
        the trajectories ``uids`` got alone; a failure is each one's reward error, and a 0."""
        assert self._environment is not None
        try:
            scored = await self._environment.score_group(uids)
        except Exception as exc:  # noqa: BLE001  (a reward's failure is recorded, never a lost batch)
            log.warning("the environment's group reward failed: %s", exc, exc_info=True)
            scored = {uid: RewardOutput(score=0.0, metrics={"error": repr(exc)}) for uid in uids}
        for uid, trajectory in zip(uids, trajectories):
            out = scored.get(uid)
            if out is None:
                continue
            trajectory.reward = float(out.score)
            if "error" in out.metrics:
                trajectory.metrics.reward_error = str(out.metrics["error"])
            for sample in trajectory.samples:
                sample.reward = trajectory.reward

    @endpoint
    async def loop_states(self, uids: list[str]) -> bytes:
        """The states of these trajectories in progress here (msgpack of uid -> ``LoopState``),
        encoded at once: one instant's. A trajectory not running here (not started yet, or its
        call already answered) or whose loop keeps no ``LoopState`` is left out; resumed, it
        starts again."""
        running = {
            uid: loop.state
            for uid in uids
            if isinstance(loop := self._loops.get(uid), ResumableLoop) and hasattr(loop, "state")
        }
        return msgspec.msgpack.encode(running)

    def _loop_class(self, row: dict[str, Any]) -> type[AgentLoop]:
        return get_loop(str(row.get("agent_name") or self.spec.agent.default_loop))

    async def _open_shared(self, classes: set[type[AgentLoop]]) -> None:
        async with self._shared_lock:
            for cls in classes - self._shared.keys():
                resource = cls.shared_resource(self._engine, self.tokenizer, self.spec.agent)
                self._shared[cls] = (
                    None if resource is None else await self._shared_stack.enter_async_context(resource)
                )

    def _loop(self, row: dict[str, Any], state: LoopState | None) -> AgentLoop:
        cls = self._loop_class(row)
        trajectory_id = str(row.get("uid") or uuid.uuid4().hex)
        loop = cls(
            self._engine,
            self.tokenizer,
            self.spec.agent,
            tools=self.tools,
            reward_fn=self._reward_fn,
            interaction=self._interaction_for(row),
            trajectory_id=trajectory_id,
        )
        loop.shared = self._shared.get(cls)
        loop.environment = self._environment
        if state is not None and isinstance(loop, ResumableLoop):
            loop.resume_from(state, row)
        return loop

    def _interaction_for(self, row: dict[str, Any]) -> Interaction | None:
        """The trajectory's environment turns: the environment's own for this row, else the
        row's ``interaction_kwargs.name`` or ``agent.interaction`` (``RowInteractions``)."""
        if self._environment is not None and (own := self._environment.interaction(row)) is not None:
            return own
        return self._interactions.for_row(row) if self._interactions is not None else None

    async def _run(self, loop: AgentLoop, row: dict[str, Any], params: SamplingParams) -> Trajectory:
        try:
            trajectory = await loop.run(params, **row)
        except (Exception, SystemExit) as exc:  # one trajectory's failure ends it, never its batch
            trajectory = failed_trajectory(loop, row, exc)
        self.rolled_out += 1
        return trajectory

    @endpoint
    async def remove_engine(self, name: str) -> None:
        """Send no more requests to engine ``name`` (it left rotation)."""
        if isinstance(self._engine, Router):
            self._engine.remove_engine(name)

    @endpoint
    async def add_engine(self, engine: ActorRef) -> None:
        """Send requests to ``engine`` too (it entered rotation)."""
        if isinstance(self._engine, Router) and engine.name not in {ref.name for ref in self._engine.engines}:
            self._engine.add_engine(engine)


def failed_trajectory(loop: AgentLoop, row: dict[str, Any], exc: BaseException) -> Trajectory:
    """The trajectory a loop that raised leaves: what its state holds (the turns it finished),
    termination ``error`` with the exception in ``metrics.error``, reward 0. Said in the log once
    per loop and exception type, with its traceback: it is a bug (of a loop, a tool or a
    template), and may hit thousands of trajectories."""
    error = f"{type(exc).__name__}: {exc}"[:1000]
    key = (type(loop), type(exc))
    if key not in _reported:
        _reported.add(key)
        log.warning(
            "agent loop %s raised on trajectory %s (it ends with termination 'error'; further %s of this loop are not logged)",
            type(loop).__name__,
            loop.trajectory_id,
            type(exc).__name__,
            exc_info=exc,
        )
    if (
        isinstance(loop, ResumableLoop)
        and isinstance(getattr(loop, "state", None), LoopState)
        and loop.state.prompt_ids
    ):
        loop.state.termination, loop.state.metrics.error = "error", error
        return loop.trajectory()
    try:  # it failed before it had a state: the prompt alone
        prompt_ids = loop.turns.prompt_ids(list(row.get("messages") or []))
    except Exception:  # noqa: BLE001  (the row itself may be what failed)
        prompt_ids = []
    return Trajectory(
        prompt_ids=prompt_ids,
        response_ids=[],
        response_mask=[],
        logprobs=[],
        versions=[],
        reward=0.0,
        num_turns=1,
        termination="error",
        metrics=TrajectoryMetrics(error=error),
        messages=list(row.get("messages") or []),
    )


_reported: set[tuple[type, type]] = set()  # (loop class, exception type) already logged
