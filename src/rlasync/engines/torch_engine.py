"""The embedded engine on plain torch + transformers: continuous batching, on CPU and CUDA.

Every step, requests that finished leave the batch, waiting requests join it (their
prompts prefilled together), and every running request gets one new token; each token
is tagged with the weight version of its step.

The scheduler lives in one worker thread that owns the batch and runs steps back to back;
the event loop only submits requests and commands (abort, pause, weight updates) and
receives each step's tokens through ``call_soon_threadsafe``. So the node's loop keeps
serving calls during a long step, and the model never waits for the loop between steps.
Anything that changes the batch runs on the worker, between two steps.

    engine = TorchEngine.from_pretrained("runs/nano")
    out = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=ids))
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import torch

from .batch import KVBatch
from .grammar import Grammars
from .meter import TokenRate
from .protocol import EngineError, check_request, until_finished, wait_until_idle
from .sampling import sample, uniforms
from .torch_sequence import SequenceEvent, TorchSequence, oldest_version
from .types import Alternatives, EngineStats, GenerateOutput, GenerateRequest, PauseMode, TokenChunk

_NO_ALTERNATIVES: Alternatives = []  # a row that asked for no top_logprobs (never appended to)

log = logging.getLogger(__name__)


class TorchEngine:
    """A continuous-batching engine around any Hugging Face causal LM."""

    last_swap_s = 0.0
    """How long the last ``swap_weights`` held decoding."""
    swaps_between_steps = True
    """Weight updates run on the worker between two steps: running requests go on across them
    with their KV cache, their later tokens tagged with the new version (``interrupt=keep``
    needs no pause)."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        seed: int = 0,
        cpu_threads: int = 1,
        tokenizer: Any = None,
    ) -> None:
        self.model = model.eval()
        self.cpu_threads = cpu_threads
        self.max_batch = max_batch
        self.admit_min = max(1, max_batch // 4)
        self.max_seq_len = max_seq_len or int(getattr(model.config, "max_position_embeddings", 4096))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos: int | None = eos[0] if isinstance(eos, list) else eos
        # Constrained sampling (SamplingParams.grammar) reads the vocabulary through the tokenizer.
        self._grammars = Grammars(tokenizer, int(model.config.vocab_size), self.eos)
        self._generator = torch.Generator().manual_seed(seed)
        self._batch = KVBatch(model.config)
        # Shared between the loop and the worker, under _lock.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: collections.deque[TorchSequence] = collections.deque()
        self._aborts: set[str] = set()
        self._commands: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._paused = False
        self._frozen = False
        self._stop = False
        # Owned by the worker thread.
        self._rows: list[TorchSequence] = []  # running, in batch row order
        self._events: list[SequenceEvent] = []  # requests ended by commands, delivered with the next step
        self._version = 0
        # Owned by the event loop.
        self._by_id: dict[str, TorchSequence] = {}
        self._finished = 0
        self._running = 0  # rows after the last delivered step
        self._idle = asyncio.Event()
        self._idle.set()
        self._rate = TokenRate()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._asleep: torch.device | None = None  # sleeping: where its weights live when awake

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str = "cpu", dtype: Any = None, **kwargs: Any
    ) -> TorchEngine:
        from ..models import load_pretrained_dir

        model, tokenizer = load_pretrained_dir(path, dtype=dtype, device=device)
        return cls(model, tokenizer=tokenizer, **kwargs)

    # -- requests ---------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest, matcher: Any, stream: bool = False) -> TorchSequence:
        if self._closed:
            raise EngineError("the engine is closed")
        check_request(
            request,
            vocab_size=int(self.model.config.vocab_size),
            max_seq_len=self.max_seq_len,
            running=self._by_id,
        )
        self._start()
        seq = TorchSequence(request, self.eos, stream)
        seq.matcher = matcher
        self._by_id[request.request_id] = seq
        with self._lock:
            self._waiting.append(seq)
            self._work.notify()
        return seq

    async def _matcher(self, request: GenerateRequest) -> Any:
        """The request's grammar matcher (None without a grammar), compiled off the loop."""
        return await self._grammars.compile(request.params.grammar) if request.params.grammar else None

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        seq = self._submit(request, await self._matcher(request))
        try:
            async for _ in until_finished(seq.queue):
                pass
            return seq.output()
        finally:
            if seq.finish is None:  # the caller was cancelled: stop generating for it
                self._abort(request.request_id)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request, await self._matcher(request), stream=True)
        try:
            async for chunk in until_finished(seq.queue):
                yield chunk
        finally:
            if seq.finish is None:  # the consumer went away: stop generating for it
                self._abort(request.request_id)

    async def abort(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        if seq is None or seq.finish is not None:
            return False
        self._abort(request_id)
        return True

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._work.notify()

    # -- pause, resume, weights -------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        with self._lock:
            self._paused = True  # no admissions from the next step on
            self._frozen = mode == "keep"  # no steps at all: running rows stay where they are
        if mode == "keep":
            await self._command(lambda: None)  # returns between two steps, with no step after
            return []
        if mode == "abort":
            running: list[TorchSequence] = await self._command(self._abort_running)
            return [seq.output() for seq in running]
        await self._command(lambda: None)  # a step boundary: what it reported is current
        await wait_until_idle(self._idle, timeout)
        return []

    async def resume(self) -> None:
        with self._lock:
            self._paused = self._frozen = False
            self._work.notify()

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        params = dict(self.model.named_parameters())
        unknown = [name for name in named_tensors if name not in params]
        if unknown:
            raise EngineError(f"update_weights: the model has no parameters named {unknown[:5]}")
        for name, tensor in named_tensors.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise EngineError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(params[name].shape)}"
                )

        def load() -> None:  # on the worker, between two steps
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    params[name].copy_(tensor)
            self._version = version

        await self._command(load)

    async def swap_weights(self, named_tensors: Mapping[str, Any], version: int) -> float:
        """Like ``update_weights``, but takes ownership of ``named_tensors`` (a staged copy the
        caller no longer touches, on the model's device, in its dtype) and swaps them in by
        reference: decoding pauses for pointer assignments, not a copy of every byte. Returns
        that pause in seconds (also ``last_swap_s``)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors.items():
            target = params.get(name)
            if (
                target is None
                or tuple(tensor.shape) != tuple(target.shape)
                or tensor.dtype != target.dtype
                or tensor.device != target.device
            ):
                raise EngineError(
                    f"swap_weights: {name} does not fit the model's parameter (name, shape, dtype and device must match)"
                )

        def swap() -> None:  # on the worker, between two steps
            started = time.perf_counter()
            for name, tensor in named_tensors.items():
                params[name].data = tensor
            self._version = version
            self.last_swap_s = time.perf_counter() - started

        await self._command(swap)
        return self.last_swap_s

    async def sleep(self, offload_weights: bool = False) -> None:
        """(``SleepingEngine``) An idle batch holds no KV cache; on a GPU the allocator's cached
        blocks go back to the device, and ``offload_weights`` moves the weights to host memory."""
        if not self._idle.is_set() or self._waiting:
            raise EngineError(f"sleep with {self._running} requests running: pause the engine first")
        with self._lock:
            self._paused = True
        self._asleep = device = self.model.device
        if device.type == "cuda":  # on the worker, between two steps
            await self._command(lambda: _release(self.model, offload_weights))

    async def wake_up(self) -> None:
        device = self._asleep
        if device is not None and self.model.device != device:
            await self._command(lambda: self.model.to(device))
        self._asleep = None
        await self.resume()

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        rate = self._rate.per_second()
        return EngineStats(
            running=self._running,
            waiting=len(self._waiting),
            tokens_per_s=rate,
            kv_cache_bytes=self._batch.nbytes(),
            weight_version=self._version,
            paused=self._paused,
            sleeping=self._asleep is not None,
            finished=self._finished,
            generated_tokens=self._rate.total,
            batch_size=self._rate.last,
            oldest_running_version=oldest_version(list(self._by_id.values())),
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            await self._command(self._shutdown)
            await asyncio.to_thread(self._thread.join, 10.0)

    # -- the loop side ----------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._serve, name="rlasync-torch-engine", daemon=True)
            self._thread.start()
        elif loop is not self._loop:
            raise EngineError(
                "a TorchEngine serves the event loop it was first used on; build one engine per loop"
            )

    def _command(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the worker between two steps; its result arrives after that step's tokens."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._thread is None:  # nothing runs yet: the batch is ours
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
            return future
        with self._lock:
            self._commands.append((fn, future))
            self._work.notify()
        return future

    def _deliver(
        self,
        events: list[SequenceEvent],
        running: int,
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]],
    ) -> None:
        """Hand chunks to their callers and command results to theirs (event loop)."""
        for seq, chunk in events:
            if seq.finish is not None:
                continue
            if chunk.finish_reason is not None:
                seq.finish = chunk.finish_reason
                self._finished += 1
                self._by_id.pop(seq.request.request_id, None)
            seq.queue.put_nowait(chunk)
        self._running = running
        if running:
            self._idle.clear()
        else:
            self._idle.set()
        for future, result, error in results:
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

    def _fail(self, seqs: list[TorchSequence], error: BaseException) -> None:
        for seq in seqs:
            if seq.finish is None:
                seq.finish = "abort"
                self._by_id.pop(seq.request.request_id, None)
                seq.queue.put_nowait(error)

    # -- the worker thread ------------------------------------------------------------------
    def _serve(self) -> None:
        loop = self._loop
        assert loop is not None
        if self.cpu_threads > 0:
            # Per thread: the worker gets its own OpenMP thread count, the rest of the process
            # keeps its own. Two OpenMP pools on the same cores (this worker's and the main
            # thread's, once it ran any torch op) throttle each other: a tiny model's decode
            # step measured 3x slower at 2 threads here than at 1 on a 2-core machine.
            torch.set_num_threads(self.cpu_threads)
        while True:
            results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
            with self._lock:
                while not (
                    self._commands
                    or self._aborts
                    or (self._rows and not self._frozen)
                    or (self._waiting and not self._paused)
                ):
                    self._work.wait(timeout=1.0)
                commands, self._commands = self._commands, []
            for fn, future in commands:
                try:
                    results.append((future, fn(), None))
                except Exception as exc:
                    results.append((future, None, exc))
            events, self._events = self._events, []  # what the commands ended
            running_before = len(self._rows)
            with self._lock:
                aborts, self._aborts = self._aborts, set()
                stop = self._stop
                frozen = self._frozen and not stop
                admit: list[TorchSequence] = []
                if aborts:
                    for seq in [s for s in self._waiting if s.request.request_id in aborts]:
                        self._waiting.remove(seq)
                        events.append(seq.end("abort", self._version))
                # Admit in groups: every admission costs a prefill forward and a copy of the
                # batch's KV cache, so waiting for a quarter of the rows to free up (unless
                # the batch is nearly idle) measured faster than refilling row by row.
                free = self.max_batch - len(self._rows)
                if (
                    not stop
                    and not self._paused
                    and self._waiting
                    and (free >= self.admit_min or len(self._rows) < self.admit_min)
                ):
                    while self._waiting and len(admit) < free:
                        admit.append(self._waiting.popleft())
            if aborts:
                keep = [i for i, s in enumerate(self._rows) if s.request.request_id not in aborts]
                if len(keep) < len(self._rows):
                    events += [
                        s.end("abort", self._version) for s in self._rows if s.request.request_id in aborts
                    ]
                    self._batch.keep(keep)
                    self._rows = [self._rows[i] for i in keep]
            failed: list[TorchSequence] = []
            error: BaseException | None = None
            if (self._rows or admit) and not frozen:
                try:
                    events += self._step(admit)
                except Exception as exc:  # a bug or an out-of-memory: fail this batch, keep serving
                    log.exception(
                        "torch engine step failed; failing its %d requests", len(self._rows) + len(admit)
                    )
                    failed = self._rows + [s for s in admit if s not in self._rows]
                    error = EngineError(f"the engine step failed: {exc!r}")
                    self._rows = []
                    self._batch.keep([])
            # Wake the loop only when someone is waiting for something: a stream's chunk, a
            # finished request, a command's result, or the batch going idle or busy.
            if not (events or results or failed or (running_before == 0) != (len(self._rows) == 0)):
                continue
            try:
                loop.call_soon_threadsafe(self._deliver, events, len(self._rows), results)
                if failed:
                    assert error is not None
                    loop.call_soon_threadsafe(self._fail, failed, error)
            except RuntimeError:  # the event loop is closed: nobody is left to serve
                return
            if stop:
                return

    def _abort_running(self) -> list[TorchSequence]:
        """(worker) End every running request now; they are returned as partials."""
        running, self._rows = self._rows, []
        self._batch.keep([])
        self._events += [seq.end("abort", self._version) for seq in running]
        return running

    def _shutdown(self) -> None:
        """(worker) Abort everything, then leave the serving loop after this iteration."""
        self._abort_running()
        with self._lock:
            self._stop = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        self._events += [seq.end("abort", self._version) for seq in waiting]

    def _uniforms(self, seqs: list[TorchSequence]) -> torch.Tensor:
        """(worker) The number each row samples its next token from: a seeded request's is
        fixed by its seed and the position of that token (``sampling.seeded_uniform``)."""
        seeds = [
            None
            if (seed := s.request.params.seed) is None
            else (seed, len(s.request.prompt_ids) + len(s.tokens))
            for s in seqs
        ]
        return uniforms(seeds, self._generator)

    def _step(self, admit: list[TorchSequence]) -> list[SequenceEvent]:
        """(worker) One engine step: decode the running rows, prefill the newcomers."""
        rows = list(self._rows)
        picked: list[tuple[TorchSequence, int, float, Alternatives]] = []
        if rows:
            logits = self._batch.decode(self.model)
            self._grammars.mask(logits, [s.matcher for s in rows])
            tokens, logprobs, top = sample(logits, [s.request.params for s in rows], self._uniforms(rows))
            self._batch.last = tokens.cpu()
            picked += zip(rows, tokens.tolist(), logprobs.tolist(), top or itertools.repeat(_NO_ALTERNATIVES))
        if admit:
            logits = self._batch.prefill(self.model, [list(s.request.prompt_ids) for s in admit])
            self._grammars.mask(logits, [s.matcher for s in admit])
            tokens, logprobs, top = sample(logits, [s.request.params for s in admit], self._uniforms(admit))
            self._batch.last[len(rows) :] = tokens.cpu()
            picked += zip(
                admit, tokens.tolist(), logprobs.tolist(), top or itertools.repeat(_NO_ALTERNATIVES)
            )
            rows += admit
        # Record the tokens, and decide who is done now, so the batch shrinks before the next step.
        version = self._version
        events: list[SequenceEvent] = []
        keep = []
        positions = self._batch.pos.tolist()
        for i, (seq, token, logprob, alternatives) in enumerate(picked):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if seq.request.params.top_logprobs:
                seq.top_logprobs.append(alternatives)
            if token in seq.stop_ids or (seq.matcher is not None and not Grammars.accept(seq.matcher, token)):
                events.append(seq.end("stop", version))
            elif len(seq.tokens) >= seq.request.params.max_new_tokens or positions[i] + 1 >= self.max_seq_len:
                events.append(seq.end("length", version))
            else:
                keep.append(i)
                if seq.stream:
                    events.append(seq.token(token, logprob, version, alternatives))
        self._rate.add(len(picked))
        self._rows = rows
        if len(keep) < len(rows):
            self._batch.keep(keep)
            self._rows = [rows[i] for i in keep]
        return events


def _release(model: Any, offload_weights: bool) -> None:
    """A sleeping engine's GPU memory back to the device: its weights too with ``offload_weights``."""
    if offload_weights:
        model.to("cpu")
    torch.cuda.empty_cache()
