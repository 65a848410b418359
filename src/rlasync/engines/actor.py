"""``EngineActor``: any engine, hosted on a node of the actor runtime and callable from every node.

    engine = await cluster.spawn(EngineActor, EngineConfig(model="runs/nano"), node=1, name="engine-0")
    out = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=ids))

Which engine it builds comes from the config's ``backend`` (``build_engine``, in
``engines.backends``). A request whose caller goes away (cancelled, timed out, its node lost)
is aborted in the engine, so no sequence keeps decoding for nobody.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..config.engine import EngineConfig, engine_settings
from ..runtime import Actor, endpoint
from ..weights.protocol import GroupAddress  # at import: weight_join's hint must resolve
from .backends import build_engine
from .protocol import Engine, EngineError, SleepingEngine
from .types import EngineStats, GenerateOutput, GenerateRequest, PauseMode, TokenChunk

if TYPE_CHECKING:
    from ..weights.sink import EngineWeights  # imported when first used: the weights layer sits below


class EngineActor(Actor):
    """Hosts one engine. Spawn it with an ``EngineConfig`` (built on the node), or, in this
    process, hand it a ready engine: ``node.spawn(EngineActor, engine=my_engine)``."""

    def __init__(
        self, config: EngineConfig | dict[str, Any] | None = None, *, engine: Engine | None = None
    ) -> None:
        if (config is None) == (engine is None):
            raise ValueError("EngineActor needs exactly one of `config` (an EngineConfig) or `engine`")
        # Arguments of a remote spawn arrive as plain data: rebuild the Struct (and check it).
        self.config = engine_settings(config) if isinstance(config, dict) else config
        self.engine: Engine | None = engine
        self._weights: EngineWeights | None = None  # on the first weight_attach
        self._pauses = 0  # pause() calls, and the seconds between each and its resume()
        self._paused_s = 0.0
        self._paused_at: float | None = None
        self._unexport: Callable[[], None] | None = None  # removes this engine from /metrics

    async def on_start(self) -> None:
        if self.engine is None:
            assert self.config is not None
            self.engine = await build_engine(self.config)
        if self.node.metrics is not None:
            self._unexport = self.node.metrics.add(self._metric_families)

    def _metric_families(self) -> list[Any]:
        from .telemetry import engine_families

        paused_s = self._paused_s
        if self._paused_at is not None:
            paused_s += time.monotonic() - self._paused_at
        return engine_families(self.name, self._engine().stats(), pauses=self._pauses, paused_s=paused_s)

    async def on_stop(self) -> None:
        if self._unexport is not None:
            self._unexport()
        if self._weights is not None:
            self._weights.close()
        if self.engine is not None:
            await self.engine.close()

    def _engine(self) -> Engine:
        assert self.engine is not None, "on_start builds the engine before any call is served"
        return self.engine

    @endpoint
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await self._engine().generate(request)
        return msgspec.structs.replace(out, engine=self.name)

    @endpoint
    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        stream = self._engine().generate_stream(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # the engine aborts an unfinished request

    @endpoint
    async def abort(self, request_id: str) -> bool:
        return await self._engine().abort(request_id)

    @endpoint
    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        if self._paused_at is None:
            self._pauses += 1
            self._paused_at = time.monotonic()
        outs = await self._engine().pause(mode, timeout)
        return [msgspec.structs.replace(out, engine=self.name) for out in outs]

    @endpoint
    async def resume(self) -> None:
        await self._engine().resume()
        if self._paused_at is not None:
            self._paused_s += time.monotonic() - self._paused_at
            self._paused_at = None

    @endpoint
    async def sleep(self, offload_weights: bool = False) -> EngineStats:
        """The engine sleeps (``SleepingEngine``): returns its stats once asleep."""
        engine = self._engine()
        if not isinstance(engine, SleepingEngine):
            raise EngineError(
                f"{type(engine).__name__} cannot sleep: cluster.colocate needs an engine that can"
            )
        await engine.sleep(offload_weights)
        return engine.stats()

    @endpoint
    async def wake_up(self) -> None:
        engine = self._engine()
        if isinstance(engine, SleepingEngine):
            await engine.wake_up()

    @endpoint
    async def update_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        await self._engine().update_weights(named_tensors, version)

    # -- the receiving side of rlasync.weights.ParameterSynchronizer (a WeightSink: ActorSink) ---
    @endpoint
    async def weight_attach(
        self, plan: bytes, offer: Any = None, double_buffer: bool = True, node_relay: str = "", slots: int = 2
    ) -> str:
        """Take the bucket plan (once) and map the trainer's shared memory if it is on this
        machine; returns how this engine will receive versions: ``shm``, ``broadcast``, or
        ``node`` (from the relay of this node, ``node_relay``, which its first engine fills)."""
        from ..weights.sink import EngineWeights  # the weights layer sits below the engines

        if self._weights is None:
            self._weights = EngineWeights(self._engine())
        return str(
            await self._weights.attach(
                plan, offer, double_buffer=double_buffer, node_relay=node_relay, slots=slots
            )
        )

    @endpoint
    async def weight_join(self, address: GroupAddress, rank: int) -> None:
        """Become ``rank`` of the weight group's generation at ``address``."""
        from ..runtime.address import host_of

        # Gloo listens at this node's address on the route to the group's store (trainer rank 0):
        # of the store's family, so an IPv6 node and IPv4 ones still form one group.
        await self._weights_side().join(
            address, rank, local_host=_towards(address.host) or host_of(self.node.address)
        )

    @endpoint
    async def weight_stage(self, version: int, timeout_s: float) -> float:
        return float(await self._weights_side().stage(version, timeout_s))

    @endpoint
    async def weight_commit(
        self, version: int, interrupt: str = "keep", drain_timeout_s: float = 120.0
    ) -> Any:
        """Take the staged ``version`` at the engine's own step (``weights.commit.take_version``)."""
        return await self._weights_side().commit(version, interrupt, drain_timeout_s)  # type: ignore[arg-type]

    def _weights_side(self) -> EngineWeights:
        if self._weights is None:
            from ..weights.errors import SyncError

            raise SyncError(
                f"engine {self.name}: weight_attach first (the synchroniser sends the plan before anything else)"
            )
        return self._weights

    @endpoint
    async def weight_version(self) -> int:
        return self._engine().weight_version

    @endpoint
    async def stats(self) -> EngineStats:
        return self._engine().stats()


def _towards(host: str) -> str:
    from ..runtime.address import source_address

    try:
        return source_address(host)
    except OSError:
        return ""
