"""Released delivery: the trainer goes on once its relay holds a version, and each engine pulls
the newest one at its own pace (``ParameterSynchronizer.publish``).

    report = await sync.publish(8)   # v8 is in the trainer's relay: the trainer trains on at once
    sync.served                      # the oldest version an engine in rotation serves (7, then 8)
    await sync.settle()              # before a validation: every engine serves v8

Each engine has a *puller*: whenever the relay holds a newer version than the engine serves, it
stages the newest one while the engine decodes (a copy from shared memory, or the relay's send
over the engine's pair group) and the engine takes it at its own step (``interrupt``), at most
half the engines at once so that never all of them pause. An engine that lags skips the
versions between: it always pulls the newest. One that stalls delays no other engine and not
the trainer; one whose pull fails is counted, kept if it answers and ``weights.retries``
allows (its pair group formed again), else taken out of rotation, as ``sync`` does.

The relay (``weights.max_live_versions`` slots) holds the newest versions; a slot a pair is
sending from is never overwritten (``SharedWeights.pin``), so an engine more than
``max_live_versions - 1`` versions behind and still receiving holds the trainer's next publish
until its send ends (its deadline: ``weights.timeout_s``). A copy from shared memory overtaken by
a newer version is simply made again from the newest.

``served`` is what the sample queue counts admissions from (``served_listeners``), so the
staleness bound stays exact per token while engines serve different versions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..config.weights import WeightsConfig
from ..runtime import NodeLostError
from .commit import Commit, Interrupt, all_paused
from .errors import SyncError, is_transfer_failure
from .roles import Rotation, SyncReport, WeightSource
from .targets import Target


class ReleasedDelivery:
    """The released half of ``ParameterSynchronizer`` (a mixin: it uses the synchroniser's
    engines, groups and failure rules, declared below)."""

    config: WeightsConfig
    source: WeightSource
    router: Rotation | None
    relayed: bool
    total_bytes: int
    removed: list[str]
    _targets: list[Target]
    _regroup: bool

    @property
    def _pairs(self) -> bool:
        raise NotImplementedError

    async def sync(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport:
        raise NotImplementedError

    async def _join(self, only: list[Target] | None = None) -> None:
        raise NotImplementedError

    async def _drop(
        self,
        failed: dict[Target, BaseException],
        during: str,
        *,
        always: bool,
        failures: dict[Target, int] | None = None,
    ) -> None:
        raise NotImplementedError

    def _init_release(self) -> None:
        # The newest version the relay holds, each engine's puller, the commits since the last
        # report, each engine's failed pulls, what stopped the delivery, who waits on a change.
        self.newest = -1
        self._reported_removed = 0  # engines taken out that a publish has reported
        self._pullers: dict[Target, asyncio.Task[None]] = {}
        self._pull_policy: tuple[Interrupt, float] = ("keep", 120.0)
        self._commits: list[Commit] = []
        self._pulls: list[float] = []  # seconds each of those engines took to stage its version
        self._failed: BaseException | None = None
        self._failures: dict[Target, int] = {}
        self._committing: asyncio.Semaphore | None = None
        self._changes: list[asyncio.Future[None]] = []
        self.served_listeners: list[Callable[[int], None]] = []
        """Called with ``served`` whenever it grows (the sample queue's admissions follow it)."""

    @property
    def can_release(self) -> bool:
        """Can ``publish`` return before the engines have the version? With the trainer's relay
        (``weights.max_live_versions`` >= 2), over pair groups or shared memory; not over one
        NCCL group (its broadcast is one collective of every engine)."""
        return self.relayed and self._pairs

    @property
    def served(self) -> int:
        """The oldest version an engine in rotation serves (every token generated from now on is
        of this version or newer); the newest published when none is in rotation."""
        serving = [t.version for t in self._targets if not t.joining]
        return min(serving) if serving else max(self.newest, 0)

    async def publish(
        self, version: int, *, interrupt: Interrupt = "keep", drain_timeout_s: float = 120.0
    ) -> SyncReport:
        """Put the trainer's current parameters in its relay as ``version`` and return: the
        trainer may change them at once. Each engine pulls the newest version the relay holds
        when it has taken the one before (a pair group's send, or a copy from shared memory,
        while it decodes) and takes it at its own step, as ``interrupt`` says; a slow, dead or
        rejoining engine delays no other, and leaves rotation by the rules of ``sync``. The
        report covers what the engines took since the previous ``publish`` (``engines``: the
        version each serves now). Without a relay (``can_release`` false) this is ``sync``."""
        if not self.can_release:
            return await self.sync(version, interrupt=interrupt, drain_timeout_s=drain_timeout_s)
        self._raise_failure()
        self._regroup = False  # each puller forms its engine's pair group itself, off this path
        removed_before, self._reported_removed = self._reported_removed, len(self.removed)
        started = time.perf_counter()
        await self.source.send_weights(version, [])  # the relay holds it: no pair is sent to yet
        relay_s = time.perf_counter() - started
        previous, self.newest, self._pull_policy = self.newest, version, (interrupt, drain_timeout_s)
        if self._committing is None:  # at most half the engines take a version at once
            self._committing = asyncio.Semaphore(max(1, len(self._targets) // 2))
        for target in self._targets:
            if target not in self._pullers or self._pullers[target].done():
                self._pullers[target] = asyncio.ensure_future(self._pull(target))
        self._changed()
        commits, self._commits = self._commits, []
        pulls, self._pulls = self._pulls, []
        by_version: dict[int, list[Commit]] = {}
        for commit in commits:
            by_version.setdefault(commit.version, []).append(commit)
        in_rotation = sum(1 for t in self._targets if not t.joining)
        return SyncReport(
            version=version,
            bytes=self.total_bytes,
            transfer_s=relay_s + max(pulls, default=0.0),  # the relay's copy, then the slowest pull
            relay_s=relay_s,
            pause_s=max((c.pause_s for c in commits), default=0.0),
            engine_idle_s=sum(c.pause_s for c in commits),
            reprefill_tokens=sum(c.reprefill_tokens for c in commits),
            all_paused=any(all_paused(group, in_rotation) for group in by_version.values()),
            engines={t.name: t.version for t in self._targets if not t.joining},
            expected=previous,
            transports={t.name: t.transport for t in self._targets},
            removed=self.removed[removed_before:],
        )

    async def settle(self) -> None:
        """Wait until every engine in rotation serves the newest published version (those that
        cannot have left rotation), e.g. before a validation or at the end of a run; raises
        what stopped the delivery (``weights.on_engine_failure=stop``, no engine left)."""
        interrupt, drain = self._pull_policy
        # Each engine's pull ends within its deadlines, retries included.
        deadline = (self.config.retries + 1) * (2 * self.config.timeout_s + 5.0) + drain
        try:
            await asyncio.wait_for(
                self._until(
                    lambda: (
                        self._failed is not None
                        or all(t.version >= self.newest for t in self._targets if not t.joining)
                    )
                ),
                deadline,
            )
        except TimeoutError:
            behind = {t.name: t.version for t in self._targets if t.version < self.newest}
            raise SyncError(
                f"engines {behind} did not take version {self.newest} within {deadline:g} s"
            ) from None
        self._raise_failure()

    async def _pull(self, target: Target) -> None:
        """One engine's puller: whenever the relay holds a newer version than it serves, it
        stages the newest (skipping any between) and takes it at its own step."""
        while target in self._targets:
            await self._until(lambda: target not in self._targets or target.version < self.newest)
            if target not in self._targets:
                return
            version = self.newest
            interrupt, drain_timeout_s = self._pull_policy
            try:
                began = time.perf_counter()
                await self._stage_one(target, version)
                staged_s = time.perf_counter() - began
                assert self._committing is not None
                async with self._committing:  # never every engine at once
                    commit = await target.commit(version, interrupt, drain_timeout_s)
            except _Overtaken:
                continue  # the relay let that version go for a newer one: take the newest
            except _SenderLost as lost:
                self._fail(lost.__cause__ or lost)
                return
            except Exception as exc:
                if not await self._pull_failed(target, version, exc):
                    return
                continue
            self._failures.pop(target, None)
            self._commits.append(commit)
            self._pulls.append(staged_s)
            if target.joining:  # serves a current version now: into rotation
                target.joining = False
                if self.router is not None and target.remote:
                    self.router.add_engine(target.engine)
            self._changed()

    async def _stage_one(self, target: Target, version: int) -> None:
        """``target`` receives ``version`` into its staging copy: from shared memory, or over its
        pair group (formed first if it has none), which the relay sends it on."""
        if target.transport in ("shm", "node"):  # a copy on this machine: no pair group
            try:
                await target.sink.stage(version, self.config.timeout_s)
            except Exception as exc:  # overwritten while it copied: a newer one is there
                if self.newest > version and is_transfer_failure(exc):
                    raise _Overtaken from exc
                raise
            return
        if not target.grouped:
            await self._join([target])
            if target not in self._targets or not target.grouped:
                raise SyncError(f"{target.name} could not form its pair group")
        try:
            await self.source.relay_weights(version, [target.name])
        except NodeLostError as exc:
            raise _SenderLost from exc
        except Exception as exc:
            if self.newest > version and is_transfer_failure(exc):
                raise _Overtaken from exc  # nothing was sent: the pair is as it was
            raise
        try:
            await target.sink.stage(version, self.config.timeout_s)
        except BaseException:
            target.grouped = False  # the pair may be torn: the next pull forms it again
            raise

    async def _pull_failed(self, target: Target, version: int, exc: Exception) -> bool:
        """A pull of ``version`` failed: go on (True) once the engine is counted a failure and
        kept, or stop (False) once it is out, or when the delivery cannot go on (a bug, or
        ``weights.on_engine_failure=stop``: ``publish`` and ``settle`` then raise it)."""
        if not is_transfer_failure(exc):
            self._fail(exc)  # a bug or a bad config: retrying cannot help
            return False
        self._failures[target] = self._failures.get(target, 0) + 1
        try:
            await self._drop(
                {target: exc}, f"pulling version {version}", always=False, failures=self._failures
            )
        except Exception as stop:  # on_engine_failure=stop, or no engine left
            self._fail(stop)
            return False
        if target not in self._targets:
            self._changed()  # ``served`` may have moved on without it
            return False
        return True

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
        self._changed()

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _changed(self) -> None:
        """An engine took a version or left: wake whoever waits, tell the listeners."""
        waiters, self._changes = self._changes, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        served = self.served
        for listener in list(self.served_listeners):
            listener(served)

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            change: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._changes.append(change)
            await change


class _Overtaken(Exception):
    """A pull's version left the relay for a newer one before the engine had it."""


class _SenderLost(Exception):
    """The trainer's node was lost during a pull (its ``NodeLostError`` is the cause)."""


__all__ = ["ReleasedDelivery"]
