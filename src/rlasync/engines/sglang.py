"""The SGLang engine behind the Engine protocol: an in-process ``sglang.Engine``, token-in/token-out.

    engine = await build_sglang(SGLangEngineConfig(model="runs/micro", device="cuda"))
    out = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=ids))

Written against SGLang's own source: ``python/sglang/srt/entrypoints/engine.py``,
``managers/tokenizer_manager.py``, ``tokenizer_control_mixin.py``, ``io_struct.py``,
``sampling/sampling_params.py`` of the 0.5 line's main branch (engine.py and
tokenizer_manager.py at commit 001067f), checked against older 0.5 releases where they
differ. What it calls:

* ``Engine.async_generate(input_ids=..., sampling_params={...}, return_logprob=True, stream=True,
  rid=request_id)``: every request streams, so the adapter always knows the tokens so far (the
  partials ``pause("abort")`` returns). A chunk is ``{"output_ids", "meta_info"}`` (no text:
  the engine runs with ``skip_tokenizer_init=True``); ``meta_info`` has ``id``,
  ``finish_reason`` (``None`` or ``{"type": "stop"|"length"|"abort", ...}``),
  ``completion_tokens`` and ``output_token_logprobs`` (``(logprob, token_id, text)`` tuples);
  a request that asks for ``top_logprobs`` adds ``top_logprobs_num=k``, and ``meta_info`` then
  has ``output_top_logprobs`` (each position's k likeliest, as such tuples); with a LoRA adapter
  loaded (``load_adapter``), ``lora_path=<its name>``. SGLang streams deltas with
  ``--incremental-streaming-output`` and cumulative lists without
  it (the default), and may fold several steps into one chunk; the new tokens of a chunk are
  found from ``completion_tokens``, which works for both.
* ``engine.tokenizer_manager.abort_request(rid)`` to end one request. SGLang drops an abort
  whose request has not reached its scheduler yet (one held behind a weight update), so the
  adapter repeats it every 50 ms until the request's stream ends.
* ``await engine.tokenizer_manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
  serialized_named_tensors=[MultiprocessingSerializer.serialize(named)] * tp_size,
  flush_cache=True, weight_version=str(version)), None)``: the coroutine under
  ``Engine.update_weights_from_tensor``, which itself runs ``loop.run_until_complete`` and so
  cannot be called from a running event loop (verl's ``AsyncEngine`` does the same).

Semantics next to the torch engine's:

* Temperature 0 is greedy (SGLang turns it into top_k=1), and its logprobs are under
  temperature 1; otherwise logprobs are under the temperature-scaled distribution, before
  top-k/top-p (SGLang's default; ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would make them
  unscaled). ``top_k=0`` is sent as -1 (all tokens).
* ``seed`` is sent as ``sampling_seed``, which SGLang honours only when the engine runs with
  ``enable_deterministic_inference=True`` (pass it to ``build_sglang``); otherwise a warning is
  logged once and the request samples from the engine's generator. SGLang versions without
  ``sampling_seed`` (before its deterministic sampling, PR 10678, autumn 2025) get no seed.
* A request whose prompt plus ``max_new_tokens`` passes ``max_seq_len`` is cut there with
  finish reason "length" (SGLang itself would reject it).
* The adapter admits at most ``max_batch`` requests into SGLang at once (the engine's
  ``max_running_requests``); the rest wait in the adapter, so "running" and "waiting" mean
  what they mean for the torch engine.
* ``pause("abort")`` aborts every request in SGLang, one abort per rid (not SGLang's
  ``pause_generation``: ``sglang.Engine`` does not expose it, it took no arguments up to
  0.5.5, and it aborts everything at once); their callers get finish "abort" and ``pause``
  returns their partial outputs. A request aborted before its first token goes back to the queue,
  unseen by its caller, and runs after ``resume``. SGLang may append one last token to an
  aborted request; it is part of the partial. ``pause("wait")`` stops admitting and waits for
  the requests in SGLang to finish (SGLang's pause modes, abort/retract/in_place, have no
  wait).
* Every token is tagged with the adapter's weight version when its chunk arrives. That is the
  version that produced it: outside a pause SGLang's update takes a writer lock that waits for
  every request in flight to finish (and holds new ones back), and inside a pause nothing
  runs. So a request never spans two versions here, unlike on the torch engine, and an
  update outside a pause waits for the longest request in flight.
* A request SGLang ends on its own with "abort" (a validation error, queue or memory
  pressure) raises ``EngineError`` with SGLang's message.
* ``stats()``: counts kept by the adapter; ``kv_cache_bytes`` is the size of SGLang's
  preallocated KV pool (from ``max_total_num_tokens``), fixed for the engine's life.

Importing this module never imports SGLang; ``build_sglang`` does, and SGLang then makes
uvloop the process's event loop policy and "spawn" its multiprocessing start method.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import itertools
import json
import logging
import struct
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.engine import SGLangEngineConfig
from ..weights.adapters import AdapterFolders
from .meter import TokenRate
from .protocol import EngineError, until_finished
from .sglang_memory import SGLangBetweenRequests
from .types import (
    Alternatives,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    RequestProgress,
    TokenChunk,
)

log = logging.getLogger(__name__)

ABORT_RETRY_S = 0.05  # how often an abort is re-sent until the request's stream ends
Tokens = tuple[list[int], list[float], list[int], list[Alternatives]]
"""A chunk's new tokens: ids, logprobs, versions, and alternatives (when the request asks)."""
_NO_TOKENS: Tokens = ([], [], [], [])


@dataclass(frozen=True)
class SGLangAPI:
    """The parts of SGLang the adapter uses besides the engine object (a fake swaps them)."""

    Engine: Callable[..., Any]  # sglang.Engine
    UpdateWeightsFromTensorReqInput: Callable[..., Any]  # sglang.srt.managers.io_struct
    serialize: Callable[[Any], Any]  # sglang.srt.utils.MultiprocessingSerializer.serialize

    @classmethod
    def load(cls) -> SGLangAPI:
        try:
            sglang = importlib.import_module("sglang")
            io_struct = importlib.import_module("sglang.srt.managers.io_struct")
            utils = importlib.import_module("sglang.srt.utils")
        except ImportError as exc:
            raise EngineError(
                "engine.backend=sglang needs SGLang on the engine's node (pip install 'rlasync[sglang]'; CUDA only): "
                f"{exc}"
            ) from exc
        return cls(
            sglang.Engine,
            io_struct.UpdateWeightsFromTensorReqInput,
            utils.MultiprocessingSerializer.serialize,
        )


class _Request(RequestProgress):
    __slots__ = ("stream", "seq", "queue", "failed", "abort", "attempt", "aborting", "task")

    def __init__(self, request: GenerateRequest, stream: bool, seq: int) -> None:
        super().__init__(request)
        self.stream = stream  # a streaming caller gets a chunk per SGLang chunk; others one at the end
        self.seq = seq  # arrival order, kept when a request goes back to the queue
        self.queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        self.failed = False
        self.abort: str | None = None  # who asked: "user" (abort, a caller gone, close) or "pause"
        self.attempt = 0  # how many times it was handed to SGLang
        self.aborting = 0  # the attempt an abort loop runs for
        self.task: asyncio.Task[None] | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id


def _finish_kind(reason: Any) -> tuple[str | None, str]:
    """SGLang's finish reason (None, a dict with "type", or a bare string) as (type, message)."""
    if reason is None:
        return None, ""
    if isinstance(reason, Mapping):
        return str(reason.get("type")), str(reason.get("message") or "")
    return str(reason), ""


def _new_part(values: Sequence[Any], seen: int, total: int, n: int) -> list[Any]:
    """The ``n`` newest of ``total`` entries from a chunk's list: a cumulative list holds all of
    them (take ``[seen:total]``: the list may be SGLang's live one, already longer), a delta
    list only the newest."""
    if n == 0:
        return []
    if len(values) >= total:
        return list(values[seen:total])
    return list(values[len(values) - n :])


class SGLangEngine(SGLangBetweenRequests):
    """The Engine protocol over an ``sglang.Engine`` (or anything with its API)."""

    def __init__(
        self,
        engine: Any,
        *,
        api: SGLangAPI | None = None,
        max_batch: int | None = None,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        param_shapes: Mapping[str, tuple[int, ...]] | None = None,
        kv_cache_bytes: int = 0,
    ) -> None:
        self.engine = engine
        self._tm = engine.tokenizer_manager
        self._api = api  # loaded at the first weight update when not given
        self.max_batch = max_batch
        self.vocab_size = vocab_size if vocab_size is not None else _model_attr(engine, "vocab_size")
        self.max_seq_len = max_seq_len or getattr(self._tm, "context_len", None)
        self.param_shapes = dict(param_shapes) if param_shapes is not None else None
        self.kv_cache_bytes = kv_cache_bytes
        args = getattr(engine, "server_args", None)
        self._tp_size = int(getattr(args, "tp_size", 1) or 1)
        self._incremental = bool(getattr(args, "incremental_streaming_output", False))
        # None: this SGLang has no per-request seeds; False: it has them but ignores them.
        self._seeded: bool | None = getattr(args, "enable_deterministic_inference", None)
        self._seed_warned = False
        self._version = 0
        self._paused = False
        self._lora = ""  # the LoRA adapter every request is served with (``load_adapter``)
        self._lora_files = AdapterFolders()
        self._asleep: list[str] = []  # what SGLang released while asleep (its memory saver's tags)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._order = itertools.count()
        self._by_id: dict[str, _Request] = {}  # every request not yet ended
        self._waiting: collections.deque[_Request] = collections.deque()  # not handed to SGLang
        self._live: dict[str, _Request] = {}  # handed to SGLang, its stream still open
        self._aborters: set[asyncio.Task[None]] = set()
        self._finished = 0
        self._rate = TokenRate()

    # -- requests ---------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest, stream: bool) -> _Request:
        if self._closed:
            raise EngineError("the engine is closed")
        if request.params.grammar:  # SGLang's grammar backends read the tokenizer, which it runs without here
            raise EngineError(
                "structured outputs (response_format, a forced tool_choice) are not supported on the sglang "
                "backend yet: use the torch or vllm backend"
            )
        rid, ids = request.request_id, request.prompt_ids
        if not ids:
            raise EngineError(f"request {rid!r} has an empty prompt")
        if rid in self._by_id:
            raise EngineError(f"request id {rid!r} is already running; ids must be unique")
        if min(ids) < 0 or (self.vocab_size is not None and max(ids) >= self.vocab_size):
            raise EngineError(f"request {rid!r} has token ids outside the vocabulary [0, {self.vocab_size})")
        if request.params.max_new_tokens < 1:
            raise EngineError(f"request {rid!r}: max_new_tokens must be at least 1")
        if self.max_seq_len and len(ids) >= self.max_seq_len:
            raise EngineError(
                f"request {rid!r}: prompt of {len(ids)} tokens does not fit max_seq_len={self.max_seq_len}"
            )
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise EngineError(
                "an SGLangEngine serves the event loop it was first used on; build one engine per loop"
            )
        req = _Request(request, stream, next(self._order))
        self._by_id[rid] = req
        self._waiting.append(req)
        self._admit()
        return req

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        req = self._submit(request, stream=False)
        try:
            async for _ in until_finished(req.queue):
                pass
            return req.output()
        finally:
            if req.finish is None:  # the caller was cancelled: stop generating for it
                self._abort(req, "user")

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        req = self._submit(request, stream=True)
        try:
            async for chunk in until_finished(req.queue):
                yield chunk
        finally:
            if req.finish is None:  # the consumer went away: stop generating for it
                self._abort(req, "user")

    async def abort(self, request_id: str) -> bool:
        req = self._by_id.get(request_id)
        if req is None or req.finish is not None:
            return False
        self._abort(req, "user")
        return True

    def _abort(self, req: _Request, why: str) -> None:
        if req.abort != "user":  # a caller's abort outranks a pause's (no requeue)
            req.abort = why
        if self._live.get(req.rid) is req:
            if req.aborting != req.attempt:
                req.aborting = req.attempt
                self._tm.abort_request(req.rid)
                assert self._loop is not None
                task = self._loop.create_task(self._keep_aborting(req, req.attempt))
                self._aborters.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._aborters.discard)
        elif req in self._waiting:
            self._waiting.remove(req)
            self._end(req, "abort", _NO_TOKENS)

    async def _keep_aborting(self, req: _Request, attempt: int) -> None:
        """Re-send the abort until this attempt's stream ends (SGLang drops an abort for a
        request its scheduler has not received yet)."""
        while True:
            await asyncio.sleep(ABORT_RETRY_S)
            if self._live.get(req.rid) is not req or req.attempt != attempt:
                return
            self._tm.abort_request(req.rid)

    # -- the SGLang side --------------------------------------------------------------------
    def _admit(self) -> None:
        """Hand waiting requests to SGLang while there is room and no pause."""
        while (
            self._waiting
            and not self._paused
            and not self._closed
            and (self.max_batch is None or len(self._live) < self.max_batch)
        ):
            req = self._waiting.popleft()
            req.attempt += 1
            self._live[req.rid] = req
            assert self._loop is not None
            req.task = self._loop.create_task(self._run(req))

    def _sampling_params(self, req: _Request) -> dict[str, Any]:
        p, prompt = req.request.params, req.request.prompt_ids
        max_new = (
            p.max_new_tokens
            if not self.max_seq_len
            else min(p.max_new_tokens, self.max_seq_len - len(prompt))
        )
        params: dict[str, Any] = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "max_new_tokens": max_new,
            "ignore_eos": p.ignore_eos,
        }
        if p.stop_token_ids:
            params["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            if self._seeded is not None:
                params["sampling_seed"] = p.seed
            if not self._seeded and not self._seed_warned:
                self._seed_warned = True
                log.warning(
                    "SGLang ignores per-request seeds %s; seeded requests sample from the engine's generator",
                    "unless the engine runs with enable_deterministic_inference=True"
                    if self._seeded is False
                    else "in this version",
                )
        return params

    async def _run(self, req: _Request) -> None:
        """One attempt of a request in SGLang, from submission to the end of its stream."""
        kind: str | None = None
        message = ""
        last = _NO_TOKENS
        try:
            top = req.request.params.top_logprobs
            stream = await self.engine.async_generate(
                input_ids=list(req.request.prompt_ids),
                sampling_params=self._sampling_params(req),
                return_logprob=True,
                stream=True,
                rid=req.rid,
                **({"top_logprobs_num": top} if top else {}),  # then meta_info's output_top_logprobs
                **({"lora_path": self._lora} if self._lora else {}),  # the adapter of load_adapter
            )
            async for out in stream:
                new = self._record(req, out)
                kind, message = _finish_kind((out.get("meta_info") or {}).get("finish_reason"))
                if kind is None:
                    if req.stream and new[0]:
                        req.queue.put_nowait(
                            TokenChunk(
                                request_id=req.rid,
                                token_ids=new[0],
                                logprobs=new[1],
                                versions=new[2],
                                top_logprobs=new[3],
                            )
                        )
                else:
                    last = new
        except asyncio.CancelledError:  # close() gave up waiting for SGLang
            self._settle(req, "abort", last)
            raise
        except EngineError as exc:
            self._settle(req, None, last, exc)
            return
        except Exception as exc:  # SGLang refused it (ValueError for a bad request) or broke
            self._settle(req, None, last, EngineError(f"SGLang failed request {req.rid!r}: {exc}"))
            return
        reason: FinishReason | None
        if kind in ("stop", "length"):
            reason = "stop" if kind == "stop" else "length"
        elif kind == "abort" and req.abort is not None:
            # Aborted by a pause before its first token: back to the queue, its caller never knows.
            reason = None if req.abort == "pause" and not req.tokens else "abort"
        elif kind == "abort":
            self._settle(
                req,
                None,
                last,
                EngineError(f"SGLang aborted request {req.rid!r}: {message or 'no reason given'}"),
            )
            return
        else:
            self._settle(
                req, None, last, EngineError(f"SGLang ended request {req.rid!r} with finish reason {kind!r}")
            )
            return
        self._settle(req, reason, last)

    def _record(self, req: _Request, out: Mapping[str, Any]) -> Tokens:
        """Append a chunk's new tokens to the request; return them (ids, logprobs, versions,
        alternatives: each position's ``top_logprobs`` likeliest, from ``output_top_logprobs``'
        (logprob, id, text) tuples, when the request asks)."""
        meta = out.get("meta_info") or {}
        ids: Sequence[int] = out.get("output_ids") or ()
        pairs: Sequence[Sequence[Any]] = meta.get("output_token_logprobs") or ()
        seen = len(req.tokens)
        total = meta.get("completion_tokens")
        if total is None:  # not reported: trust the server's streaming mode
            total = seen + len(ids) if self._incremental else len(ids)
        n = max(0, int(total) - seen)
        new_ids = [int(t) for t in _new_part(ids, seen, int(total), n)]
        new_logprobs = [float(p[0]) for p in _new_part(pairs, seen, int(total), n)]
        if len(new_ids) != n or len(new_logprobs) != n:
            raise EngineError(
                f"SGLang's chunk for {req.rid!r} has {len(new_ids)} token ids and {len(new_logprobs)} logprobs "
                f"for {n} new tokens (completion_tokens={total})"
            )
        k = req.request.params.top_logprobs
        tops: list[Alternatives] = []
        if k:
            given: Sequence[Sequence[Sequence[Any]]] = meta.get("output_top_logprobs") or ()
            tops = [
                [(int(t[1]), float(t[0])) for t in position[:k]]
                for position in _new_part(given, seen, int(total), n)
            ]
            if len(tops) != n:
                raise EngineError(
                    f"SGLang's chunk for {req.rid!r} has {len(tops)} positions of top logprobs for {n} new tokens"
                )
        versions = [self._version] * n
        req.tokens += new_ids
        req.logprobs += new_logprobs
        req.versions += versions
        req.top_logprobs += tops
        if n:
            self._rate.add(n)
        return new_ids, new_logprobs, versions, tops

    def _settle(
        self,
        req: _Request,
        reason: FinishReason | None,
        last: Tokens,
        error: EngineError | None = None,
    ) -> None:
        """An attempt's stream is over: end the request, fail it, or queue it again."""
        if self._live.get(req.rid) is req:
            del self._live[req.rid]
        if error is not None:
            self._fail(req, error)
        elif reason is None:
            req.abort = None
            self._waiting.append(req)
            self._waiting = collections.deque(sorted(self._waiting, key=lambda r: r.seq))
        else:
            self._end(req, reason, last)
        self._admit()

    def _end(self, req: _Request, reason: FinishReason, last: Tokens) -> None:
        req.finish = reason
        self._finished += 1
        self._by_id.pop(req.rid, None)
        ids, logprobs, versions, tops = last if req.stream else _NO_TOKENS
        req.queue.put_nowait(
            TokenChunk(
                request_id=req.rid,
                token_ids=ids,
                logprobs=logprobs,
                versions=versions,
                top_logprobs=tops,
                finish_reason=reason,
            )
        )

    def _fail(self, req: _Request, error: EngineError) -> None:
        req.finish = "abort"
        req.failed = True
        self._by_id.pop(req.rid, None)
        req.queue.put_nowait(error)

    # -- pause, resume, weights -------------------------------------------------------------
    can_keep = False
    """No ``pause("keep")`` yet: a weight version cuts its running turns (``interrupt=keep``
    is taken as ``abort`` here)."""

    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        if mode == "keep":
            # SGLang's own in-place pause (tokenizer_manager.pause_generation(mode="in_place"))
            # is not on the Engine API of every 0.5 release; not wired up yet.
            raise EngineError(
                "the SGLang engine does not support pause('keep') yet; use 'abort' (and resume the partials) or 'wait'"
            )
        if mode not in ("abort", "wait"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._paused = True  # nothing more is handed to SGLang
        live = list(self._live.values())
        if mode == "abort":
            for req in live:
                self._abort(req, "pause")
        tasks = [req.task for req in live if req.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                raise TimeoutError(
                    f"{len(pending)} requests in SGLang did not end within pause(timeout={timeout})"
                    + ("; pause('abort') ends them at once" if mode == "wait" else "")
                )
        if mode == "wait":
            return []
        return [req.output() for req in live if req.finish == "abort" and not req.failed and req.tokens]

    async def resume(self) -> None:
        self._paused = False
        self._admit()

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        if self._closed:
            raise EngineError("the engine is closed")
        if self.param_shapes is not None:
            unknown = [name for name in named_tensors if name not in self.param_shapes]
            if unknown:
                raise EngineError(f"update_weights: the model has no parameters named {unknown[:5]}")
            for name, tensor in named_tensors.items():
                if tuple(tensor.shape) != tuple(self.param_shapes[name]):
                    raise EngineError(
                        f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(self.param_shapes[name])}"
                    )
        if self._api is None:
            self._api = SGLangAPI.load()
        named = [(name, t.detach() if hasattr(t, "detach") else t) for name, t in named_tensors.items()]
        fields: dict[str, Any] = {
            "serialized_named_tensors": [self._api.serialize(named) for _ in range(self._tp_size)],
            "load_format": None,
            "flush_cache": True,
        }
        try:
            update = self._api.UpdateWeightsFromTensorReqInput(**fields, weight_version=str(version))
        except TypeError:  # an SGLang from before weight versions (mid 2025)
            update = self._api.UpdateWeightsFromTensorReqInput(**fields)
        result = await self._tm.update_weights_from_tensor(update, None)
        success, message = result[0], result[1]
        if not success:
            raise EngineError(f"update_weights: SGLang did not load the weights: {message}")
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        rate = self._rate.per_second()
        running = sum(1 for req in self._live.values() if req.tokens)
        return EngineStats(
            running=running,
            waiting=len(self._waiting) + len(self._live) - running,
            tokens_per_s=rate,
            kv_cache_bytes=0 if self._asleep else self.kv_cache_bytes,
            weight_version=self._version,
            paused=self._paused,
            sleeping=bool(self._asleep),
            finished=self._finished,
            generated_tokens=self._rate.total,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in list(self._waiting):
            self._waiting.remove(req)
            self._end(req, "abort", _NO_TOKENS)
        live = list(self._live.values())
        for req in live:
            self._abort(req, "user")
        tasks = [req.task for req in live if req.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=10.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.to_thread(self.engine.shutdown)
        self._lora_files.close()


def _model_attr(engine: Any, name: str) -> Any:
    config = getattr(getattr(engine, "tokenizer_manager", None), "model_config", None)
    return getattr(config, name, None)


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter names and shapes of a Hugging Face folder's safetensors files (headers only),
    or None when it has none (a hub id, .bin weights): then weight updates go unchecked."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update(
            {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
        )
    return shapes


def kv_pool_bytes(engine: Any) -> int:
    """Bytes of SGLang's preallocated KV cache (K and V for every layer and token slot), from
    what its scheduler reported at start; 0 when the engine does not say. An estimate: it takes
    the model's dtype for the cache and the standard multi-head layout."""
    try:
        init = getattr(engine, "_scheduler_init_result", None)  # 2026; earlier: engine.scheduler_info
        info = init.scheduler_infos[0] if init is not None else engine.scheduler_info
        tokens = int(info["max_total_num_tokens"])
        config = engine.tokenizer_manager.model_config
        tp = int(getattr(engine.server_args, "tp_size", 1) or 1)
        per_token = (
            2
            * config.num_hidden_layers
            * config.get_num_kv_heads(tp)
            * tp
            * config.head_dim
            * config.dtype.itemsize
        )
        return tokens * int(per_token)
    except Exception:
        return 0


def engine_kwargs(config: SGLangEngineConfig) -> dict[str, Any]:
    """``sglang.Engine`` arguments (its ``ServerArgs`` fields) for an ``SGLangEngineConfig``:
    ``max_batch`` is ``max_running_requests``, ``tensor_parallel_size`` is ``tp_size``,
    ``cuda:N`` is ``base_gpu_id``; ``engine_kwargs`` (any other ``ServerArgs`` field) last."""
    device, _, index = config.device.partition(":")
    kwargs: dict[str, Any] = {
        "model_path": config.model,
        "dtype": config.dtype,
        "device": device,
        "skip_tokenizer_init": True,
        "random_seed": config.seed,
        "max_running_requests": config.max_batch,
        "tp_size": config.tensor_parallel_size,
    }
    if index:
        kwargs["base_gpu_id"] = int(index)
    if config.max_seq_len:
        kwargs["context_length"] = config.max_seq_len
    if config.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = config.mem_fraction_static
    return {**kwargs, **config.engine_kwargs}


async def build_sglang(
    config: SGLangEngineConfig, *, api: SGLangAPI | None = None, **extra: Any
) -> SGLangEngine:
    """An ``SGLangEngine`` for ``config`` (the ``sglang`` backend's factory). ``extra`` goes to
    ``sglang.Engine`` as is: ``mem_fraction_static``, ``enable_memory_saver``,
    ``enable_deterministic_inference`` (per-request seeds), ``attention_backend``, ...
    ``engine.cpu_threads`` does not apply."""
    if not config.model:
        raise EngineError("engine.model is empty: set it to a Hugging Face model folder on the engine's node")
    api = api or SGLangAPI.load()
    kwargs = {**engine_kwargs(config), **extra}
    # Loading the model blocks for a long while: off the event loop, so the node keeps answering.
    engine = await asyncio.to_thread(lambda: api.Engine(**kwargs))
    return SGLangEngine(
        engine,
        api=api,
        max_batch=config.max_batch,
        max_seq_len=config.max_seq_len or None,
        param_shapes=checkpoint_shapes(config.model),
        kv_cache_bytes=kv_pool_bytes(engine),
    )
