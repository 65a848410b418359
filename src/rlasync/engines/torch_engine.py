"""The embedded engine on plain torch + transformers: continuous batching, on CPU and CUDA.

Every step, requests that finished leave the batch, waiting requests join it (their
prompts prefilled together), and every running request gets one new token; each token
is tagged with the weight version of its step. Model compute runs in one worker thread,
so the node's event loop keeps serving calls during a long step; the batch is touched
only by that thread or between steps.

    engine = TorchEngine.from_pretrained("runs/nano")
    out = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=ids))
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from typing import Any, AsyncIterator, Mapping

import torch

from .batch import KVBatch
from .protocol import EngineError
from .sampling import sample
from .types import EngineStats, FinishReason, GenerateOutput, GenerateRequest, PauseMode, TokenChunk

log = logging.getLogger(__name__)


class _Sequence:
    __slots__ = ("request", "queue", "generator", "tokens", "logprobs", "versions", "finish", "stop_ids")

    def __init__(self, request: GenerateRequest, eos: int | None) -> None:
        self.request = request
        self.queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        seed = request.params.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: FinishReason | None = None
        stop = set(request.params.stop_token_ids)
        if eos is not None and not request.params.ignore_eos:
            stop.add(eos)
        self.stop_ids = stop

    def output(self) -> GenerateOutput:
        assert self.finish is not None
        r = self.request
        return GenerateOutput(
            request_id=r.request_id, prompt_ids=list(r.prompt_ids), token_ids=list(self.tokens),
            logprobs=list(self.logprobs), versions=list(self.versions), finish_reason=self.finish,
        )  # fmt: skip


class TorchEngine:
    """A continuous-batching engine around any Hugging Face causal LM."""

    def __init__(self, model: Any, *, max_batch: int = 64, max_seq_len: int | None = None, seed: int = 0) -> None:
        self.model = model.eval()
        self.max_batch = max_batch
        self.admit_min = max(1, max_batch // 4)
        self.max_seq_len = max_seq_len or int(getattr(model.config, "max_position_embeddings", 4096))
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos: int | None = eos[0] if isinstance(eos, list) else eos
        self._version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._batch = KVBatch(model.config)
        self._rows: list[_Sequence] = []  # running, in batch row order
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._by_id: dict[str, _Sequence] = {}
        self._aborts: set[str] = set()
        self._finished = 0
        self._paused = False
        self._closed = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._step_lock = asyncio.Lock()  # held during a step; weight updates take it too
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlasync-engine")
        self._loop_task: asyncio.Task[None] | None = None
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "cpu", dtype: Any = None, **kwargs: Any) -> TorchEngine:
        from ..models import load_pretrained_dir

        model, _ = load_pretrained_dir(path, dtype=dtype, device=device)
        return cls(model, **kwargs)

    # -- requests ---------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest) -> _Sequence:
        if self._closed:
            raise EngineError("the engine is closed")
        if not request.prompt_ids:
            raise EngineError(f"request {request.request_id!r} has an empty prompt")
        if request.request_id in self._by_id:
            raise EngineError(f"request id {request.request_id!r} is already running; ids must be unique")
        vocab = int(self.model.config.vocab_size)
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise EngineError(f"request {request.request_id!r} has token ids outside the vocabulary [0, {vocab})")
        if request.params.max_new_tokens < 1:
            raise EngineError(f"request {request.request_id!r}: max_new_tokens must be at least 1")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise EngineError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does not fit "
                f"max_seq_len={self.max_seq_len}"
            )
        seq = _Sequence(request, self.eos)
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="rlasync-torch-engine")
        self._wake.set()
        return seq

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        seq = self._submit(request)
        try:
            while True:
                chunk = await seq.queue.get()
                if chunk.finish_reason is not None:
                    return seq.output()
        finally:
            if seq.finish is None:  # the caller was cancelled: stop generating for it
                self._aborts.add(request.request_id)
                self._wake.set()

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request)
        try:
            while True:
                chunk = await seq.queue.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if seq.finish is None:  # the consumer went away: stop generating for it
                self._aborts.add(request.request_id)
                self._wake.set()

    async def abort(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        if seq is None or seq.finish is not None:
            return False
        self._aborts.add(request_id)
        self._wake.set()
        return True

    # -- pause, resume, weights -------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        self._paused = True
        if mode == "abort":
            async with self._step_lock:  # between steps: the batch is ours
                running = list(self._rows)
                for seq in running:
                    self._finish(seq, "abort", [], [], [])
                self._rows.clear()
                self._batch.keep([])
            return [seq.output() for seq in running]
        if mode != "wait":
            raise ValueError(f"pause mode must be 'abort' or 'wait', got {mode!r}")
        try:
            async with asyncio.timeout(timeout):
                while self._rows:
                    self._idle.clear()
                    await self._idle.wait()
        except TimeoutError:
            raise TimeoutError(f"in-flight requests did not finish within pause(timeout={timeout}); pause('abort') ends them at once") from None
        return []

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        params = dict(self.model.named_parameters())
        unknown = [name for name in named_tensors if name not in params]
        if unknown:
            raise EngineError(f"update_weights: the model has no parameters named {unknown[:5]}")
        for name, tensor in named_tensors.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise EngineError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(params[name].shape)}")

        def load() -> None:
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    params[name].copy_(tensor)

        async with self._step_lock:
            await asyncio.get_running_loop().run_in_executor(self._executor, load)
            self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._rate if now - t < 5.0]
        rate = sum(n for _, n in recent) / max(now - recent[0][0], 1e-3) if len(recent) > 1 else 0.0
        return EngineStats(
            running=len(self._rows), waiting=len(self._waiting), tokens_per_s=rate,
            kv_cache_bytes=self._batch.nbytes(), weight_version=self._version, paused=self._paused,
            finished=self._finished,
        )  # fmt: skip

    async def close(self) -> None:
        self._closed = True
        await self.pause("abort")
        for seq in list(self._waiting):
            self._finish(seq, "abort", [], [], [])
        self._waiting.clear()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False)

    # -- the scheduler ----------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._apply_aborts()
            admit: list[_Sequence] = []
            free = self.max_batch - len(self._rows)
            # Admit in groups: every admission costs a prefill forward and a copy of the
            # batch's KV cache, so waiting for a quarter of the rows to free up (unless
            # the batch is nearly idle) measured faster than refilling row by row.
            if not self._paused and self._waiting and (free >= self.admit_min or len(self._rows) < self.admit_min):
                while self._waiting and len(self._rows) + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
            if not self._rows and not admit:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()  # idle until a request, an abort or a resume arrives
                continue
            async with self._step_lock:
                version = self._version
                emitted = await loop.run_in_executor(self._executor, self._step, admit)
            self._deliver(emitted, version)

    def _step(self, admit: list[_Sequence]) -> list[tuple[_Sequence, int, float]]:
        """One engine step (worker thread): decode the running rows, prefill the newcomers."""
        rows = list(self._rows)
        results: list[tuple[_Sequence, int, float]] = []
        if rows:
            logits = self._batch.decode(self.model)
            tokens, logprobs = sample(logits, [s.request.params for s in rows], [s.generator for s in rows], self._generator)
            self._batch.last = tokens.cpu()
            results += zip(rows, tokens.tolist(), logprobs.tolist())
        if admit:
            logits = self._batch.prefill(self.model, [list(s.request.prompt_ids) for s in admit])
            tokens, logprobs = sample(logits, [s.request.params for s in admit], [s.generator for s in admit], self._generator)
            self._batch.last[len(rows) :] = tokens.cpu()
            results += zip(admit, tokens.tolist(), logprobs.tolist())
            rows += admit
        self._rows = rows
        # Decide who is done now (in the thread), so the batch shrinks before the next step.
        keep = []
        for i, (seq, token, _) in enumerate(results):
            done = token in seq.stop_ids or len(seq.tokens) + 1 >= seq.request.params.max_new_tokens
            done = done or int(self._batch.pos[i]) + 1 >= self.max_seq_len
            if not done:
                keep.append(i)
        if len(keep) < len(rows):
            self._batch.keep(keep)
            self._rows = [rows[i] for i in keep]
        return results

    def _deliver(self, emitted: list[tuple[_Sequence, int, float]], version: int) -> None:
        running = set(map(id, self._rows))
        count = 0
        for seq, token, logprob in emitted:
            count += 1
            if id(seq) in running:
                seq.tokens.append(token)
                seq.logprobs.append(logprob)
                seq.versions.append(version)
                seq.queue.put_nowait(TokenChunk(request_id=seq.request.request_id, token_ids=[token], logprobs=[logprob], versions=[version]))
            else:
                reason: FinishReason = "stop" if token in seq.stop_ids else "length"
                self._finish(seq, reason, [token], [logprob], [version])
        self._rate.append((time.monotonic(), count))
        if not self._rows:
            self._idle.set()

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, set()
        for seq in [s for s in self._waiting if s.request.request_id in aborts]:
            self._waiting.remove(seq)
            self._finish(seq, "abort", [], [], [])
        keep = [i for i, s in enumerate(self._rows) if s.request.request_id not in aborts]
        if len(keep) < len(self._rows):
            for seq in [s for s in self._rows if s.request.request_id in aborts]:
                self._finish(seq, "abort", [], [], [])
            self._batch.keep(keep)
            self._rows = [self._rows[i] for i in keep]

    def _finish(self, seq: _Sequence, reason: FinishReason, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        if seq.finish is not None:
            return
        seq.tokens += tokens
        seq.logprobs += logprobs
        seq.versions += versions
        seq.finish = reason
        self._finished += 1
        self._by_id.pop(seq.request.request_id, None)
        seq.queue.put_nowait(
            TokenChunk(request_id=seq.request.request_id, token_ids=tokens, logprobs=logprobs, versions=versions, finish_reason=reason)
        )
