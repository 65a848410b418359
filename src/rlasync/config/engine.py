"""Settings of the inference engines (``engine.*``) and of the router in front of them (``router.*``).

``engine`` is a union tagged by ``backend``: ``EngineConfig`` holds what every engine takes and
is, by itself, the built-in torch engine (``backend: torch``, the default); each other backend's
class adds its own settings and checks (``VLLMEngineConfig``, ``SGLangEngineConfig``,
``SimEngineConfig``).

    engine: {backend: vllm, model: runs/nano, gpu_memory_utilization: 0.5}

A section that names no backend is the torch engine's (``with_backend``); a backend that does
not exist, or a setting another backend has, is refused naming the dotted path and what is
allowed (``engine_message``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from .errors import ConfigError

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]

DEFAULT_BACKEND = "torch"


class EngineConfig(
    msgspec.Struct, tag_field="backend", tag="torch", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """One inference engine, as an ``EngineActor`` builds it on its node (``engine.*``): the
    settings every backend takes, and by itself the torch engine (built in, CPU and CUDA)."""

    shards: ClassVar[bool] = False
    """Whether one replica may spread its model over several GPUs (``tensor_parallel_size``)."""

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
    """torch intra-op threads of the torch engine's worker thread on CPU (0: torch's default, one
    per core; vLLM and SGLang size their own). One is the default because a second OpenMP pool
    in the process (any torch op run on another thread starts one) makes both pools throttle
    each other: measured 3x slower decode steps at 2 threads on 2 cores, while one thread costs
    10-25% against an uncontended two. Raise it for larger models on machines with cores to spare."""

    offload_weights: bool = False
    """With ``cluster.colocate``: an engine asleep (during each train step) keeps its weights in
    host memory, not on its GPU (the torch engine; vLLM's sleep level 1, SGLang's weight release).
    On a CPU the weights are in host memory already."""

    @property
    def backend(self) -> str:
        """Which engine serves (the tag: ``torch``, ``vllm``, ``sglang`` or ``sim``)."""
        return str(type(self).__struct_config__.tag)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size > 1 and not self.shards:
            raise ValueError(
                "engine.tensor_parallel_size > 1 needs engine.backend vllm or sglang (the torch engine runs on one device)"
            )


class VLLMEngineConfig(EngineConfig, tag="vllm", frozen=True):
    """vLLM's ``AsyncLLM`` in the node's process (``rlasync.engines.vllm``)."""

    shards: ClassVar[bool] = True

    gpu_memory_utilization: Fraction = 0.9
    """The fraction of each of its GPUs' memory the engine may take (weights, activations and
    the KV cache). Lower it when a trainer rank shares the GPU."""

    max_lora_rank: NonNegativeInt = 0
    """vLLM's LoRA support on (``enable_lora``) for adapters of up to this rank, the ones a LoRA
    run's weight sync sends (``trainer.lora.sync: adapter``); the run sets it from
    ``trainer.lora.rank``. 0: off."""

    sleep_mode: bool = False
    """vLLM's sleep mode (``enable_sleep_mode``: its GPU memory can be released and taken back),
    which ``cluster.colocate`` needs and sets; GPUs only."""

    engine_kwargs: dict[str, Any] = {}
    """Further fields of vLLM's ``AsyncEngineArgs``, passed as they are, after the settings
    above (so they win): ``{max_num_batched_tokens: 4096, enable_prefix_caching: false}``."""


class SGLangEngineConfig(EngineConfig, tag="sglang", frozen=True):
    """SGLang's offline ``Engine`` in the node's process (``rlasync.engines.sglang``)."""

    shards: ClassVar[bool] = True

    mem_fraction_static: Fraction | None = None
    """The fraction of GPU memory for the weights and the KV pool; None: SGLang's default."""

    engine_kwargs: dict[str, Any] = {}
    """Further fields of SGLang's ``ServerArgs``, passed as they are, after the settings above
    (so they win): ``{attention_backend: triton, enable_deterministic_inference: true}``."""


class SimEngineConfig(EngineConfig, tag="sim", frozen=True):
    """A simulated GPU (``rlasync.engines.sim.SimEngine``: decoding time from a model, no
    network) on the wall clock, for planning and for measuring the runtime without model compute.
    A step of ``b`` sequences (``b <= max_batch``) takes ``base_s + per_seq_s * b`` simulated
    seconds; response lengths are log-normal."""

    # Replicas are placed as GPU engines would be: tensor_parallel_size only moves their devices.
    shards: ClassVar[bool] = True

    base_s: NonNegative = 0.015
    """Simulated seconds of a decoding step, whatever its batch."""

    per_seq_s: NonNegative = 0.00015
    """Simulated seconds a step takes more for each sequence in it."""

    median: Positive = 2000.0
    """Median response length, in tokens (a request's length is drawn from its seed, so a
    re-submitted turn that was cut goes on to the same end)."""

    sigma: NonNegative = 0.8
    """Sigma of the log-normal response lengths."""
    cap: PositiveInt = 16000
    """The longest response, in tokens."""

    token_block: PositiveInt = 1
    """Tokens one simulated token stands for: the step time is multiplied by it, which keeps
    the Python work per simulated second small; the counts the engine reports are real tokens."""

    scale: Positive = 1.0
    """Wall seconds per simulated second. The schedulers' own Python work takes simulated time
    too: keep it large enough that this work is small against a step."""


AnyEngineConfig = EngineConfig | VLLMEngineConfig | SGLangEngineConfig | SimEngineConfig
"""What an ``engine:`` section decodes into: the class its ``backend`` names."""

BACKENDS: dict[str, type[EngineConfig]] = {
    str(cls.__struct_config__.tag): cls
    for cls in (EngineConfig, VLLMEngineConfig, SGLangEngineConfig, SimEngineConfig)
}
"""Each engine backend's settings, by name."""


def with_backend(section: Any) -> Any:
    """An engine section as plain data, with ``backend: torch`` where it names none (the tag
    tells the union which class to read the rest into)."""
    if isinstance(section, dict) and "backend" not in section:
        return {"backend": DEFAULT_BACKEND, **section}
    return section


def engine_message(message: str, section: Any) -> str:
    """msgspec's ``message`` about the ``engine`` section (paths written ``engine.x``), said in
    terms of backends where it is about one: a backend that does not exist, or a setting that
    belongs to another backend."""
    backend = section.get("backend", DEFAULT_BACKEND) if isinstance(section, dict) else None
    if message.startswith("Invalid value") and message.endswith("- at `engine.backend`"):
        return f"engine.backend={backend!r} is not an engine backend (the backends: {', '.join(BACKENDS)})"
    prefix = "Object contains unknown field `"
    if message.startswith(prefix) and message.endswith("` - at `engine`") and backend in BACKENDS:
        field = message[len(prefix) : message.index("`", len(prefix))]
        owners = [name for name, cls in BACKENDS.items() if field in cls.__struct_fields__]
        if owners:
            return f"`engine.{field}` is a setting of engine.backend {' or '.join(owners)}, not of {backend}"
        allowed = ", ".join(sorted(BACKENDS[backend].__struct_fields__))
        return f"unknown field `engine.{field}`; engine.backend {backend} takes {allowed}"
    return message


class _Section(msgspec.Struct):
    engine: AnyEngineConfig


def engine_settings(section: Any) -> EngineConfig:
    """An engine section given as plain data (a remote spawn's argument, or settings built from
    command-line options) as its backend's class; ``ConfigError`` names what is wrong, as the
    config loader would."""
    try:
        return msgspec.convert({"engine": with_backend(section)}, _Section).engine
    except msgspec.ValidationError as exc:
        message = str(exc).replace("`$.", "`")
        raise ConfigError(f"invalid config: {engine_message(message, section)}") from None


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

    rebalance_queued: bool = False
    """Queued turns even out (``rlasync.engines.repack``): at each load refresh, an engine with
    turns waiting in its own queue (past its ``max_batch``) hands this router's newest ones to
    the least loaded engine, until the two are within one of each other. A queued turn has made
    no token, so the move costs nothing; without it, the engine that drew the longer answers
    still has a queue when the others run out of work."""

    repack_below: NonNegativeInt = 0
    """Long-tail repacking (``rlasync.engines.repack``): at each load refresh, while requests
    wait (at this router's cap or in an engine's queue), engines running at most this many of
    this router's turns hand them to the fullest such engine (``Router.migrate``: the turns
    keep their tokens and versions; the target prefills them) and take new work. 0: off."""

    repack_target_max: PositiveInt = 64
    """The most turns repacking puts on one tail engine."""
