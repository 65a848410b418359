"""Settings of the inference engines (``engine.*``) and of the router in front of them (``router.*``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One inference engine, as an ``EngineActor`` builds it on its node (``engine.*``)."""

    backend: str = "torch"
    """Which engine serves: ``torch`` (built in, CPU and CUDA), or one registered with
    ``rlasync.engines.register_backend`` (vLLM and SGLang register themselves)."""

    model: str = ""
    """A Hugging Face causal-LM directory on the engine's node (config, weights, tokenizer).
    Training configs fill it in (the warm-started tiny model, or your checkpoint)."""

    device: str = "cpu"
    """Where the engine runs: ``cpu``, ``cuda`` or ``cuda:N`` (its first GPU). With ``cuda`` and
    several replicas on one node, replica ``j`` of that node takes GPUs from
    ``j * tensor_parallel_size`` on (the trainer ranks of the node take the GPUs after them)."""

    tensor_parallel_size: PositiveInt = 1
    """GPUs one replica shards its model over (vLLM's ``tensor_parallel_size``, SGLang's
    ``tp_size``); the torch engine uses one device."""

    gpu_memory_utilization: Fraction = 0.9
    """vLLM: the fraction of each of its GPUs' memory the engine may take (weights, activations
    and the KV cache). Lower it when a trainer rank shares the GPU."""

    mem_fraction_static: Fraction | None = None
    """SGLang: the fraction of GPU memory for the weights and the KV pool; None: SGLang's default."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype; ``auto`` keeps the checkpoint's (float32 for the tiny models)."""

    max_batch: PositiveInt = 64
    """Sequences decoded together in one step (continuous batching fills it as requests finish):
    vLLM's ``max_num_seqs``, SGLang's ``max_running_requests``."""

    max_seq_len: NonNegativeInt = 0
    """Prompt plus response limit per sequence; 0 takes the model's ``max_position_embeddings``."""

    seed: int = 0
    """Seed of the engine's shared random generator (requests without a seed of their own)."""

    cpu_threads: NonNegativeInt = 1
    """torch intra-op threads of the engine's worker thread on CPU (0: torch's default, one
    per core). One is the default because a second OpenMP pool in the process (any torch op
    run on another thread starts one) makes both pools throttle each other: measured 3x
    slower decode steps at 2 threads on 2 cores, while one thread costs 10-25% against an
    uncontended two. Raise it for larger models on machines with cores to spare."""

    engine_kwargs: dict[str, Any] = {}
    """Further arguments for the backend's engine, passed as they are: fields of vLLM's
    ``AsyncEngineArgs`` or SGLang's ``ServerArgs`` (verl's ``engine_kwargs``), or the ``sim``
    backend's ``base_s``, ``per_seq_s``, ``median``, ``sigma``, ``cap``, ``scale``."""


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How requests are spread over engine actors (``router.*``)."""

    max_inflight_per_engine: NonNegativeInt = 256
    """Requests this router keeps outstanding on one engine; more wait for a free slot.
    0 means no cap."""

    queue_timeout_s: PositiveSeconds = 600.0
    """Longest wait for a free engine slot before ``RouterBusyError``."""

    request_timeout_s: PositiveSeconds = 1800.0
    """Deadline of one generate call on an engine (long generations need a long one);
    for a stream, the longest wait for its next chunk."""

    sticky_sessions: NonNegativeInt = 100_000
    """Conversations remembered for stickiness (every turn of one session goes to the same
    engine, so its prefix cache is reused); least recently used ones are forgotten. 0 turns
    stickiness off."""

    on_engine_lost: Literal["retry", "fail"] = "retry"
    """When an engine's node dies: ``retry`` sends its in-flight requests to another engine
    (from the start), ``fail`` raises ``EngineLostError`` to their callers."""

    max_retries: NonNegativeInt = 2
    """How many times one request may be moved to another engine after losses."""

    load_refresh_s: PositiveSeconds = 1.0
    """How often the router asks each engine for its load (requests other routers placed
    there count too) and checks that it is alive."""
