"""The engines a ``ParameterSynchronizer`` drives: ``ActorSink``, an ``EngineActor``'s receiving
side through its ``weight_*`` endpoints, and ``Target``, one engine as the synchroniser keeps
track of it (its sink, how it receives versions, the version it serves)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..runtime import ActorRef
from .commit import Commit, Interrupt
from .protocol import GroupAddress
from .roles import WeightSink
from .sink import EngineWeights


class ActorSink:
    """An ``EngineActor``'s receiving side, on any node: its ``weight_*`` endpoints through
    ``ref``, each call under ``deadline_s``."""

    def __init__(self, ref: ActorRef, deadline_s: float) -> None:
        self.ref, self.deadline = ref, deadline_s

    async def attach(
        self,
        plan: bytes,
        offer: Any = None,
        *,
        double_buffer: bool = True,
        node_relay: str = "",
        slots: int = 2,
    ) -> str:
        attach = self.ref.weight_attach.options(timeout=self.deadline)
        return str(await attach(plan, offer, double_buffer, node_relay, slots))

    async def join(self, address: GroupAddress, rank: int) -> None:
        await self.ref.weight_join.options(timeout=self.deadline)(address, rank)

    async def stage(self, version: int, timeout_s: float) -> float:
        return float(await self.ref.weight_stage.options(timeout=self.deadline)(version, timeout_s))

    async def commit(
        self, version: int, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> Commit:
        # A drain may take its whole timeout before the swap: the call's deadline allows for it.
        deadline = self.deadline + (drain_timeout_s if interrupt == "drain" else 0.0)
        answer = await self.ref.weight_commit.options(timeout=deadline)(version, interrupt, drain_timeout_s)
        return msgspec.convert(answer, Commit)

    async def alive(self, within_s: float) -> bool:
        try:
            await self.ref.weight_version.options(timeout=within_s)()
        except Exception:
            return False
        return True

    def close(self) -> None:
        return None  # the actor lets go of its group and shared memory when it stops


class Target:
    """One engine as the synchroniser keeps track of it: its name, its ``WeightSink``, how it
    receives versions and the version it serves."""

    def __init__(self, engine: Any, index: int, call_deadline_s: float) -> None:
        self.remote = isinstance(engine, ActorRef)
        self.engine = engine
        self.name = engine.name if self.remote else str(getattr(engine, "name", None) or f"local-{index}")
        self.sink: WeightSink = ActorSink(engine, call_deadline_s) if self.remote else EngineWeights(engine)
        self.transport = "broadcast"
        self.version = -1
        self.joining = False  # added after start: enters rotation at its first commit
        self.grouped = False  # a member of the current weight group (broadcast engines)

    async def attach(self, plan: bytes, offer: Any, double_buffer: bool, node_relay: str, slots: int) -> None:
        self.transport = str(
            await self.sink.attach(
                plan, offer, double_buffer=double_buffer, node_relay=node_relay, slots=slots
            )
        )

    async def commit(self, version: int, interrupt: Interrupt, drain_timeout_s: float) -> Commit:
        commit = await self.sink.commit(version, interrupt, drain_timeout_s)
        self.version = version
        return commit
