"""``SimEngine``: an engine whose decoding time follows a model instead of running a network,
so the real schedulers (rollouter, queue, router, agent loops) can be measured at cluster scale
on one machine.

    clock = SimClock(scale=0.01)                  # one simulated second per 10 ms of wall time
    gpu = SimEngine(clock, LatencyModel(base_s=0.015, per_seq_s=0.00015, max_batch=256),
                    LogNormalLengths(median=2000, sigma=0.8, cap=16000))

A simulated GPU decodes its running sequences together; one step of ``b`` sequences holding
``C`` tokens of context takes ``base_s + per_seq_s * b + per_context_token_s * C`` simulated
seconds, and the batch is capped by ``max_batch`` and the KV cache (``LatencyModel``). It is
event-driven: it sleeps straight to the next completion or a full cache (or until an arrival,
abort or pause wakes it), then advances every sequence by the steps that fit in the time that
passed (a closed form: the context grows by one block a sequence each step). Each *simulated
token* stands for ``token_block`` tokens (the step time is multiplied by it), which keeps the
Python work per simulated second small; counts it reports are real tokens.

It charges what a real engine pays besides decoding (``LatencyModel``): admitting a request
costs the prefill of its context, during which the running sequences make no progress; a
weight swap (``update_weights``) holds decoding for ``swap_s``; a frozen engine
(``pause("keep")``) decodes nothing. A step in progress keeps its progress across such a stop.

A request's response length comes from its seed (the agent loops seed each turn), and a turn
that was cut (``pause("abort")``, or an abort: ``Router.migrate``) and is re-submitted, here or
on another GPU sharing its ``progress``, continues where it stopped, as on a real engine, and
pays the prefill of everything it had made: the cut dropped its KV cache (a queued turn
aborted made nothing). Tokens carry the weight version in force when they were made: a swap
counts the steps made so far under the old version first (a block in progress at the swap
carries the new one).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from .protocol import EngineError, collect, until_finished, wait_until_idle
from .sim_clock import SimClock, VirtualTimeLoop
from .types import EngineStats, FinishReason, GenerateOutput, GenerateRequest, PauseMode, TokenChunk


class LatencyModel(msgspec.Struct, frozen=True, kw_only=True):
    """What a simulated GPU's work costs, in seconds: the roofline of a memory-bound decoder.

    One decoding step of ``b`` sequences holding ``C`` tokens of context in all takes
    ``base_s + per_seq_s * b + per_context_token_s * C``: the weights read once (``base_s``),
    a fixed cost per sequence (sampling, scheduling), and each sequence's KV cache read
    (``per_context_token_s``: KV bytes per token over the memory bandwidth), so a step slows as
    its sequences grow. The batch is capped by ``max_batch`` and by the KV cache: at most
    ``kv_capacity_tokens`` tokens of context held at once (0: no cap). An engine admits a
    request only while its context fits, and when the running sequences outgrow the cache it
    preempts the newest, which is prefilled again when re-admitted (vLLM's recompute
    preemption). ``rlasync.modes.profiles`` derives all of it from a model's shape and a GPU's
    figures. With the defaults (no context term, no cap): 53 ms at a full batch, 0.21 ms a
    token."""

    base_s: float = 0.015
    per_seq_s: float = 0.00015
    per_context_token_s: float = 0.0
    max_batch: int = 256
    kv_capacity_tokens: int = 0
    prefill_per_token_s: float = 1 / 30_000
    """Seconds the GPU spends per token of a request's context before it decodes it. A prefill
    is one forward pass over the context, compute-bound: about 2N FLOPs a token for N
    parameters, against 6N for a training token (forward and backward). At the simulated
    trainer's 10,000 tokens/s per GPU (``SimTrainer``, ``benchmarks/modes_bench.py``) that is
    30,000 tokens/s: 33 us a token, a sixth of a decoded token's cost at a full batch."""
    swap_s: float = 0.1
    """Seconds an engine decodes nothing to take a staged weight version. An assumed order of
    magnitude, not a measurement: copying the staged weights of an 8B model (16 GB in bf16)
    over the live ones at HBM bandwidth takes ~10-20 ms; an engine's weight loader (vLLM's
    ``load_weights``: one call per parameter) and the pause around it take longer."""

    def step_s(self, batch: int, context: float = 0.0) -> float:
        """One decoding step of ``batch`` sequences holding ``context`` tokens in all."""
        return self.base_s + self.per_seq_s * batch + self.per_context_token_s * context

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_per_token_s * tokens


class LogNormalLengths(msgspec.Struct, frozen=True, kw_only=True):
    """Response lengths in tokens: log-normal with this median and sigma, capped."""

    median: float = 2000.0
    sigma: float = 0.8
    cap: int = 16000

    def draw(self, seed: int) -> int:
        value = random.Random(seed).lognormvariate(math.log(self.median), self.sigma)
        return max(1, min(self.cap, int(value)))


class _Seq:
    __slots__ = ("request", "queue", "remaining", "finish", "runs", "made", "context")
    # ``context``: real tokens of context it holds (the prompt and what it made so far): what
    # its prefill costs when admitted, and what its KV cache holds while it runs.

    def __init__(self, request: GenerateRequest, remaining: int, finish: FinishReason, context: int) -> None:
        self.request = request
        self.queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self.remaining = remaining  # simulated tokens until this request ends
        self.finish = finish  # how it ends when they are done: "stop" or "length"
        # The versions of the simulated tokens made, as runs [version, count] (a sequence spans
        # few versions; a list per token made the simulator slow at scale); ``made`` counts them.
        self.runs: list[list[int]] = []
        self.made = 0
        self.context = context

    def make(self, version: int, steps: int) -> None:
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += steps
        else:
            self.runs.append([version, steps])
        self.made += steps

    def versions(self) -> list[int]:
        return [version for version, count in self.runs for _ in range(count)]


class SimEngine:
    """A simulated GPU behind the ``Engine`` protocol (see the module docstring)."""

    swaps_between_steps = True
    """``weights.commit.take_version`` runs a swap between two steps while the running turns go
    on (``interrupt=keep``): the swap itself is the only pause (``LatencyModel.swap_s``)."""

    def __init__(
        self,
        clock: SimClock,
        latency: LatencyModel | None = None,
        lengths: LogNormalLengths | None = None,
        *,
        token_block: int = 16,
        token_id: int = 5,
        name: str = "",
        prompt_tokens: int = 0,
        progress: dict[int, int] | None = None,
    ) -> None:
        self.clock, self.latency, self.lengths = (
            clock,
            latency or LatencyModel(),
            lengths or LogNormalLengths(),
        )
        self.token_block, self.token_id, self.name = token_block, token_id, name
        # Tokens of context every request holds beside its ids (a profile's prompt length,
        # where the simulated task's own prompts are a few tokens).
        self.prompt_tokens = prompt_tokens
        self._running: dict[str, _Seq] = {}
        # Waiting in arrival order, by request id (a preempted sequence goes back to the front).
        self._waiting: collections.OrderedDict[str, _Seq] = collections.OrderedDict()
        # turn seed -> simulated tokens already made for it: a cut turn resumes where it
        # stopped, on this engine or (shared by a cluster's engines) on another it moved to.
        self._progress: dict[int, int] = progress if progress is not None else {}
        self._version = 0
        self._paused = self._frozen = self._closed = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._began: float | None = None  # simulated time the step in progress began (None: none runs)
        self._mark = 0.0
        # The steps from ``_began`` on, as planned for the running batch (``_plan``): the n-th
        # takes ``_tau0 + n * _delta`` (its sequences hold more context at each step).
        self._tau0, self._delta = 1.0, 0.0
        self._context = 0  # real tokens of context the running sequences hold in all (their KV)
        self._stops = 0  # reasons the GPU decodes nothing now: a freeze (pause "keep"), swaps
        self._stopped_since: float | None = None
        self._prefill_due = 0.0  # seconds of prefill the admitted requests need before the next step
        self.busy_s = 0.0  # simulated seconds decoding or prefilling with at least one sequence running
        self.batch_s = 0.0  # running sequences integrated over busy time (batch_s / busy_s: the mean batch)
        self.stopped_s = 0.0  # simulated seconds stopped (frozen or swapping weights)
        self.prefill_s = 0.0  # simulated seconds of prefill charged
        self.tokens = 0  # real tokens made
        self.finished = 0
        self.preempted = 0  # sequences put back to wait because the KV cache was full
        self.peak_context = 0  # the most tokens of context (KV cache) held at once

    # -- the GPU ----------------------------------------------------------------------------------
    def _ensure_running(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._decode_forever(), name=f"sim-gpu-{self.name}"
            )
            self._task.add_done_callback(self._fail_all)

    def _fail_all(self, task: asyncio.Task[None]) -> None:
        """The decoding task ended by an error (a bug, a bad setting): every request gets it, none
        waits for tokens that will never come, and the engine takes no more."""
        if task.cancelled() or task.exception() is None:
            return
        error = EngineError(f"simulated engine {self.name or ''} failed: {task.exception()!r}")
        self._closed = True
        for seq in [*self._running.values(), *self._waiting.values()]:
            seq.queue.put_nowait(error)
        self._running.clear()
        self._waiting.clear()

    async def _decode_forever(self) -> None:
        while not self._closed:
            self._admit()
            if not self._running or self._stops:
                if not self._running:
                    self._idle.set()
                    self._began = None  # the next step starts when work comes
                    self._prefill_due = 0.0  # the requests it was for left before it ran
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            now = self.clock.now()
            if self._began is None:
                self._began = self._mark = now
            # A step in progress finishes first (a real engine changes its batch between steps):
            # ``_began`` stays at its start, so an arrival does not throw a partial step away. The
            # prefills of the requests just admitted come before the rest of it.
            self._began += self._prefill_due
            self.prefill_s += self._prefill_due
            self._prefill_due = 0.0
            steps = min(seq.remaining for seq in self._running.values())
            room = self._steps_of_room()
            if room == 0 and len(self._running) > 1:  # the KV cache cannot take one more step
                self._preempt()
                continue
            if room > 0:  # (a lone sequence longer than the cache runs: a real engine rejects it)
                steps = min(steps, room)
            self._wake.clear()
            # Sleep straight to the next completion (or to a full cache), unless an arrival, an
            # abort or a pause comes first.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(),
                    timeout=self.clock.wall(max(0.0, self._began + self._time_of(steps) - now)),
                )
            self._account()

    def _account(self) -> None:
        """Count the decoding steps run since the last count (those that fit in the time that
        passed), before the batch, the version or the state changes. A stopped GPU runs none."""
        if self._began is None:
            return
        now = self.clock.now()
        if self._stopped_since is None:
            self.busy_s += now - self._mark
            self.batch_s += len(self._running) * (now - self._mark)
            fit = self._steps_within(now - self._began)
            fit = min(fit, min((seq.remaining for seq in self._running.values()), default=0))
            self._began += self._time_of(fit)
            self._advance(fit)
        self._mark = now

    # A step of b sequences with C tokens of context takes ``token_block * step_s(b, C)``, and
    # each step adds ``b * token_block`` tokens to C: the n-th step from now (n = 0, 1, ...)
    # takes tau0 + n * delta, so n steps take n * tau0 + delta * n (n - 1) / 2 (exact, with the
    # context of each block taken at its middle).
    def _plan(self) -> None:
        b, block, latency = len(self._running), self.token_block, self.latency
        self._tau0 = block * latency.step_s(b, self._context + b * block / 2)
        self._delta = block * latency.per_context_token_s * b * block

    def _time_of(self, steps: int) -> float:
        return steps * self._tau0 + self._delta * steps * (steps - 1) / 2

    def _steps_within(self, seconds: float) -> int:
        """The steps that fit in ``seconds`` from ``_began`` (the inverse of ``_time_of``). A
        sleep to a completion ends on its step's end, to a rounding error: hence the 1e-6."""
        if seconds <= 0:
            return 0
        if self._delta == 0:
            return max(0, int(seconds / self._tau0 + 1e-6))
        half = self._delta / 2
        linear = self._tau0 - half
        return max(0, int((-linear + math.sqrt(linear * linear + 4 * half * seconds)) / (2 * half) + 1e-6))

    def _steps_of_room(self) -> int:
        """Steps the running batch can make before its KV cache is full (a large number: no cap)."""
        capacity = self.latency.kv_capacity_tokens
        if not capacity:
            return 1 << 62
        return max(0, (capacity - self._context) // (len(self._running) * self.token_block))

    def _preempt(self) -> None:
        """The cache is full: the newest running sequence goes back to the head of the queue,
        keeping what it made; it is prefilled again when there is room (vLLM's recompute)."""
        rid, seq = self._running.popitem()
        self._context -= seq.context
        self._waiting[rid] = seq
        self._waiting.move_to_end(rid, last=False)
        self.preempted += 1
        self._plan()

    def _stop(self) -> None:
        """Decode nothing until as many ``_go``: the steps so far are counted first, and a step in
        progress keeps its progress (it ends that much later)."""
        if self._stops == 0:
            self._account()
            self._stopped_since = self.clock.now()
        self._stops += 1
        self._wake.set()

    def _go(self) -> None:
        self._stops -= 1
        if self._stops == 0 and self._stopped_since is not None:
            now = self.clock.now()
            self.stopped_s += now - self._stopped_since
            if self._began is not None:
                self._began += now - self._stopped_since
            self._mark, self._stopped_since = now, None
        self._wake.set()

    def _advance(self, steps: int) -> None:
        if steps <= 0:
            return
        grown = steps * self.token_block
        ended = []
        for rid, seq in self._running.items():
            seq.remaining -= steps
            seq.make(self._version, steps)
            seq.context += grown
            if seq.remaining == 0:
                ended.append((rid, seq))
        self._context += grown * len(self._running)
        self.tokens += grown * len(self._running)
        self.peak_context = max(self.peak_context, self._context)
        for rid, seq in ended:
            self._end(rid, seq.finish)
        self._plan()

    def _admit(self) -> None:
        capacity, block = self.latency.kv_capacity_tokens, self.token_block
        admitted = False
        while self._waiting and not self._paused and len(self._running) < self.latency.max_batch:
            seq = next(iter(self._waiting.values()))
            # Room for its context and one more step of the whole batch (none needed alone).
            needed = self._context + seq.context + (len(self._running) + 1) * block
            if capacity and self._running and needed > capacity:
                break
            del self._waiting[seq.request.request_id]
            self._running[seq.request.request_id] = seq
            self._context += seq.context
            self._prefill_due += self.latency.prefill_s(seq.context)
            admitted = True
        if admitted:
            self.peak_context = max(self.peak_context, self._context)
            self._plan()

    def _end(self, rid: str, finish: FinishReason) -> None:
        seq = self._running.pop(rid, None)
        if seq is None:
            return
        self._context -= seq.context
        self._plan()
        seed = seq.request.params.seed
        if finish == "abort" and seed is not None:
            self._progress[seed] = self._progress.get(seed, 0) + seq.made
        elif seed is not None:
            self._progress.pop(seed, None)
        n = seq.made
        seq.queue.put_nowait(
            TokenChunk(
                request_id=rid,
                token_ids=[self.token_id] * n,
                logprobs=[-1.0] * n,
                versions=seq.versions(),
                finish_reason=finish,
            )
        )
        self.finished += 1

    # -- the Engine protocol ------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest) -> _Seq:
        if self._closed:
            raise EngineError("the engine is closed")
        if request.request_id in self._running or request.request_id in self._waiting:
            raise EngineError(f"request id {request.request_id!r} is already running; ids must be unique")
        seed = request.params.seed if request.params.seed is not None else hash(request.request_id)
        total = -(-self.lengths.draw(seed) // self.token_block)
        made = self._progress.get(seed, 0)
        left = max(1, total - made)
        budget = max(1, request.params.max_new_tokens)
        # Its context, in real tokens: the prompt, which for a cut turn re-submitted ends with the
        # ``made`` blocks it had made (the agent loops send them), each ``token_block`` tokens.
        context = self.prompt_tokens + len(request.prompt_ids) + made * (self.token_block - 1)
        seq = _Seq(request, min(left, budget), "stop" if left <= budget else "length", context)
        self._waiting[request.request_id] = seq
        self._ensure_running()
        self._wake.set()
        return seq

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request)
        try:
            async for chunk in until_finished(seq.queue):
                yield chunk
        finally:
            if request.request_id in self._running:
                self._account()
                self._end(request.request_id, "abort")
            elif self._waiting.get(request.request_id) is seq:
                del self._waiting[request.request_id]

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await collect(request, self.generate_stream(request))

    async def abort(self, request_id: str) -> bool:
        if request_id in self._running:
            self._account()
            self._end(request_id, "abort")
            self._wake.set()  # the GPU re-plans for the smaller batch
            return True
        seq = self._waiting.pop(request_id, None)
        if seq is None:
            return False
        seq.queue.put_nowait(
            TokenChunk(request_id=request_id, token_ids=[], logprobs=[], versions=[], finish_reason="abort")
        )
        self.finished += 1
        return True

    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        self._paused = True
        if mode == "keep":
            if not self._frozen:
                self._frozen = True
                self._stop()
            return []
        if mode == "abort":
            self._account()  # the steps made so far belong to the cut turns
            self._wake.set()
            outs = []
            for rid, seq in list(self._running.items()):
                outs.append(
                    GenerateOutput(
                        request_id=rid,
                        prompt_ids=list(seq.request.prompt_ids),
                        token_ids=[self.token_id] * seq.made,
                        logprobs=[-1.0] * seq.made,
                        versions=seq.versions(),
                        finish_reason="abort",
                    )
                )
                self._end(rid, "abort")
            return outs
        # ``timeout`` in simulated seconds, as every duration this engine is told.
        await wait_until_idle(self._idle, None if timeout is None else self.clock.wall(timeout))
        return []

    async def resume(self) -> None:
        self._paused = False
        if self._frozen:
            self._frozen = False
            self._go()
        self._wake.set()

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Take ``version`` between two steps: the steps made so far carry the old one; then the
        GPU decodes nothing for the swap (``latency.swap_s``)."""
        self._stop()
        self._version = version
        try:
            await self.clock.sleep(self.latency.swap_s)
        finally:
            self._go()

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            tokens_per_s=0.0,
            kv_cache_bytes=0,
            weight_version=self._version,
            paused=self._paused,
            finished=self.finished,
        )

    async def close(self) -> None:
        self._closed = True
        for rid in list(self._running):
            self._end(rid, "abort")
        for seq in self._waiting.values():
            seq.queue.put_nowait(EngineError("the engine was closed"))
        self._waiting.clear()
        if self._task is not None:
            self._wake.set()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


__all__ = ["LatencyModel", "LogNormalLengths", "SimClock", "SimEngine", "VirtualTimeLoop"]
