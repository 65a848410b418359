"""A simulated cluster for the real schedules: simulated GPUs (``SimEngine``) behind the real
router and engine actors, a trainer whose step takes a modelled time, and a weight sync that
costs what a real one does (``SimSync``). The rollouter, queue, agent loops and controllers
are the real ones.

    cluster = SimCluster(clock, engines=16, trainer_gpus=16)
    result = await train_run(config, cluster)   # any train.mode, in simulated time

Used by ``benchmarks/modes_bench.py`` to compare the schedules at cluster scale on one machine,
and for planning (how many GPUs to give generation, which staleness bound).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from ..compose.fleet import make_fleet
from ..compose.result import TrainResult
from ..compose.run import Run
from ..config import ClusterConfig, Config
from ..engines import EngineGroup
from ..engines.sim import LatencyModel, LogNormalLengths, SimClock, SimEngine
from ..weights import SyncReport
from ..weights.commit import Commit, Interrupt, all_paused, in_waves, take_version
from .profiles import Phase, Profile, ToolCalls


class SimTrainer:
    """A trainer whose step takes ``update.seconds(tokens, rows, gpus)`` simulated seconds (by
    default ``tokens / (tokens_per_s_per_gpu * gpus)``) and whose log-prob pass ``logprob``'s
    (by default a third of that: a forward pass). ``logprobs_in_step``: every step recomputes the
    old log-probs first, as verl's colocated sync does (what a replay of its table needs)."""

    def __init__(
        self,
        clock: SimClock,
        gpus: int,
        *,
        tokens_per_s_per_gpu: float = 10_000.0,
        token_block: int = 16,
        update: Phase | None = None,
        logprob: Phase | None = None,
        logprobs_in_step: bool = False,
        prompt_tokens: int = 0,
    ) -> None:
        self.clock, self.gpus, self.token_block = clock, gpus, token_block
        self.update = update or Phase(gpu_s_per_token=1 / tokens_per_s_per_gpu)
        self.logprob = logprob or Phase(gpu_s_per_token=1 / (3 * tokens_per_s_per_gpu))
        self.logprobs_in_step, self.prompt_tokens = logprobs_in_step, prompt_tokens
        self.busy_s = 0.0
        self.tokens = 0

    def _tokens(self, batch: Any) -> int:
        # Response tokens stand for `token_block` real ones each; prompt tokens are real, and
        # each row's prompt is taken to hold at least `prompt_tokens` (a profile's length).
        prompts = batch.attention_mask.sum(-1) - batch.response_mask.sum(-1)
        return int(batch.response_mask.sum()) * self.token_block + int(
            prompts.clamp(min=self.prompt_tokens).sum()
        )

    async def _work(self, phases: list[Phase], tokens: int, rows: int) -> None:
        began = self.clock.now()
        await self.clock.sleep(sum(phase.seconds(tokens, rows, self.gpus) for phase in phases))
        self.busy_s += self.clock.now() - began

    async def step(self, batch: Any, *, temperature: float = 1.0) -> dict[str, float]:
        tokens = self._tokens(batch)
        phases = [self.logprob, self.update] if self.logprobs_in_step else [self.update]
        await self._work(phases, tokens, int(batch.response_mask.shape[0]))
        self.tokens += tokens
        return {"tokens": float(tokens), "loss": 0.0, "grad_norm": 0.0, "lr": 0.0}

    async def compute_logprobs(
        self, batch: Any, *, temperature: float = 1.0, reference: bool = False
    ) -> torch.Tensor:
        await self._work([self.logprob], self._tokens(batch), int(batch.response_mask.shape[0]))
        return torch.as_tensor(batch.logprobs, dtype=torch.float32).clone()

    async def close(self) -> None:
        return None


class SimSync:
    """The weight sync as ``ParameterSynchronizer`` runs it, in simulated time: the version's
    ``weight_bytes`` go through a relay of ``bandwidth`` bytes/s to every engine at once
    (``weight_bytes / bandwidth`` seconds) while they keep decoding (the stage); then each
    engine takes it as ``interrupt`` says (``weights.commit.take_version``: ``keep`` holds it
    for its swap, ``LatencyModel.swap_s``; ``abort`` cuts its turns, which pay their prefill
    again when re-submitted; ``drain`` lets them finish first), half the engines at a time
    (``in_waves``). The trainer waits for all of it, as it waits for the real sync; or, released
    (``publish``, what fully async uses as with the real relay), only for the version's copy into
    the relay (``weight_bytes / bandwidth`` again), while every engine pulls it (the same again)
    and takes it at its own step in the background.

    The report's seconds are the event loop's (``SimClock.wall``), as the schedules' own
    timings; its ``reprefill_tokens`` count the simulator's tokens (a response block is one)."""

    def __init__(
        self,
        clock: SimClock,
        engines: Sequence[SimEngine],
        *,
        weight_bytes: int = 16_000_000_000,
        bandwidth: float = 16e9,
    ) -> None:
        self.clock, self.gpus = clock, list(engines)
        self.weight_bytes, self.bandwidth = weight_bytes, bandwidth
        self.syncs = 0
        self.can_release = True
        self.served_listeners: list[Callable[[int], None]] = []
        self._served = {engine.name: 0 for engine in self.gpus}
        self._delivery: asyncio.Task[list[Commit]] | None = None
        self._taken: list[Commit] = []  # commits of the deliveries since the last publish

    @property
    def engines(self) -> dict[str, int]:
        """Engine name -> the version it serves."""
        return dict(self._served)

    async def sync(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport:
        transfer = self.weight_bytes / self.bandwidth
        commits = await self._deliver(version, interrupt, drain_timeout_s)
        return self._report(version, commits, transfer_s=transfer, expected=version)

    async def publish(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport:
        """The trainer waits for the version's copy into the relay; the engines pull it and take
        it in the background (a delivery still running is finished first: the relay's two slots)."""
        if self._delivery is not None:
            self._taken += await self._delivery
        fill = self.weight_bytes / self.bandwidth
        await self.clock.sleep(fill)
        previous = max(self._served.values())
        commits, self._taken = self._taken, []
        self._delivery = asyncio.ensure_future(self._deliver(version, interrupt, drain_timeout_s))
        return self._report(version, commits, transfer_s=fill, expected=previous, relay_s=fill)

    async def settle(self) -> None:
        if self._delivery is not None:
            self._taken += await self._delivery
            self._delivery = None

    async def _deliver(self, version: int, interrupt: Interrupt, drain_timeout_s: float) -> list[Commit]:
        await self.clock.sleep(self.weight_bytes / self.bandwidth)  # staged while every engine decodes

        async def commit(engine: SimEngine) -> Commit:
            began = self.clock.now()
            taken = await take_version(
                engine,
                lambda: engine.update_weights({}, version),
                version=version,
                interrupt=interrupt,
                drain_timeout_s=drain_timeout_s,
            )
            # take_version times the pause on the machine's clocks; here time is simulated.
            self._served[engine.name] = version
            return msgspec.structs.replace(taken, began=began, pause_s=self.clock.now() - began)

        results = await in_waves(self.gpus, commit)
        for result in results:
            if isinstance(result, BaseException):
                raise result  # a simulated engine does not fail a commit: a bug
        self.syncs += 1
        for listener in list(self.served_listeners):
            listener(min(self._served.values()))
        return [c for c in results if isinstance(c, Commit)]

    def _report(
        self, version: int, commits: list[Commit], *, transfer_s: float, expected: int, relay_s: float = 0.0
    ) -> SyncReport:
        return SyncReport(
            version=version,
            bytes=self.weight_bytes,
            transfer_s=self.clock.wall(transfer_s),
            relay_s=self.clock.wall(relay_s),
            pause_s=self.clock.wall(max((c.pause_s for c in commits), default=0.0)),
            engine_idle_s=self.clock.wall(sum(c.pause_s for c in commits)),
            reprefill_tokens=sum(c.reprefill_tokens for c in commits),
            all_paused=all_paused(commits, len(self.gpus)),
            engines=self.engines,
            expected=expected,
            transports={engine.name: "broadcast" for engine in self.gpus},
        )

    def close(self) -> None:
        return None


def sim_gpus(
    clock: SimClock,
    count: int,
    latency: LatencyModel | None,
    lengths: LogNormalLengths | None,
    *,
    token_block: int,
    prompt_tokens: int = 0,
) -> list[SimEngine]:
    """``count`` simulated GPUs named ``gpu0``..., sharing the turns' progress: a turn cut on one
    and re-submitted to another goes on to its end."""
    progress: dict[int, int] = {}
    return [
        SimEngine(
            clock,
            latency,
            lengths,
            token_block=token_block,
            name=f"gpu{i}",
            prompt_tokens=prompt_tokens,
            progress=progress,
        )
        for i in range(count)
    ]


class SimCluster:
    """``engines`` simulated GPUs, a simulated trainer of ``trainer_gpus`` GPUs and the modelled
    sync: the stand-ins ``make_fleet(simulated=...)`` composes like real parts (engine actors
    on the head behind the real router, an agent-loop worker beside them: ``compose.sim_fleet``).

    ``sync_s``: seconds the weights take through the relay (``weight_bytes`` of them: an 8B
    model in bf16; 1 s is a 16 GB/s relay); what each engine pays to take them is its
    ``latency``'s (``swap_s``, and the prefill of cut turns)."""

    def __init__(
        self,
        clock: SimClock,
        *,
        engines: int,
        trainer_gpus: int,
        latency: LatencyModel | None = None,
        lengths: LogNormalLengths | None = None,
        token_block: int = 16,
        tokens_per_s_per_gpu: float = 10_000.0,
        sync_s: float = 1.0,
        weight_bytes: int = 16_000_000_000,
        trainer: SimTrainer | None = None,
        prompt_tokens: int = 0,
        tools: ToolCalls | None = None,
    ) -> None:
        from ..models import build_tokenizer

        self.clock, self.tools, self.token_block = clock, tools, token_block
        self.engines = sim_gpus(
            clock, engines, latency, lengths, token_block=token_block, prompt_tokens=prompt_tokens
        )
        self.trainer = trainer or SimTrainer(
            clock, trainer_gpus, tokens_per_s_per_gpu=tokens_per_s_per_gpu, token_block=token_block
        )
        self.tokenizer = build_tokenizer()
        self.sync_s, self.weight_bytes = sync_s, weight_bytes

    @classmethod
    def of_profile(
        cls,
        clock: SimClock,
        profile: Profile,
        *,
        generation_gpus: int,
        trainer_gpus: int,
        token_block: int = 16,
        logprobs_in_step: bool = False,
    ) -> SimCluster:
        """A cluster on ``profile``'s physics: ``generation_gpus`` GPUs as engines of
        ``profile.engine_gpus`` each, a trainer of ``trainer_gpus``."""
        trainer = SimTrainer(
            clock,
            trainer_gpus,
            token_block=token_block,
            update=profile.update,
            logprob=profile.logprob,
            logprobs_in_step=logprobs_in_step,
            prompt_tokens=profile.prompt_tokens,
        )
        return cls(
            clock,
            engines=max(1, generation_gpus // profile.engine_gpus),
            trainer_gpus=trainer_gpus,
            latency=profile.latency(),
            lengths=profile.lengths,
            token_block=token_block,
            sync_s=profile.sync_s(),
            weight_bytes=int(profile.model.weight_bytes),
            trainer=trainer,
            prompt_tokens=profile.prompt_tokens,
            tools=profile.tools,
        )

    def synchronizer(self, engines: EngineGroup) -> SimSync:
        """The sync takes each version on the simulated GPUs themselves, in this process (as
        ``EngineWeights`` does on a local engine); the group behind the router is not needed."""
        bandwidth = self.weight_bytes / self.sync_s if self.sync_s > 0 else math.inf
        return SimSync(self.clock, self.engines, weight_bytes=self.weight_bytes, bandwidth=bandwidth)

    def generation_busy_s(self) -> float:
        return sum(gpu.busy_s for gpu in self.engines)


def simulated_config(
    config: Config, clock: SimClock | None = None, tools: ToolCalls | None = None, token_block: int = 1
) -> Config:
    """``config`` with the settings the simulation needs: every part on the head, no cap per
    engine (a simulated GPU queues what does not fit its batch itself), and deadlines in
    simulated hours. With turns moving (``router.rebalance_queued``, ``router.repack_below``),
    ``router.load_refresh_s`` is simulated seconds on ``clock`` (the router looks at the
    engines that often); otherwise it stays the loop's (rarely: each look asks every simulated
    engine). With ``tools`` (an agentic profile's) the trajectories are ``modes.sim_tools``'s:
    model turns between tool calls of drawn latency on ``clock``."""
    day = 36_000.0
    refresh = config.router.load_refresh_s
    if (config.router.repack_below or config.router.rebalance_queued) and clock is not None:
        refresh = clock.wall(refresh)
    return msgspec.structs.replace(
        config,
        cluster=ClusterConfig(engines=[0], agent_loops="head"),
        runtime=msgspec.structs.replace(config.runtime, call_timeout_s=day),
        router=msgspec.structs.replace(
            config.router,
            max_inflight_per_engine=0,
            request_timeout_s=day,
            queue_timeout_s=day,
            load_refresh_s=refresh,
        ),
        agent=msgspec.structs.replace(
            config.agent, rollout_timeout_s=day, **_tool_agent(tools, clock, token_block)
        ),
    )


def _tool_agent(tools: ToolCalls | None, clock: SimClock | None, token_block: int) -> dict[str, Any]:
    """``agent.*`` settings for simulated tool calls (``modes.sim_tools``); none without."""
    if tools is None:
        return {}
    from .sim_tools import LOOP, SimulatedCall

    scale = clock.scale if clock is not None else 1.0
    call = {"scale": scale, "token_block": token_block, **msgspec.structs.asdict(tools)}
    return {"default_loop": LOOP, "tools": {SimulatedCall.name: call}, "tool_config": ""}


async def train_run(
    config: Config, cluster: SimCluster, *, on_step: Callable[[dict[str, Any]], None] | None = None
) -> TrainResult:
    """Run ``config``'s schedule (``train.mode``) on the simulated cluster."""
    from . import train_fully_async, train_one_step_off, train_sync

    config = simulated_config(config, cluster.clock, cluster.tools, cluster.token_block)
    run = await Run.open(config, fleet=make_fleet(simulated=cluster))
    schedule = {"sync": train_sync, "one_step_off": train_one_step_off, "fully_async": train_fully_async}[
        config.train.mode
    ]
    return await schedule(config, on_step=on_step, run=run)


__all__ = ["SimCluster", "sim_gpus", "SimSync", "SimTrainer", "simulated_config", "train_run"]
