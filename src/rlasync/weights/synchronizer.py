"""``ParameterSynchronizer``: after each step, the trainer's parameters reach every engine.

    sync = ParameterSynchronizer(config.weights, trainer, [engine_a, engine_b], router=router)
    await sync.start()                    # plan sent once, the relay offered, groups formed
    report = await sync.sync(version=7)   # every engine stages v7 while decoding, then takes it
    report = await sync.publish(8)        # or: v8 in the relay, the trainer goes on; each engine
                                          # pulls it at its own pace (``rlasync.weights.release``)

The sending side is a ``WeightSource`` (the trainer actor: rank 0 sends, other ranks help
gather shards), wherever rank 0 runs: it hosts the group's store on its node, at the address
the other nodes reach it by (``weights.host`` overrides it). The engines are ``EngineActor``
refs on any node, or engines in this process; each one's receiving side is a ``WeightSink``
(``ActorSink``: the actor's ``weight_*`` endpoints; ``EngineWeights``: an engine here). An
engine on the trainer's machine copies each version from the trainer's relay in shared memory
(``weights.transport``, ``weights.max_live_versions``); each of the others forms a pair group
with rank 0 over gloo (``weights.fanout``: a lost engine stalls only its own transfer), or all
of them one group over NCCL, and takes a bucketed broadcast.

A sync has two phases. *Stage*: every engine receives the version into a staging copy while
it keeps decoding. *Commit*: only once all have staged, each takes it at its own decode-step
boundary (``weights.commit.take_version``: running turns go on with their cache, are cut, or
finish first, as ``interrupt`` says), half the engines at a time, so never all at once.
So from the caller's view the version bump is atomic: when ``sync`` returns, every engine in
rotation serves the new version, and an engine that could not take it is out of rotation
(removed from the ``router``), never left serving a silent mix.

Failures: every step has a deadline (``weights.timeout_s``). An engine that died or stalls
fails the attempt (``SyncError``, or its call's runtime error: ``is_transfer_failure``; any
other error is a bug and is raised); it is probed, and one that does not answer is removed at once
(``weights.on_engine_failure="remove"``) or stops the run (``"stop"``). Those that failed and
answer form new pair groups (a new generation) and are sent the version again, up to
``weights.retries`` times; the others have it already. Engines keep serving their last
complete version meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec

from ..config.weights import WeightsConfig
from ..runtime import NodeLostError
from ..runtime.errors import first_line
from .commit import Commit, Interrupt, all_paused, in_waves
from .errors import SyncError, is_transfer_failure
from .protocol import GroupAddress
from .release import ReleasedDelivery
from .roles import Rotation, SyncReport, WeightSource
from .targets import Target

log = logging.getLogger(__name__)


class ParameterSynchronizer(ReleasedDelivery):
    def __init__(
        self, config: WeightsConfig, source: WeightSource, engines: Any, *, router: Rotation | None = None
    ) -> None:
        self.config, self.source, self.router = config, source, router
        listed: Iterable[Any] = engines if isinstance(engines, (list, tuple)) else [engines]
        # A remote call may take the collective's deadline plus a little to answer: a stalled
        # engine is then an error soon after the trainer's side gave up on it.
        self._targets = [Target(engine, i, config.timeout_s + 5.0) for i, engine in enumerate(listed)]
        if not self._targets:
            raise ValueError("ParameterSynchronizer needs at least one engine")
        names = [target.name for target in self._targets]
        if len(set(names)) != len(names):
            raise ValueError(f"engines need distinct names, got {names}")
        self.generation = -1
        self.backend = "gloo"
        self.plan_bytes = b""
        self.total_bytes = 0
        self._store: tuple[str, int] = ("", 0)  # the group's rendezvous store: rank 0's node
        self._started = False
        self._offer: Any = None
        self.relayed = False  # the trainer holds each version in a relay slot (weights.max_live_versions)
        self._regroup = False  # an engine was added: the next sync forms a new generation first
        self.removed: list[str] = []
        self._node_key = uuid.uuid4().hex  # names this synchroniser's relay in each node's process
        self._init_release()

    @property
    def engines(self) -> dict[str, int]:
        """Engines in rotation -> the version each serves (as of its last commit)."""
        return {target.name: target.version for target in self._targets}

    async def start(self) -> None:
        """Send the plan (once), offer shared memory to the engines on the trainer's machine,
        and form the weight group of the others."""
        from .buckets import BucketPlan

        cfg = self.config
        bucket = int(cfg.bucket_mb * (1 << 20))
        self.plan_bytes = await self.source.weight_plan(bucket, int(cfg.alone_mb * (1 << 20)) or bucket)
        self.total_bytes = msgspec.msgpack.decode(self.plan_bytes, type=BucketPlan).total_bytes
        self.backend = cfg.backend if cfg.backend != "auto" else await self.source.weight_backend()
        # The trainer's relay (several versions, snapshots) is made whatever the transport, so
        # every send is from a snapshot; its file is offered only to engines allowed to map it.
        slots = cfg.max_live_versions
        shared = (
            await self.source.share_weights(cfg.shm_dir, self.plan_bytes, slots, cfg.transport == "shm")
            if cfg.transport != "broadcast" or slots > 1
            else None
        )
        self.relayed = shared is not None and slots > 1
        offer = shared if cfg.transport != "broadcast" else None
        self._offer = offer
        await asyncio.gather(*[self._attach(target) for target in self._targets])
        if cfg.transport == "shm":
            far = [target.name for target in self._targets if target.transport != "shm"]
            if far:
                raise SyncError(
                    f"weights.transport=shm, but engine(s) {far} cannot map the trainer's shared memory in "
                    f"weights.shm_dir={cfg.shm_dir} (another machine or container); use weights.transport=auto"
                )
        # Rank 0 hosts the group's store on its node, wherever that is: the engines connect there.
        self._store = await self.source.weight_store(cfg.host)
        self._started = True
        await self._join()
        log.info(
            "weights: %s",
            ", ".join(f"{t.name} by {t.transport}" for t in self._targets),  # node: from its node's relay
        )

    async def _attach(self, target: Target) -> None:
        cfg = self.config
        await target.attach(
            self.plan_bytes,
            self._offer,
            cfg.double_buffer,
            self._node_key if cfg.node_relay else "",
            cfg.max_live_versions,
        )

    @property
    def _pairs(self) -> bool:
        """A pair group per broadcast engine (gloo), rather than one group of all (NCCL)."""
        return self.backend != "nccl"

    def _address(self, size: int, peer: str = "") -> GroupAddress:
        """Where this generation's group of ``size`` members (or ``peer``'s pair) meets."""
        host, port = self._store
        return GroupAddress(
            host=host,
            port=port,
            size=size,
            timeout_s=self.config.timeout_s,
            generation=self.generation,
            backend=self.backend,
            peer=peer,
        )

    async def _join(self, only: list[Target] | None = None) -> None:
        """Form a new generation of the weight groups: over gloo, a pair group (trainer rank 0
        and the engine) for each broadcast engine in ``only`` (default: every one without a
        group), each forming on its own, so one that fails to join holds no other; over NCCL,
        one group of every broadcast engine. An engine that fails to join is handled like one
        that fails a sync."""
        self.generation += 1
        far = [target for target in self._targets if target.transport == "broadcast"]
        if not far:  # every engine copies from shared memory: the trainer lays out its buffer
            await self.source.join_weights(self._address(1), self.plan_bytes)
        elif self._pairs:
            todo = [t for t in far if (t in only if only is not None else not t.grouped)]
            results = await asyncio.gather(
                *[self._join_pair(target, self._address(2, target.name)) for target in todo],
                return_exceptions=True,
            )
            for result in results:
                _raise_if_trainer_lost(result)
            failed = {target: r for target, r in zip(todo, results) if isinstance(r, BaseException)}
            if failed:  # out of rotation; the others formed their pairs
                await self._drop(failed, "joining the weight group", always=True)
        else:
            await self._join_group()

    async def _join_group(self) -> None:
        """(NCCL) One group of trainer rank 0 and every broadcast engine; formed again without
        those that fail to join."""
        while True:
            far = [target for target in self._targets if target.transport == "broadcast"]
            group = self._address(len(far) + 1)
            results = await asyncio.gather(
                self.source.join_weights(group, self.plan_bytes),
                *[target.sink.join(group, rank) for rank, target in enumerate(far, 1)],
                return_exceptions=True,
            )
            failed = {target: r for target, r in zip(far, results[1:]) if isinstance(r, BaseException)}
            if not failed and not isinstance(results[0], BaseException):
                for target in far:
                    target.grouped = True
                return
            _raise_if_trainer_lost(results[0])  # then the engines failed waiting for it: not theirs
            if not failed:
                raise results[0]  # type: ignore[misc]  # the trainer could not form it
            await self._drop(failed, "joining the weight group", always=True)
            self.generation += 1

    async def _join_pair(self, target: Target, address: GroupAddress) -> None:
        """Trainer rank 0 and ``target`` form their pair group; an error is the engine's unless
        the trainer is lost (``NodeLostError``, raised as is)."""
        target.grouped = False
        sent, joined = await asyncio.gather(
            self.source.join_weights(address, self.plan_bytes),
            target.sink.join(address, 1),
            return_exceptions=True,
        )
        for result in (sent, joined):
            if isinstance(result, BaseException):
                raise result
        target.grouped = True

    async def add_engine(self, engine: Any) -> None:
        """Bring a new (or restarted) engine in: it gets the plan now and the next sync's
        version, and enters the ``router`` only once it serves that version."""
        if not self._started:
            raise RuntimeError("call start() first")
        target = Target(engine, len(self._targets) + len(self.removed), self.config.timeout_s + 5.0)
        if target.name in {s.name for s in self._targets}:
            raise ValueError(f"engine {target.name!r} is already synchronised")
        await self._attach(target)
        log.info("weights: %s (joining) by %s", target.name, target.transport)
        if self.config.transport == "shm" and target.transport != "shm":
            raise SyncError(
                f"weights.transport=shm, but engine {target.name!r} cannot map the trainer's shared memory; use weights.transport=auto"
            )
        target.joining = True
        self._targets.append(target)
        self._regroup = target.transport == "broadcast" or self._regroup
        if self.newest >= 0:  # released delivery: it pulls the newest version now
            self._pullers[target] = asyncio.ensure_future(self._pull(target))

    async def sync(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport:
        """Move the trainer's current parameters to every engine in rotation as ``version``: each
        stages it while it decodes, then takes it at its own step (``interrupt``: what happens
        to its running turns), half the engines at a time so that never all of them stop."""
        if not self._started:
            raise RuntimeError("call start() first")
        if self._regroup:
            self._regroup = False
            await self._join(None if self._pairs else list(self._targets))
        removed_before = len(self.removed)
        attempts, sender_failures, relay_s = 0, 0, 0.0
        failures: dict[Target, int] = {}
        started = time.perf_counter()
        pending, staged = list(self._targets), []  # to stage this version; staged it
        peers: list[str] | None = None  # the pair groups to send to (None: all)
        while True:
            attempts += 1
            results = await _unless_sender_lost(
                self.source.send_weights(version, peers),
                [target.sink.stage(version, self.config.timeout_s) for target in pending],
            )
            failed = {target: r for target, r in zip(pending, results[1:]) if isinstance(r, BaseException)}
            sent = results[0]
            if attempts == 1 and not isinstance(sent, BaseException):
                relay_s = float(sent)  # rank 0's own seconds: the snapshot and posting the sends
            staged += [target for target in pending if target not in failed]
            if not failed and not isinstance(sent, BaseException):
                break
            for error in [sent, *failed.values()]:
                if isinstance(error, BaseException) and not is_transfer_failure(error):
                    raise error  # a bug or a bad config, not a transfer failure: retrying cannot help
            if failed:
                for target in failed:
                    failures[target] = failures.get(target, 0) + 1
                await self._drop(failed, f"staging version {version}", always=False, failures=failures)
            else:
                sender_failures += 1
                if sender_failures > self.config.retries:
                    raise sent
            log.warning(
                "weight sync v%d failed (attempt %d); forming generation %d and trying again",
                version,
                attempts,
                self.generation + 1,
            )
            if self._pairs and not isinstance(sent, BaseException):
                # Only the engines that failed and are still in: the others have this version.
                pending = [target for target in failed if target in self._targets]
                peers = [target.name for target in pending if target.transport == "broadcast"]
                await self._join([target for target in pending if target.transport == "broadcast"])
            else:  # one group of all (NCCL), or the trainer's side failed: all again
                pending, staged, peers = list(self._targets), [], None
                await self._join([target for target in pending if target.transport == "broadcast"])
            pending = [target for target in pending if target in self._targets]
            if not pending:
                break
        transfer = time.perf_counter() - started
        # What this sync staged: an engine added meanwhile (a node that joined again, while the
        # trainer was sending) has not staged this version and joins at the next sync.
        targets = [target for target in staged if target in self._targets]
        pauses = await in_waves(targets, lambda target: target.commit(version, interrupt, drain_timeout_s))
        failed = {target: p for target, p in zip(targets, pauses) if isinstance(p, BaseException)}
        commits = [p for p in pauses if isinstance(p, Commit)]
        if failed:  # staged but could not switch: out of rotation (it serves its old version)
            await self._drop(failed, f"committing version {version}", always=True)
        for target in targets:
            if target.joining and target in self._targets:  # serves this version now: into rotation
                target.joining = False
                if self.router is not None and target.remote:
                    self.router.add_engine(target.engine)
        return SyncReport(
            version=version,
            bytes=self.total_bytes,
            transfer_s=transfer,
            relay_s=relay_s,
            attempts=attempts,
            pause_s=max((c.pause_s for c in commits), default=0.0),
            engine_idle_s=sum(c.pause_s for c in commits),
            reprefill_tokens=sum(c.reprefill_tokens for c in commits),
            all_paused=all_paused(commits, len(targets)),
            engines=self.engines,
            transports={target.name: target.transport for target in self._targets},
            removed=self.removed[removed_before:],
        )

    async def _drop(
        self,
        failed: dict[Target, BaseException],
        during: str,
        *,
        always: bool,
        failures: dict[Target, int] | None = None,
    ) -> None:
        """Take failed engines out: those that no longer answer, those past ``weights.retries``
        failures, or all of them (``always``). ``on_engine_failure="stop"`` raises instead."""
        answers = await asyncio.gather(
            *[target.sink.alive(min(5.0, self.config.timeout_s)) for target in failed]
        )
        dead = [target for target, ok in zip(failed, answers) if not ok]
        if always:
            out = list(failed)
        elif dead:
            out = dead  # the others most likely failed because of them: not counted against them
            for target in failed:
                if failures is not None and target not in dead:
                    failures[target] -= 1
        else:
            out = [
                target for target in failed if failures is not None and failures[target] > self.config.retries
            ]
        if not out:
            return
        why = {target: first_line(failed[target], 200) for target in out}
        reasons = "; ".join(f"{target.name}: {why[target]}" for target in out)
        if self.config.on_engine_failure == "stop":
            raise SyncError(
                f"weight sync failed while {during} ({reasons}); weights.on_engine_failure=stop ends the run"
            ) from failed[out[0]]
        for target in out:
            await self._take_out(target, f"it failed while {during} ({why[target]})")
        if not self._targets:
            raise SyncError(
                f"weight sync failed while {during} and no engine is left ({reasons})"
            ) from failed[out[0]]

    async def _take_out(self, target: Target, why: str) -> None:
        if target not in self._targets:  # taken out already (replaced while a sync was failing on it)
            return
        self._targets.remove(target)
        self.removed.append(target.name)
        target.sink.close()
        if (
            self._pairs and target.grouped
        ):  # its pair group goes too (a send stuck on it ends at its deadline)
            target.grouped = False
            try:
                await self.source.drop_weights(target.name)
            except Exception as exc:  # the trainer's own failure surfaces at the next send
                log.warning(
                    "the trainer could not let go of %s's weight group: %s", target.name, first_line(exc)
                )
        if self.router is not None:
            self.router.remove_engine(target.name)
        log.warning(
            "engine %s is out of rotation: %s; it serves version %d", target.name, why, target.version
        )

    async def replace_engine(self, engine: Any) -> None:
        """A restarted engine (its node was lost and joined again) takes the place of the one of
        its name: that one leaves rotation now, if no sync has taken it out yet, and the new one
        joins as ``add_engine`` does (in rotation once it serves the next version)."""
        for target in [s for s in self._targets if s.name == engine.name]:
            await self._take_out(target, "its node was lost and a new process of it joined")
        await self.add_engine(engine)

    def close(self) -> None:
        for task in self._pullers.values():
            task.cancel()
        for target in self._targets:
            target.sink.close()


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
