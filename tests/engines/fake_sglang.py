"""A small fake of the part of ``sglang.Engine`` that ``rlasync.engines.sglang`` drives, shaped on
SGLang's source (0.5.x to the 2026 main branch): ``Engine(**server_args)``, ``async_generate``
and its chunk dicts, ``tokenizer_manager.abort_request`` / ``pause_generation`` /
``continue_generation`` / ``update_weights_from_tensor`` / ``flush_cache``, ``shutdown``.

The model is real: the Hugging Face folder at ``model_path``, decoded one token per step for
every running request (its own KV cache each), greedy or sampled, so outputs are real tokens.

Modelled as in SGLang:
* Continuous batching up to ``max_running_requests``; a waiting queue behind it.
* Streaming chunks ``{"output_ids", "meta_info"}`` (``skip_tokenizer_init``: no text), cumulative
  by default and deltas with ``incremental_streaming_output=True``; chunks queued while the
  consumer was away are folded into one, as the TokenizerManager does. ``meta_info`` carries
  ``id``, ``finish_reason`` (``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``weight_version`` and ``output_token_logprobs`` ((logprob, id, None) tuples),
  with ``top_logprobs_num``: ``output_top_logprobs`` (each position's most likely tokens under the
  distribution its token's logprob is under, (logprob, id, None) tuples, likeliest first).
* Temperature 0 turns into top_k=1 (greedy, logprobs at temperature 1); otherwise logprobs are
  under the temperature-scaled distribution, before top-k/top-p. ``sampling_seed`` counts only
  with ``enable_deterministic_inference=True``.
* ``abort_request(rid)`` is dropped for a rid the TokenizerManager does not know, and ignored
  by the scheduler for one it has not received; a waiting request ends with "Abort in waiting
  queue" (a stream's last chunk then repeats the last token, with completion_tokens unchanged);
  a running one ends after one more decode step, whose token is in its last chunk.
* A generate call holds the weight-update lock's read side until its stream ends (so an update
  outside a pause waits for every request in flight and holds new ones back), and waits while
  generation is paused. ``pause_generation`` modes: "abort" (abort all, wait until no call
  holds the lock), "retract" (running requests back to the queue; they recompute their KV on
  continue), "in_place" (steps stop, requests keep their place).
* ``update_weights_from_tensor`` with ``flush_cache=True`` while requests are queued or running
  fails the way SGLang's scheduler does (an assertion); ``weight_version`` is recorded and
  reported in every later chunk.

Not modelled: tokenization and text, batched forward passes (each request runs alone, so there
is no batch-invariance question), prefix (radix) caching, chunked prefill, memory limits,
retraction under memory pressure, priorities, sessions, multimodal inputs, tensor parallelism
(``tp_size`` is 1; the per-rank payload list is read at rank 0), logprobs of the prompt,
stop strings, penalties, ``min_p``, SGLang's seeded Gumbel sampler (a seeded torch generator per
request instead: reproducible, not the same samples), CUDA IPC (tensors travel pickled), error
statuses (HTTP codes) of aborts, the HTTP server.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import pickle
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch
from transformers import DynamicCache

from rlasync.config import SGLangEngineConfig
from rlasync.engines.sglang import SGLangAPI, SGLangEngine, build_sglang
from rlasync.models import load_pretrained_dir

_SAMPLING_EPS = 1e-6


# -- io_struct shapes ------------------------------------------------------------------------
@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"

    def __post_init__(self) -> None:
        if self.mode not in ("abort", "retract", "in_place"):
            raise ValueError(
                f"Invalid mode: {self.mode!r}. Expected one of ['abort', 'retract', 'in_place']."
            )


@dataclass
class ContinueGenerationReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


class MultiprocessingSerializer:
    """SGLang's pickles through ForkingPickler (shared memory, CUDA IPC); a plain pickle here."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes:
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data: bytes) -> Any:
        return pickle.loads(data)


@dataclass
class ServerArgs:
    model_path: str
    dtype: str = "auto"
    device: str = "cuda"
    skip_tokenizer_init: bool = False
    random_seed: int | None = None
    max_running_requests: int | None = None
    context_length: int | None = None
    incremental_streaming_output: bool = False
    enable_deterministic_inference: bool = False
    weight_version: str = "default"
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float | None = None
    log_level: str = "error"


@dataclass
class _SamplingParams:
    """SGLang's SamplingParams, the fields the fake acts on (others are refused)."""

    max_new_tokens: int = 128
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        if 0 <= self.temperature < _SAMPLING_EPS:  # greedy, as SGLang does it
            self.temperature, self.top_k = 1.0, 1

    def verify(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")


@dataclass
class GenerateReqInput:
    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool = False
    stream: bool = False
    top_logprobs_num: int = 0


# -- the scheduler ---------------------------------------------------------------------------
@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: _SamplingParams
    stop: set[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None  # the request's own KV cache; None: prefill prompt + output so far
    to_finish: dict[str, Any] | None = None
    top: int = 0  # top_logprobs_num


class _Scheduler:
    """Continuous batching, one token per running request per step, in a worker thread."""

    def __init__(self, engine: FakeSGLangEngine) -> None:
        self.engine = engine
        self.model = engine.model
        args = engine.server_args
        self.max_running = args.max_running_requests or 64
        self.context_len = engine.tokenizer_manager.context_len
        self.generator = torch.Generator().manual_seed(args.random_seed or 0)
        self.waiting: collections.deque[_Req] = collections.deque()
        self.running: list[_Req] = []
        self.aborts: set[str] = set()
        self.abort_all = False
        self.paused = False
        self.stopped = False
        self.wake = asyncio.Event()
        self.step_lock = asyncio.Lock()
        # transformers renamed `past_key_values` to `cache` in 5.2x; pass whichever the model takes.
        self.cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self.pool = ThreadPoolExecutor(
            1, thread_name_prefix="fake-sglang", initializer=torch.set_num_threads, initargs=(1,)
        )

    def add(self, req: _Req) -> None:
        self.waiting.append(req)
        self.wake.set()

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopped:
            await self.wake.wait()
            self.wake.clear()
            while not self.stopped and (self.aborts or self.abort_all or (not self.paused and self.busy())):
                async with self.step_lock:
                    self._process_aborts()
                    if self.paused:
                        break
                    free = self.max_running - len(self.running)
                    batch = self.running + [
                        self.waiting.popleft() for _ in range(min(free, len(self.waiting)))
                    ]
                    if not batch:
                        break
                    picked = await loop.run_in_executor(self.pool, self._compute, batch)
                    self.running = batch
                    self._apply(picked)
                await asyncio.sleep(0)

    def _process_aborts(self) -> None:
        aborts, self.aborts, everything, self.abort_all = self.aborts, set(), self.abort_all, False
        tm = self.engine.tokenizer_manager
        for req in [r for r in self.waiting if everything or r.rid in aborts]:
            self.waiting.remove(req)
            tm.handle_abort_in_waiting_queue(req.rid)
        for req in self.running:
            if everything or req.rid in aborts:
                req.to_finish = {"type": "abort", "message": "Abort running request."}

    def _compute(self, batch: list[_Req]) -> list[tuple[int, float]]:
        """(worker thread) The next token of every request, and its logprob."""
        picked = []
        with torch.inference_mode():
            for req in batch:
                if req.cache is None:  # prefill (again, after a retraction)
                    req.cache = DynamicCache(config=self.model.config)
                    ids = req.prompt + req.output_ids
                else:
                    ids = req.output_ids[-1:]
                out = self.model(
                    input_ids=torch.tensor([ids]),
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kwarg: req.cache},
                )
                picked.append(self._sample(out.logits[0, -1].float(), req))
        return picked

    def _sample(self, logits: torch.Tensor, req: _Req) -> tuple[int, float, list[tuple[float, int, None]]]:
        p = req.params
        scaled = torch.log_softmax(logits / p.temperature, dim=-1)
        values, ids = scaled.topk(req.top) if req.top else (scaled[:0], scaled[:0].long())
        top = [(float(v), int(i), None) for v, i in zip(values, ids)]
        if p.top_k == 1:
            token = int(logits.argmax())
            return token, float(scaled[token]), top
        probs = scaled.exp()
        order = probs.argsort(descending=True)
        ranked = probs[order]
        keep = torch.ones_like(ranked, dtype=torch.bool)
        if p.top_k > 0:
            keep[p.top_k :] = False
        keep &= (ranked.cumsum(0) - ranked) < p.top_p
        weights = torch.where(keep, ranked, torch.zeros_like(ranked))
        pick = int(torch.multinomial(weights, 1, generator=req.generator or self.generator))
        token = int(order[pick])
        return token, float(scaled[token]), top

    def _apply(self, picked: list[tuple[int, float, list[tuple[float, int, None]]]]) -> None:
        tm = self.engine.tokenizer_manager
        still = []
        for req, (token, logprob, top) in zip(self.running, picked):
            req.output_ids.append(token)
            finish: dict[str, Any] | None
            if req.to_finish is not None:
                finish = req.to_finish
            elif token in req.stop:
                finish = {"type": "stop", "matched": token}
            elif (
                len(req.output_ids) >= req.params.max_new_tokens
                or len(req.prompt) + len(req.output_ids) >= self.context_len
            ):
                finish = {"type": "length", "length": len(req.output_ids)}
            else:
                finish = None
                still.append(req)
            tm.handle_output(req.rid, [token], [logprob], finish, [top])
        self.running = still

    def pause(self, retract: bool) -> None:
        self.paused = True
        if retract:
            for req in reversed(self.running):
                req.cache = None
                self.waiting.appendleft(req)
            self.running = []

    def resume(self) -> None:
        self.paused = False
        self.wake.set()

    async def update_weights(self, obj: UpdateWeightsFromTensorReqInput) -> tuple[bool, str]:
        async with self.step_lock:  # between two steps
            named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
            params = dict(self.model.named_parameters())
            unknown = [name for name, _ in named if name not in params]
            if unknown:
                return False, f"Failed to update weights: unknown parameters {unknown[:5]}"
            with torch.no_grad():
                for name, tensor in named:
                    params[name].copy_(tensor)
            if obj.flush_cache:
                assert not self.busy(), "Cache flush failed after updating weights"
            return True, "Succeeded to update model weights."


# -- the TokenizerManager --------------------------------------------------------------------
class _RWLock:
    """A writer-preferring asyncio read/write lock, as SGLang's ``model_update_lock``."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def is_locked(self) -> bool:
        return self._writer or self._readers > 0

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()


@dataclass
class _ReqState:
    obj: GenerateReqInput
    out_list: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int, None]]] = field(default_factory=list)
    last_output_offset: int = 0


class FakeTokenizerManager:
    def __init__(self, engine: FakeSGLangEngine) -> None:
        self.engine = engine
        self.server_args = engine.server_args
        config = engine.model.config
        self.model_config = SimpleNamespace(
            vocab_size=int(config.vocab_size),
            num_hidden_layers=int(config.num_hidden_layers),
            head_dim=int(config.hidden_size // config.num_attention_heads),
            dtype=engine.model.dtype,
            get_num_kv_heads=lambda tp: max(1, int(config.num_key_value_heads) // tp),
        )
        self.context_len = int(self.server_args.context_length or config.max_position_embeddings)
        self.incremental_streaming_output = self.server_args.incremental_streaming_output
        self.rid_to_state: dict[str, _ReqState] = {}
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = _RWLock()
        eos = (
            engine.model.generation_config.eos_token_id
            if engine.model.generation_config is not None
            else None
        )
        self.eos: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.scheduler: _Scheduler | None = None
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def auto_create_handle_loop(self) -> _Scheduler:
        if self.scheduler is None:
            self.loop = asyncio.get_running_loop()
            self.scheduler = _Scheduler(self.engine)
            self.task = self.loop.create_task(self.scheduler.serve())
        return self.scheduler

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        scheduler = self.auto_create_handle_loop()
        if obj.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID: {obj.rid}")
        state = self.rid_to_state[obj.rid] = _ReqState(obj)
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            await self.model_update_lock.acquire_read()
            try:
                scheduler.add(self._tokenized(obj))
                while True:
                    await state.event.wait()
                    out_list, state.out_list = state.out_list, []
                    finished = state.finished
                    state.event.clear()
                    if obj.stream and self.incremental_streaming_output and len(out_list) > 1:
                        out = self._coalesce(out_list)
                    else:
                        out = out_list[-1]
                    if finished:
                        yield out
                        break
                    if obj.stream:
                        yield out
            finally:
                await self.model_update_lock.release_read()
        except BaseException:
            if self.rid_to_state.get(obj.rid) is state:
                del self.rid_to_state[obj.rid]
            raise

    def _tokenized(self, obj: GenerateReqInput) -> _Req:
        """Validation and parsing, as ``_validate_one_request`` and ``_create_tokenized_object``."""
        ids = obj.input_ids
        if len(ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        max_new = obj.sampling_params.get("max_new_tokens")
        if max_new is not None and max_new + len(ids) > self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens."
            )
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in ids):
            raise ValueError(f"The input_ids {ids} contains values greater than the vocab size ({vocab}).")
        params = _SamplingParams(**obj.sampling_params)  # unknown keys: TypeError, as SGLang's
        params.verify()
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self.eos
        seed = params.sampling_seed if self.server_args.enable_deterministic_inference else None
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return _Req(
            rid=obj.rid,
            prompt=list(ids),
            params=params,
            stop=stop,
            generator=generator,
            top=obj.top_logprobs_num,
        )

    @staticmethod
    def _coalesce(out_list: list[dict[str, Any]]) -> dict[str, Any]:
        out = dict(out_list[-1])
        out["output_ids"] = [t for chunk in out_list for t in chunk["output_ids"]]
        meta = dict(out["meta_info"])
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if any(key in c["meta_info"] for c in out_list):
                meta[key] = [p for c in out_list for p in c["meta_info"].get(key, [])]
        out["meta_info"] = meta
        return out

    def _meta(self, rid: str, state: _ReqState, finish: dict[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(state.obj.input_ids),
            "weight_version": self.server_args.weight_version,
            "completion_tokens": len(state.output_ids),
            "cached_tokens": 0,
        }
        if state.obj.return_logprob:
            meta["output_token_logprobs"] = state.output_token_logprobs  # the live list, as SGLang
            if state.obj.top_logprobs_num:
                meta["output_top_logprobs"] = state.output_top_logprobs
        return meta

    def handle_output(
        self,
        rid: str,
        new_ids: list[int],
        new_logprobs: list[float],
        finish: dict[str, Any] | None,
        new_tops: list[list[tuple[float, int, None]]] | None = None,
    ) -> None:
        """One scheduler step's output for a request, as ``_handle_batch_output`` builds it."""
        state = self.rid_to_state.get(rid)
        if state is None:
            return
        offset = state.last_output_offset
        state.output_ids.extend(new_ids)
        state.output_token_logprobs.extend((lp, t, None) for lp, t in zip(new_logprobs, new_ids))
        state.output_top_logprobs.extend(new_tops or [[] for _ in new_ids])
        state.finished = finish is not None
        meta = self._meta(rid, state, finish)
        out: dict[str, Any] | None
        if state.obj.stream and self.incremental_streaming_output:
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][offset:]
            state.last_output_offset = len(state.output_ids)
            out = {"output_ids": list(new_ids), "meta_info": meta}
        elif state.finished:
            out = {"output_ids": state.output_ids.copy(), "meta_info": meta}
        elif state.obj.stream:
            out = {"output_ids": state.output_ids, "meta_info": meta}  # the live list, as SGLang
        else:
            out = None
        if state.finished:
            del self.rid_to_state[rid]
        if out is not None:
            state.out_list.append(out)
            state.event.set()

    def handle_abort_in_waiting_queue(self, rid: str) -> None:
        """As ``_handle_abort_req`` for a request the scheduler dropped from its queue."""
        state = self.rid_to_state.pop(rid, None)
        if state is None:
            return
        state.finished = True
        meta = self._meta(rid, state, {"type": "abort", "message": "Abort in waiting queue"})
        output_ids = state.output_ids[-1:] if state.obj.stream else state.output_ids
        state.out_list.append({"output_ids": output_ids, "meta_info": meta})
        state.event.set()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and not rid:
            return
        if not abort_all and rid not in self.rid_to_state:
            return
        scheduler = self.scheduler
        if scheduler is None:
            return
        if abort_all:
            scheduler.abort_all = True
        else:
            scheduler.aborts.add(rid)
        scheduler.wake.set()

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        scheduler = self.auto_create_handle_loop()
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                scheduler.pause(retract=obj.mode == "retract")
            else:
                while True:
                    self.abort_request(abort_all=True)
                    if not self.model_update_lock.is_locked():
                        break
                    await asyncio.sleep(0.01)  # SGLang polls every second

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        scheduler = self.auto_create_handle_loop()
        async with self.is_pause_cond:
            self.is_pause = False
            scheduler.resume()
            self.is_pause_cond.notify_all()

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: Any = None
    ) -> tuple[bool, str]:
        scheduler = self.auto_create_handle_loop()
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        async with self.is_pause_cond:
            paused = self.is_pause
            if paused:
                success, message = await scheduler.update_weights(obj)
        if not paused:
            await self.model_update_lock.acquire_write()
            try:
                success, message = await scheduler.update_weights(obj)
            finally:
                await self.model_update_lock.release_write()
        if success and obj.weight_version is not None:
            self.server_args.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    async def flush_cache(self) -> FlushCacheReqOutput:
        scheduler = self.auto_create_handle_loop()
        return FlushCacheReqOutput(success=not scheduler.busy())


# -- the Engine ------------------------------------------------------------------------------
class FakeSGLangEngine:
    """``sglang.Engine(**server_args)`` on the CPU with a real Hugging Face model."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs(**kwargs)  # unknown arguments: TypeError, as SGLang's
        if not self.server_args.skip_tokenizer_init:
            raise NotImplementedError("the fake serves token ids only: pass skip_tokenizer_init=True")
        self.model, _ = load_pretrained_dir(self.server_args.model_path)
        self.tokenizer_manager = FakeTokenizerManager(self)
        capacity = (self.server_args.max_running_requests or 64) * self.tokenizer_manager.context_len
        self._scheduler_init_result = SimpleNamespace(
            scheduler_infos=[
                {
                    "status": "ready",
                    "max_total_num_tokens": capacity,
                    "max_req_input_len": self.tokenizer_manager.context_len - 1,
                }
            ]
        )

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        stream: bool = False,
        rid: str | None = None,
        top_logprobs_num: int = 0,
        **unsupported: Any,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        if (
            prompt is not None
            or input_ids is None
            or any(v not in (None, False) for v in unsupported.values())
        ):
            raise NotImplementedError("the fake takes input_ids only, one request per call")
        obj = GenerateReqInput(
            input_ids=list(input_ids),
            sampling_params=dict(sampling_params or {}),
            rid=rid or uuid.uuid4().hex,
            return_logprob=return_logprob,
            stream=stream,
            top_logprobs_num=top_logprobs_num,
        )
        generator = self.tokenizer_manager.generate_request(obj, None)
        if stream:
            return generator
        return await generator.__anext__()

    def shutdown(self) -> None:
        tm = self.tokenizer_manager
        if tm.scheduler is not None:
            tm.scheduler.stopped = True
            tm.scheduler.pool.shutdown(wait=False)
            if tm.loop is not None and tm.task is not None and not tm.loop.is_closed():
                tm.loop.call_soon_threadsafe(tm.task.cancel)


FAKE_API = SGLangAPI(
    Engine=FakeSGLangEngine,
    UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
    serialize=MultiprocessingSerializer.serialize,
)


async def make_fake_sglang_engine(
    model_dir: str, *, max_batch: int = 64, max_seq_len: int = 0, **server_args: Any
) -> SGLangEngine:
    """The SGLang adapter around the fake, built by the real factory (``build_sglang``).
    Seeds count (``enable_deterministic_inference``) unless ``server_args`` says otherwise."""
    config = SGLangEngineConfig(model=model_dir, device="cuda", max_batch=max_batch, max_seq_len=max_seq_len)
    server_args.setdefault("enable_deterministic_inference", True)
    return await build_sglang(config, api=FAKE_API, **server_args)
