"""What the weight sync's parts are to each other: the sending side (``WeightSource``: the
trainer), an engine's receiving side (``WeightSink``), what a schedule asks (``WeightSync``),
where engines serve (``Rotation``: the router) and what a sync reports (``SyncReport``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import msgspec

from .commit import Commit, Interrupt
from .protocol import GroupAddress


class WeightSource(Protocol):
    """The sending side of a sync (``TrainerActor``): the plan, the shared memory it offers
    engines on its machine, the group's store and backend, and each version's send."""

    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes: ...
    async def share_weights(self, directory: str, plan: bytes, slots: int = 1, host: bool = False) -> Any: ...
    async def weight_backend(self) -> str: ...
    async def weight_store(self, host: str = "") -> tuple[str, int]: ...
    async def join_weights(self, address: GroupAddress, plan: bytes) -> None: ...
    async def drop_weights(self, peer: str) -> None: ...
    async def send_weights(self, version: int, peers: list[str] | None = None) -> float: ...
    async def relay_weights(self, version: int, peers: list[str] | None = None) -> None: ...


class WeightSink(Protocol):
    """One engine's receiving side of a sync, as the synchroniser drives it: ``attach`` once,
    ``join`` each group generation (broadcast engines), then per version ``stage`` and
    ``commit``. ``EngineWeights`` is one (an engine in this process); ``ActorSink`` is an
    ``EngineActor``'s on any node. A failed transfer raises ``SyncError`` (through an actor
    call: an ``ActorError`` carrying it, see ``is_transfer_failure``)."""

    async def attach(
        self,
        plan: bytes,
        offer: Any = None,
        *,
        double_buffer: bool = True,
        node_relay: str = "",
        slots: int = 2,
    ) -> str:
        """Take the bucket plan (once) and map the trainer's shared memory (``offer``) if it is
        on this machine; how this engine will receive versions: ``shm``, ``broadcast``, or
        ``node`` (copied from its node's relay, ``node_relay``, which another engine fills)."""
        ...

    async def join(self, address: GroupAddress, rank: int) -> None:
        """Become ``rank`` of the weight group's generation at ``address`` (the trainer, rank 0,
        hosts its store)."""
        ...

    async def stage(self, version: int, timeout_s: float) -> float:
        """Receive ``version`` into a staging copy while the engine decodes; seconds taken."""
        ...

    async def commit(
        self, version: int, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> Commit:
        """The engine takes the staged ``version`` whole, at its own step boundary; its running
        turns go on, are cut or finish first (``interrupt``, see ``weights.commit``)."""
        ...

    async def alive(self, within_s: float) -> bool:
        """Does the engine still answer (within ``within_s``)?"""
        ...

    def close(self) -> None:
        """Let go of the weight group and the shared memory, if held here."""
        ...


class WeightSync(Protocol):
    """What a schedule asks of the weight sync (``ParameterSynchronizer``, or the simulator's
    ``SimSync``): the trainer's current parameters served by every engine in rotation as
    ``version`` when it returns."""

    async def sync(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport: ...


class ReleasingSync(WeightSync, Protocol):
    """A weight sync that can release the trainer before the engines have a version
    (``ParameterSynchronizer`` with its relay: ``weights.max_live_versions`` >= 2)."""

    @property
    def can_release(self) -> bool: ...
    @property
    def engines(self) -> dict[str, int]: ...
    @property
    def served_listeners(self) -> list[Callable[[int], None]]: ...
    async def publish(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport: ...
    async def settle(self) -> None: ...


def releasing(sync: WeightSync) -> ReleasingSync | None:
    """``sync`` if it can release the trainer before delivery, else None."""
    return cast(ReleasingSync, sync) if getattr(sync, "can_release", False) else None


class Rotation(Protocol):
    """Where engines serve requests (the ``Router``): a failed engine leaves it, an added one
    enters it once it serves the current version."""

    def remove_engine(self, name: str) -> None: ...
    def add_engine(self, ref: Any) -> None: ...


class SyncReport(msgspec.Struct, kw_only=True):
    version: int
    bytes: int
    transfer_s: float
    """From the start of the sync until every engine had staged the version (they decoded
    meanwhile). ``publish``: the relay's copy plus the slowest pull of the versions the engines
    took since the previous publish."""
    pause_s: float
    """The longest stop of an engine to take it."""
    relay_s: float = 0.0
    """Seconds the trainer took to put the version in its relay (``publish``: all it waits for)."""
    engine_idle_s: float = 0.0
    """Decoding time the engines lost to this version, summed over them (``weights/engine_idle_s``)."""
    reprefill_tokens: int = 0
    """Tokens of the turns cut to take it, to be prefilled again (``weights/reprefill_tokens``)."""
    all_paused: bool = False
    """Was every engine paused at one instant? (Never, with two or more engines: they commit in waves.)"""
    attempts: int = 1
    engines: dict[str, int] = {}
    """Engine name -> the version it serves now (all equal ``version`` after ``sync``)."""
    expected: int | None = None
    """The version every engine should serve by now: ``version`` after ``sync``; after
    ``publish``, the one before (engines pull ``version`` from then on)."""
    transports: dict[str, str] = {}
    """Engine name -> how it received the version: ``shm`` or ``broadcast``."""
    removed: list[str] = []
    """Engines taken out of rotation during this sync."""
