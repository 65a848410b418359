"""Rolling out a batch: ``AgentLoopWorker`` actors run the loops, ``AgentLoopManager`` spreads rows.

    workers = [await cluster.spawn(AgentLoopWorker, AgentWorkerSpec(model="runs/nano", engines=[...]), node=n) for n in ...]
    manager = AgentLoopManager(workers)
    batch = await manager.generate(rows, SamplingParams(temperature=1.0, max_new_tokens=64, seed=step))

A worker hosts thousands of loops as coroutines on its node's event loop, all generating
through one ``Router`` over every engine. The manager splits a batch into one chunk per
worker; a worker whose node dies has its chunk run again on the others, so no row is lost.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Sequence

import msgspec

from ..config.agent import AgentConfig
from ..config.engine import RouterConfig
from ..engines.router import Router
from ..engines.types import SamplingParams
from ..runtime import Actor, ActorNotFound, ActorRef, NodeLostError, endpoint
from .base import RewardFn, get_loop, registered_reward
from .batch import RolloutBatch, collate
from .trajectory import Trajectory

log = logging.getLogger(__name__)


class AgentWorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What an ``AgentLoopWorker`` is built from (it travels to the worker's node)."""

    model: str
    """The model folder whose tokenizer and chat template the loops use."""
    engines: list[Any] = []
    """``EngineActor`` refs to generate with (through a router)."""
    agent: AgentConfig = AgentConfig()
    router: RouterConfig = RouterConfig()
    reward: str = ""
    """A reward from ``rlasync.rewards`` by name ("" for none: reward 0)."""
    ground_truth_key: str = "ground_truth"


class AgentLoopWorker(Actor):
    def __init__(self, spec: AgentWorkerSpec | dict[str, Any], *, engine: Any = None, reward_fn: RewardFn | None = None) -> None:
        self.spec = msgspec.convert(spec, AgentWorkerSpec) if isinstance(spec, dict) else spec
        self._engine = engine  # in this process, a ready engine or router instead of engine refs
        self._reward_fn = reward_fn
        self.rolled_out = 0

    async def on_start(self) -> None:
        from ..models.tiny import load_tokenizer
        from ..tools import build_tools

        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.spec.model)
        self.tools = build_tools(self.spec.agent.tools)
        if self._engine is None:
            if not self.spec.engines:
                raise ValueError("AgentLoopWorker needs engines: AgentWorkerSpec(engines=[engine refs])")
            self._engine = Router(self.spec.engines, self.spec.router)
        if self._reward_fn is None and self.spec.reward:
            self._reward_fn = registered_reward(self.spec.reward, ground_truth_key=self.spec.ground_truth_key)

    async def on_stop(self) -> None:
        if isinstance(self._engine, Router):
            await self._engine.close()

    @endpoint
    async def generate(self, rows: list[dict[str, Any]], params: SamplingParams) -> list[Trajectory]:
        """One trajectory per row, in order; rows pick their loop with ``agent_name``."""
        return list(await asyncio.gather(*[self._run(row, params) for row in rows]))

    async def _run(self, row: dict[str, Any], params: SamplingParams) -> Trajectory:
        cls = get_loop(str(row.get("agent_name") or self.spec.agent.default_loop))
        trajectory_id = str(row.get("uid") or uuid.uuid4().hex)
        loop = cls(self._engine, self.tokenizer, self.spec.agent, tools=self.tools, reward_fn=self._reward_fn, trajectory_id=trajectory_id)
        trajectory = await loop.run(params, **row)
        self.rolled_out += 1
        return trajectory


class AgentLoopManager:
    """Spreads a batch of rows over agent-loop workers on any nodes and collates the result."""

    def __init__(self, workers: Sequence[ActorRef], *, pad_token_id: int = 0, timeout_s: float = 3600.0) -> None:
        if not workers:
            raise ValueError("AgentLoopManager needs at least one AgentLoopWorker")
        self.workers = list(workers)
        self.pad_token_id = pad_token_id
        self.timeout_s = timeout_s

    async def generate(self, rows: Sequence[dict[str, Any]], params: SamplingParams) -> RolloutBatch:
        return collate(await self.trajectories(rows, params), self.pad_token_id)

    async def trajectories(self, rows: Sequence[dict[str, Any]], params: SamplingParams) -> list[Trajectory]:
        rows = [dict(row, uid=row.get("uid") or uuid.uuid4().hex) for row in rows]  # stable ids across retries
        results: list[Trajectory | None] = [None] * len(rows)
        pending = list(range(len(rows)))
        while pending:
            if not self.workers:
                raise RuntimeError(f"every agent-loop worker was lost; {len(pending)} rows were not rolled out")
            chunks = [pending[i :: len(self.workers)] for i in range(len(self.workers))]
            calls = [
                w.generate.options(timeout=self.timeout_s)([rows[i] for i in chunk], params) if chunk else _nothing()
                for w, chunk in zip(self.workers, chunks)
            ]
            replies = await asyncio.gather(*calls, return_exceptions=True)
            pending = []
            for worker, chunk, reply in zip(list(self.workers), chunks, replies):
                if isinstance(reply, (NodeLostError, ActorNotFound)):
                    log.warning("agent-loop worker %s was lost (%s); its %d rows run again elsewhere", worker.name, reply, len(chunk))
                    self.workers.remove(worker)
                    pending += chunk
                elif isinstance(reply, BaseException):
                    raise reply
                else:
                    for i, trajectory in zip(chunk, reply):
                        results[i] = trajectory
            pending.sort()
        return [t for t in results if t is not None]


async def _nothing() -> list[Trajectory]:
    return []
