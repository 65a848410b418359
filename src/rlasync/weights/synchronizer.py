"""``ParameterSynchronizer``: after each step, the trainer's parameters reach an engine.

    sync = ParameterSynchronizer(config.weights, trainer, engine)
    await sync.start()                    # plan exchanged once, weight group formed
    stats = await sync.sync(version=7)    # transfer while the engine decodes, then the swap

The sending side is anything with the trainer actor's four endpoints (``weight_plan``,
``join_weights``, ``send_weights``; rank 0 sends, other ranks help gather shards). The
receiving side runs here, in the engine's process: buckets stream into a staging copy while
the engine keeps decoding, and the engine pauses only to take the complete version
(``swap_weights`` when it has one: pointer swaps; else ``update_weights``). A version is taken
whole or not at all. A sync that fails (a peer died, or stalled past ``weights.timeout_s``)
drops the group, forms a new generation and tries again, ``weights.retries`` times, then
raises ``SyncError``; the engine keeps serving its last complete version meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, Protocol

import msgspec

from ..config.weights import WeightsConfig
from .buckets import BucketPlan
from .group import SyncError, WeightGroup
from .sync import WeightReceiver

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes: ...
    async def join_weights(self, host: str, port: int, size: int, timeout_s: float, generation: int, plan: bytes) -> None: ...
    async def send_weights(self, version: int) -> float: ...


class SyncReport(msgspec.Struct, kw_only=True):
    version: int
    bytes: int
    transfer_s: float
    """Staging the version here (the engine decoded meanwhile)."""
    pause_s: float
    """The engine's stop to take it."""
    attempts: int = 1


class ParameterSynchronizer:
    def __init__(self, config: WeightsConfig, source: WeightSource, engine: Any) -> None:
        self.config, self.source, self.engine = config, source, engine
        self.generation = -1
        self.plan: BucketPlan | None = None
        self._plan_bytes = b""
        self._port = 0
        self._group: WeightGroup | None = None
        self._receiver: WeightReceiver | None = None

    async def start(self) -> None:
        """Exchange the plan (once) and form the weight group."""
        cfg = self.config
        bucket = int(cfg.bucket_mb * (1 << 20))
        self._plan_bytes = await self.source.weight_plan(bucket, int(cfg.alone_mb * (1 << 20)) or bucket)
        self.plan = msgspec.msgpack.decode(self._plan_bytes, type=BucketPlan)
        self._port = _free_port(cfg.host)
        await self._join()

    async def _join(self) -> None:
        cfg = self.config
        store = self._group.store if self._group is not None else None
        if self._group is not None:
            self._group.close()
        self.generation += 1
        generation = self.generation

        def connect() -> WeightGroup:
            return WeightGroup(cfg.host, self._port, 1, 2, timeout_s=cfg.timeout_s, generation=generation, store=store)

        joined, group = await asyncio.gather(
            self.source.join_weights(cfg.host, self._port, 2, cfg.timeout_s, generation, self._plan_bytes), asyncio.to_thread(connect),
            return_exceptions=True,
        )  # fmt: skip
        for result in (joined, group):
            if isinstance(result, BaseException):
                if isinstance(group, WeightGroup):
                    group.close()
                raise result
        assert isinstance(group, WeightGroup) and self.plan is not None
        self._group, self._receiver = group, WeightReceiver(group, self.plan)

    async def sync(self, version: int) -> SyncReport:
        """Move the trainer's current parameters to the engine as ``version``."""
        if self._receiver is None or self.plan is None:
            raise RuntimeError("call start() first")
        attempts = 0
        while True:
            attempts += 1
            started = time.perf_counter()
            sent, received = await asyncio.gather(self.source.send_weights(version), asyncio.to_thread(self._receiver.receive), return_exceptions=True)
            transfer = time.perf_counter() - started
            error = next((r for r in (received, sent) if isinstance(r, BaseException)), None)
            if error is None:
                break
            if not _is_sync_failure(error) or attempts > self.config.retries:
                raise error
            log.warning("weight sync v%d failed (%s); forming generation %d and trying again", version, error, self.generation + 1)
            await self._join()
        got_version, staged = received  # type: ignore[misc]
        if got_version != version:
            raise SyncError(f"weight sync: sent version {version}, received {got_version}")
        swap = getattr(self.engine, "swap_weights", None)
        if swap is not None:
            pause = float(await swap(staged, version))
        else:
            began = time.perf_counter()
            await self.engine.update_weights(staged, version)
            pause = time.perf_counter() - began
        return SyncReport(version=version, bytes=self.plan.total_bytes, transfer_s=transfer, pause_s=pause, attempts=attempts)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def _is_sync_failure(error: BaseException) -> bool:
    # Locally a SyncError; from the trainer's rank, an ActorError whose remote type is SyncError.
    return isinstance(error, SyncError) or getattr(error, "remote_type", "") == "SyncError"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
