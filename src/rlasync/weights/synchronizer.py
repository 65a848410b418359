"""``ParameterSynchronizer``: after each step, the trainer's parameters reach every engine.

    sync = ParameterSynchronizer(config.weights, trainer, [engine_a, engine_b], router=router)
    await sync.start()                    # plan sent once, shared memory offered, group formed
    report = await sync.sync(version=7)   # every engine stages v7 while decoding, then all swap

The sending side is anything with the trainer actor's endpoints (``weight_plan``,
``share_weights``, ``weight_backend``, ``weight_store``, ``join_weights``, ``send_weights``; rank 0
sends, other ranks help gather shards), wherever rank 0 runs: it hosts the group's store on its
node, at the address the other nodes reach it by (``weights.host`` overrides it). The engines are ``EngineActor`` refs on any node, or engines in this process. An
engine on the trainer's machine copies each version from the trainer's shared memory
(``weights.transport``); the others are ranks of one torch.distributed group with rank 0 of
the trainer and take a bucketed broadcast.

A sync has two phases. *Stage*: every engine receives the version into a staging copy while
it keeps decoding. *Commit*: only once all have staged, each swaps it in (the only pause).
So from the caller's view the version bump is atomic: when ``sync`` returns, every engine in
rotation serves the new version, and an engine that could not take it is out of rotation
(removed from the ``router``), never left serving a silent mix.

Failures: every step has a deadline (``weights.timeout_s``). An engine that died or stalls
fails the attempt; it is probed, and one that does not answer is removed at once
(``weights.on_engine_failure="remove"``) or stops the run (``"stop"``). The rest form a new
group generation and the sync is tried again, up to ``weights.retries`` times for an engine
that answers but keeps failing. Engines keep serving their last complete version meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from ..config.weights import WeightsConfig
from ..runtime import ActorRef, NodeLostError
from .group import SyncError
from .sink import EngineWeights

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    async def weight_plan(self, bucket_bytes: int, alone_bytes: int) -> bytes: ...
    async def share_weights(self, directory: str, plan: bytes) -> Any: ...
    async def weight_backend(self) -> str: ...
    async def weight_store(self, host: str = "") -> tuple[str, int]: ...
    async def join_weights(
        self,
        host: str,
        port: int,
        size: int,
        timeout_s: float,
        generation: int,
        plan: bytes,
        backend: str = "",
    ) -> None: ...
    async def send_weights(self, version: int) -> float: ...


class Rotation(Protocol):
    """Where engines serve requests (the ``Router``): a failed engine leaves it, an added one
    enters it once it serves the current version."""

    def remove_engine(self, name: str) -> None: ...
    def add_engine(self, ref: Any) -> None: ...


class SyncReport(msgspec.Struct, kw_only=True):
    version: int
    bytes: int
    transfer_s: float
    """From the start of the sync until every engine had staged the version (they decoded meanwhile)."""
    pause_s: float
    """The longest stop of an engine to take it."""
    attempts: int = 1
    engines: dict[str, int] = {}
    """Engine name -> the version it serves now (all equal ``version``)."""
    transports: dict[str, str] = {}
    """Engine name -> how it received the version: ``shm`` or ``broadcast``."""
    removed: list[str] = []
    """Engines taken out of rotation during this sync."""


class _Sink:
    """One engine's receiving side as the synchroniser calls it: here, or an ``EngineActor``."""

    def __init__(self, engine: Any, index: int, call_deadline_s: float) -> None:
        self.remote = isinstance(engine, ActorRef)
        self.engine = engine
        self.name = engine.name if self.remote else str(getattr(engine, "name", None) or f"local-{index}")
        self.local = None if self.remote else EngineWeights(engine)
        self.deadline = call_deadline_s
        self.transport = "broadcast"
        self.version = -1
        self.joining = False  # added after start: enters rotation at its first commit

    def _call(self, endpoint: str, *args: Any, timeout: float | None = None) -> Any:
        if self.local is not None:
            return getattr(self.local, endpoint)(*args)
        return getattr(self.engine, f"weight_{endpoint}").options(timeout=timeout or self.deadline)(*args)

    async def attach(self, plan: bytes, offer: Any, double_buffer: bool) -> None:
        if self.local is not None:
            self.transport = await self.local.attach(plan, offer, double_buffer=double_buffer)
        else:
            self.transport = str(await self._call("attach", plan, offer, double_buffer))

    async def join(self, *args: Any) -> None:
        await self._call("join", *args)

    async def stage(self, version: int, timeout_s: float) -> float:
        return float(await self._call("stage", version, timeout_s))

    async def commit(self, version: int) -> float:
        pause = float(await self._call("commit", version))
        self.version = version
        return pause

    async def alive(self, within_s: float) -> bool:
        """Does the engine still answer (within ``within_s``)?"""
        if self.local is not None:
            return True
        try:
            await self.engine.weight_version.options(timeout=within_s)()
        except Exception:
            return False
        return True

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


class ParameterSynchronizer:
    def __init__(
        self, config: WeightsConfig, source: WeightSource, engines: Any, *, router: Rotation | None = None
    ) -> None:
        self.config, self.source, self.router = config, source, router
        listed: Iterable[Any] = engines if isinstance(engines, (list, tuple)) else [engines]
        # A remote call may take the collective's deadline plus a little to answer: a stalled
        # engine is then an error soon after the trainer's side gave up on it.
        self._sinks = [_Sink(engine, i, config.timeout_s + 5.0) for i, engine in enumerate(listed)]
        if not self._sinks:
            raise ValueError("ParameterSynchronizer needs at least one engine")
        names = [sink.name for sink in self._sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"engines need distinct names, got {names}")
        self.generation = -1
        self.backend = "gloo"
        self.plan_bytes = b""
        self.total_bytes = 0
        self._address: tuple[str, int] = ("", 0)
        self._started = False
        self._offer: Any = None
        self._regroup = False  # an engine was added: the next sync forms a new generation first
        self.removed: list[str] = []

    @property
    def engines(self) -> dict[str, int]:
        """Engines in rotation -> the version each serves (as of its last commit)."""
        return {sink.name: sink.version for sink in self._sinks}

    async def start(self) -> None:
        """Send the plan (once), offer shared memory to the engines on the trainer's machine,
        and form the weight group of the others."""
        from .buckets import BucketPlan

        cfg = self.config
        bucket = int(cfg.bucket_mb * (1 << 20))
        self.plan_bytes = await self.source.weight_plan(bucket, int(cfg.alone_mb * (1 << 20)) or bucket)
        self.total_bytes = msgspec.msgpack.decode(self.plan_bytes, type=BucketPlan).total_bytes
        self.backend = cfg.backend if cfg.backend != "auto" else await self.source.weight_backend()
        offer = (
            await self.source.share_weights(cfg.shm_dir, self.plan_bytes)
            if cfg.transport != "broadcast"
            else None
        )
        self._offer = offer
        await asyncio.gather(
            *[sink.attach(self.plan_bytes, offer, cfg.double_buffer) for sink in self._sinks]
        )
        if cfg.transport == "shm":
            far = [sink.name for sink in self._sinks if sink.transport != "shm"]
            if far:
                raise SyncError(
                    f"weights.transport=shm, but engine(s) {far} cannot map the trainer's shared memory in "
                    f"weights.shm_dir={cfg.shm_dir} (another machine or container); use weights.transport=auto"
                )
        # Rank 0 hosts the group's store on its node, wherever that is: the engines connect there.
        self._address = await self.source.weight_store(cfg.host)
        self._started = True
        await self._join()

    async def _join(self) -> None:
        """Form a new generation of the group: trainer rank 0 and every broadcast engine. An
        engine that fails to join is handled like one that fails a sync."""
        cfg = self.config
        while True:
            self.generation += 1
            far = [sink for sink in self._sinks if sink.transport == "broadcast"]
            size = len(far) + 1
            host, port = self._address
            results = await asyncio.gather(
                self.source.join_weights(
                    host, port, size, cfg.timeout_s, self.generation, self.plan_bytes, self.backend
                ),
                *[
                    sink.join(host, port, rank, size, cfg.timeout_s, self.generation, self.backend)
                    for rank, sink in enumerate(far, 1)
                ],
                return_exceptions=True,
            )
            failed = {sink: r for sink, r in zip(far, results[1:]) if isinstance(r, BaseException)}
            if not failed and not isinstance(results[0], BaseException):
                return
            _raise_if_trainer_lost(results[0])  # then the engines failed waiting for it: not theirs
            if not failed:
                raise results[0]  # type: ignore[misc]  # the trainer could not form it
            await self._drop(failed, "joining the weight group", always=True)

    async def add_engine(self, engine: Any) -> None:
        """Bring a new (or restarted) engine in: it gets the plan now and the next sync's
        version, and enters the ``router`` only once it serves that version."""
        if not self._started:
            raise RuntimeError("call start() first")
        sink = _Sink(engine, len(self._sinks) + len(self.removed), self.config.timeout_s + 5.0)
        if sink.name in {s.name for s in self._sinks}:
            raise ValueError(f"engine {sink.name!r} is already synchronised")
        await sink.attach(self.plan_bytes, self._offer, self.config.double_buffer)
        if self.config.transport == "shm" and sink.transport != "shm":
            raise SyncError(
                f"weights.transport=shm, but engine {sink.name!r} cannot map the trainer's shared memory; use weights.transport=auto"
            )
        sink.joining = True
        self._sinks.append(sink)
        self._regroup = sink.transport == "broadcast" or self._regroup

    async def sync(self, version: int) -> SyncReport:
        """Move the trainer's current parameters to every engine in rotation as ``version``."""
        if not self._started:
            raise RuntimeError("call start() first")
        if self._regroup:
            self._regroup = False
            await self._join()
        removed_before = len(self.removed)
        attempts, sender_failures = 0, 0
        failures: dict[_Sink, int] = {}
        started = time.perf_counter()
        while True:
            attempts += 1
            sinks = list(self._sinks)
            results = await _unless_sender_lost(
                self.source.send_weights(version),
                [sink.stage(version, self.config.timeout_s) for sink in sinks],
            )
            failed = {sink: r for sink, r in zip(sinks, results[1:]) if isinstance(r, BaseException)}
            sent = results[0]
            if not failed and not isinstance(sent, BaseException):
                break
            for error in [sent, *failed.values()]:
                if isinstance(error, BaseException) and not _is_sync_failure(error):
                    raise error  # a bug or a bad config, not a transfer failure: retrying cannot help
            if failed:
                for sink in failed:
                    failures[sink] = failures.get(sink, 0) + 1
                await self._drop(failed, f"staging version {version}", always=False, failures=failures)
            else:
                sender_failures += 1
                if sender_failures > self.config.retries:
                    raise sent  # type: ignore[misc]
            log.warning(
                "weight sync v%d failed (attempt %d); forming generation %d and trying again",
                version,
                attempts,
                self.generation + 1,
            )
            await self._join()
        transfer = time.perf_counter() - started
        sinks = list(self._sinks)
        pauses = await asyncio.gather(*[sink.commit(version) for sink in sinks], return_exceptions=True)
        failed = {sink: p for sink, p in zip(sinks, pauses) if isinstance(p, BaseException)}
        if failed:  # staged but could not switch: out of rotation (it serves its old version)
            await self._drop(failed, f"committing version {version}", always=True)
        for sink in self._sinks:
            if sink.joining:  # serves the current version now: into rotation
                sink.joining = False
                if self.router is not None and sink.remote:
                    self.router.add_engine(sink.engine)
        return SyncReport(
            version=version,
            bytes=self.total_bytes,
            transfer_s=transfer,
            attempts=attempts,
            pause_s=max((p for p in pauses if isinstance(p, float)), default=0.0),
            engines=self.engines,
            transports={sink.name: sink.transport for sink in self._sinks},
            removed=self.removed[removed_before:],
        )

    async def _drop(
        self,
        failed: dict[_Sink, BaseException],
        during: str,
        *,
        always: bool,
        failures: dict[_Sink, int] | None = None,
    ) -> None:
        """Take failed engines out: those that no longer answer, those past ``weights.retries``
        failures, or all of them (``always``). ``on_engine_failure="stop"`` raises instead."""
        answers = await asyncio.gather(*[sink.alive(min(5.0, self.config.timeout_s)) for sink in failed])
        dead = [sink for sink, ok in zip(failed, answers) if not ok]
        if always:
            out = list(failed)
        elif dead:
            out = dead  # the others most likely failed because of them: not counted against them
            for sink in failed:
                if failures is not None and sink not in dead:
                    failures[sink] -= 1
        else:
            out = [sink for sink in failed if failures is not None and failures[sink] > self.config.retries]
        if not out:
            return
        reasons = "; ".join(
            f"{sink.name}: {str(failed[sink]).splitlines()[0][:200] if str(failed[sink]) else type(failed[sink]).__name__}"
            for sink in out
        )
        if self.config.on_engine_failure == "stop":
            raise SyncError(
                f"weight sync failed while {during} ({reasons}); weights.on_engine_failure=stop ends the run"
            ) from failed[out[0]]
        for sink in out:
            self._take_out(sink, f"it failed while {during}")
        if not self._sinks:
            raise SyncError(
                f"weight sync failed while {during} and no engine is left ({reasons})"
            ) from failed[out[0]]

    def _take_out(self, sink: _Sink, why: str) -> None:
        if sink not in self._sinks:  # taken out already (replaced while a sync was failing on it)
            return
        self._sinks.remove(sink)
        self.removed.append(sink.name)
        sink.close()
        if self.router is not None:
            self.router.remove_engine(sink.name)
        log.warning("engine %s is out of rotation: %s; it serves version %d", sink.name, why, sink.version)

    async def replace_engine(self, engine: Any) -> None:
        """A restarted engine (its node was lost and joined again) takes the place of the one of
        its name: that one leaves rotation now, if no sync has taken it out yet, and the new one
        joins as ``add_engine`` does (in rotation once it serves the next version)."""
        for sink in [s for s in self._sinks if s.name == engine.name]:
            self._take_out(sink, "its node was lost and a new process of it joined")
        await self.add_engine(engine)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


async def _unless_sender_lost(send: Any, stages: list[Any]) -> list[Any]:
    """Every result (or exception) of the send and the stages, as ``gather`` gives them; but if
    the sending side is lost, its error at once: the engines would only wait for it until
    their deadline (``weights.timeout_s``; their calls are cancelled)."""
    calls = [asyncio.ensure_future(call) for call in [send, *stages]]
    try:
        pending = set(calls)
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if calls[0].done() and not calls[0].cancelled():
                _raise_if_trainer_lost(calls[0].exception())
    finally:
        for call in calls:
            call.cancel()  # a no-op for those done
    return [call.exception() or call.result() for call in calls]


def _raise_if_trainer_lost(result: Any) -> None:
    """The sending side's node is lost (a trainer rank's ``RankLostError`` is one): no retry can
    help, and engines that failed meanwhile failed waiting for it, so none is taken out."""
    if isinstance(result, NodeLostError):
        raise result


def _is_sync_failure(error: BaseException) -> bool:
    """A failed transfer: locally a SyncError; from another process an ActorError whose remote
    type is SyncError; or the engine's node died or did not answer in time."""
    from ..runtime import ActorNotFound, CallTimeout, NodeLostError

    return isinstance(error, (SyncError, CallTimeout, NodeLostError, ActorNotFound, TimeoutError)) or str(
        getattr(error, "remote_type", "")
    ).rsplit(".", 1)[-1] in (
        "SyncError",
        "DistBackendError",
        "DistNetworkError",
    )
