"""Profiles: a published setup (model shape, GPU figures, workload, the paper's phase times) as
the simulator's cost model, so a plan or a replay runs on the physics of a real cluster.

    profile = PROFILES["verl-qwen2.5-math-7b-h20"]
    cluster = SimCluster.of_profile(clock, profile, generation_gpus=64, trainer_gpus=64)   # rlasync.modes.sim
    rlasync plan configs/quickstart.yaml --gpus 128 --profile verl-qwen2.5-math-7b-h20

The decode roofline (``engines.sim.LatencyModel``) follows from the shape and the GPU: a step
reads the weights once (``base_s`` = weight bytes / bandwidth) and every running sequence's KV
cache (``per_context_token_s`` = KV bytes per token / bandwidth), both at ``decode_efficiency``
of the HBM bandwidth, plus ``step_overhead_s`` a step (kernel launches, the scheduler, sampling:
what bounds a small model's step at a small batch); the batch is capped by the KV cache left
beside the weights; a prefill costs ``2 N`` FLOPs a token at ``prefill_mfu``. The trainer's
phases take a fixed part plus GPU-seconds per token over its GPUs (``Phase``).

What a paper does not say is an assumption, written in ``assumptions``. ``benchmarks/replay_bench.py``
calibrates the step overhead (or, where even none is too slow, the efficiency) so that the
simulated sync step matches the paper's, and shows how the result moves with the lengths.
"""

from __future__ import annotations

import math
import random

import msgspec

from ..engines.sim import LatencyModel, LogNormalLengths


def lengths_moment(lengths: LogNormalLengths, n: int) -> float:
    """E[L^n] of ``lengths`` (a log-normal capped at ``cap``), in closed form."""
    mu, sigma, cap = math.log(lengths.median), lengths.sigma, lengths.cap
    if sigma == 0:
        return float(min(cap, lengths.median)) ** n
    z = (math.log(cap) - mu) / sigma
    below = 0.5 * (
        1 + math.erf((z - n * sigma) / math.sqrt(2))
    )  # E[L^n; L < cap] / e^(n mu + n^2 sigma^2 / 2)
    above = 0.5 * math.erfc(z / math.sqrt(2))  # P(L >= cap)
    return math.exp(n * mu + n * n * sigma * sigma / 2) * below + cap**n * above


class Hardware(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    memory_bytes: float  # HBM per GPU
    bandwidth: float  # HBM bytes/s per GPU
    flops: float  # dense bf16 FLOP/s per GPU
    link_bytes_per_s: float  # what one relay moves the weights at (the node's NIC)


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of every layer for one token."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer phase: ``fixed_s`` for every ``batch_rows`` trajectories (pro rata: the part
    more GPUs do not shorten, as a paper's phase times show it) plus ``gpu_s_per_token`` over
    the GPUs."""

    fixed_s: float = 0.0
    batch_rows: int = 1
    gpu_s_per_token: float = 0.0
    measured: bool = False
    """Fitted through a paper's measured phase times (``_fit_phase``): its per-token part stands
    for the paper's own tokens, so at other assumed lengths it is refitted to keep those times.
    False: costed from FLOPs, so a token costs the same whatever the lengths."""

    def seconds(self, tokens: float, rows: int, gpus: int) -> float:
        return self.fixed_s * rows / self.batch_rows + tokens * self.gpu_s_per_token / gpus


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """What the paper measured: its sync step (and that step's generation phase, 0 where not
    published), the split of its async run and the speedup it reports."""

    gpus: int
    sync_step_s: float
    sync_generation_s: float
    async_split: tuple[int, int]  # generation : training GPUs of the async run
    speedup: float


class ToolCalls(msgspec.Struct, frozen=True, kw_only=True):
    """An agentic workload's tool calls (``rlasync.modes.sim_tools``): how many a trajectory
    makes (geometric with mean ``mean_calls``, at most ``max_calls``; a model turn after each)
    and how long each takes (log-normal seconds: a sandbox, a search, a browser), with
    ``output_tokens`` of tool output joining the context."""

    mean_calls: float = 4.0
    max_calls: int = 16
    latency_median_s: float = 2.0
    latency_sigma: float = 1.0
    latency_cap_s: float = 120.0
    output_tokens: int = 256

    def calls(self, seed: int) -> int:
        """Tool calls of the trajectory seeded ``seed``."""
        if self.mean_calls <= 0:
            return 0
        stop = 1 / (1 + self.mean_calls)  # geometric on 0, 1, 2...: mean (1 - stop) / stop
        u = random.Random(seed).random()
        return min(self.max_calls, int(math.log(1 - u) / math.log(1 - stop)))

    def latency_s(self, seed: int) -> float:
        """Seconds of the call seeded ``seed``."""
        drawn = random.Random(seed).lognormvariate(math.log(self.latency_median_s), self.latency_sigma)
        return min(self.latency_cap_s, drawn)


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    source: str
    model: ModelShape
    hardware: Hardware
    engine_gpus: int = 1  # GPUs per engine (tensor parallel)
    decode_efficiency: float = 0.8
    """Fraction of the HBM bandwidth a decode step's reads reach (assumed: ~0.8 is what tuned
    attention and GEMV kernels reach); ``replay_bench`` lowers it only where no overhead fits."""
    step_overhead_s: float = 0.0
    """Seconds a decode step costs beside its reads; ``replay_bench`` fits it."""
    per_seq_s: float = 20e-6
    """Per sequence and step beside its KV read (sampling, the scheduler): assumed."""
    max_batch: int = 256
    memory_utilization: float = 0.85
    prefill_mfu: float = 0.4
    prompts: int = 512
    group: int = 16
    prompt_tokens: int = 256
    lengths: LogNormalLengths = LogNormalLengths()
    update: Phase = Phase()
    logprob: Phase = Phase()
    """The trainer's recomputation of the old logprobs (verl's ``old_log_prob``), where the
    schedule asks for it (colocated sync in verl; AReaL's decoupled PPO)."""
    published: tuple[Published, ...] = ()
    assumptions: tuple[str, ...] = ()
    tools: ToolCalls | None = None
    """An agentic workload: each trajectory's model turns (``lengths`` each) are separated by
    tool calls of drawn latency (``rlasync.modes.sim_tools``); None: one turn."""

    def latency(self) -> LatencyModel:
        bandwidth = self.engine_gpus * self.hardware.bandwidth * self.decode_efficiency
        free = (
            self.engine_gpus * self.hardware.memory_bytes * self.memory_utilization - self.model.weight_bytes
        )
        return LatencyModel(
            base_s=self.model.weight_bytes / bandwidth + self.step_overhead_s,
            per_seq_s=self.per_seq_s,
            per_context_token_s=self.model.kv_bytes_per_token / bandwidth,
            max_batch=self.max_batch,
            kv_capacity_tokens=max(0, int(free / self.model.kv_bytes_per_token)),
            prefill_per_token_s=2
            * self.model.params
            / (self.engine_gpus * self.hardware.flops * self.prefill_mfu),
            # An in-place copy of the weights at half the HBM bandwidth, plus the loader's call
            # per parameter tensor (~20 ms for a few hundred tensors): assumed.
            swap_s=self.model.weight_bytes / (self.engine_gpus * self.hardware.bandwidth * 0.5) + 0.02,
        )

    def sync_s(self) -> float:
        """Seconds the weights take through one relay (the engines pull in parallel)."""
        return self.model.weight_bytes / self.hardware.link_bytes_per_s

    def mean_tokens_per_step(self) -> float:
        """Prompt and response tokens of one step on average."""
        return self.prompts * self.group * (self.prompt_tokens + lengths_moment(self.lengths, 1))

    def calibrated(self, *, decode_efficiency: float, step_overhead_s: float) -> Profile:
        return msgspec.structs.replace(
            self, decode_efficiency=decode_efficiency, step_overhead_s=step_overhead_s
        )

    def with_lengths(self, lengths: LogNormalLengths) -> Profile:
        """The profile with other answer lengths. Phases fitted through measured times keep
        those times (their GPU-seconds per token refitted to the new mean); phases costed
        from FLOPs keep their cost per token, so they take longer with longer answers."""
        scale = (
            self.mean_tokens_per_step()
            / msgspec.structs.replace(self, lengths=lengths).mean_tokens_per_step()
        )

        def phase(p: Phase) -> Phase:
            return msgspec.structs.replace(p, gpu_s_per_token=p.gpu_s_per_token * scale) if p.measured else p

        return msgspec.structs.replace(
            self, lengths=lengths, update=phase(self.update), logprob=phase(self.logprob)
        )

    def shrunk(self, factor: int) -> Profile:
        """The same setup at 1/``factor`` the size: a step's prompts (and the rows a phase's
        fixed part is for) divided by ``factor``; run it on 1/``factor`` the GPUs. Each GPU's
        load and each step's time stay, and so does the longest answer where the cap binds
        (it does in both published setups: over 1 % of the answers reach it)."""
        if factor == 1:
            return self
        if self.prompts % factor:
            raise ValueError(f"{self.name}: {self.prompts} prompts a step do not divide by {factor}")

        def phase(p: Phase) -> Phase:
            return msgspec.structs.replace(p, batch_rows=max(1, p.batch_rows // factor))

        return msgspec.structs.replace(
            self, prompts=self.prompts // factor, update=phase(self.update), logprob=phase(self.logprob)
        )


def _fit_phase(points: dict[int, float], tokens: float, rows: int) -> Phase:
    """A phase through two measured (gpus, seconds) points of steps of ``rows`` trajectories
    and ``tokens`` tokens."""
    (g1, t1), (g2, t2) = sorted(points.items())
    per_gpu = (t1 - t2) / (1 / g1 - 1 / g2)  # GPU-seconds of the step
    return Phase(
        fixed_s=max(0.0, t2 - per_gpu / g2), batch_rows=rows, gpu_s_per_token=per_gpu / tokens, measured=True
    )


H20 = Hardware(name="H20", memory_bytes=96e9, bandwidth=4.0e12, flops=148e12, link_bytes_per_s=50e9)
H800 = Hardware(name="H800", memory_bytes=80e9, bandwidth=3.35e12, flops=989e12, link_bytes_per_s=50e9)
QWEN25_MATH_7B = ModelShape(name="Qwen2.5-Math-7B", params=7.6e9, layers=28, kv_heads=4, head_dim=128)
R1_DISTILL_15B = ModelShape(
    name="DeepSeek-R1-Distill-Qwen-1.5B", params=1.78e9, layers=28, kv_heads=2, head_dim=128
)

# verl's fully_async_policy table (docs/advance/fully_async.md): colocated sync on 128 H20,
# step 356.30 s = gen 177.85 + old_log_prob 53.92 + update_actor 113.81; at 64 GPUs 365.28 =
# 150.72 + 70.26 + 133.41. The trainer's phases are fitted through those two points.
_VERL_LENGTHS = LogNormalLengths(median=2000, sigma=1.0, cap=28672)
_VERL_BASE = Profile(
    name="verl-qwen2.5-math-7b-h20",
    source="verl-project/verl docs/advance/fully_async.md (Qwen2.5-Math-7B, DAPO, 128 H20)",
    model=QWEN25_MATH_7B,
    hardware=H20,
    prompts=512,
    group=16,
    prompt_tokens=200,
    lengths=_VERL_LENGTHS,
    published=(
        Published(gpus=128, sync_step_s=356.30, sync_generation_s=177.85, async_split=(64, 64), speedup=2.35),
        Published(gpus=64, sync_step_s=365.28, sync_generation_s=150.72, async_split=(32, 32), speedup=1.92),
        Published(gpus=32, sync_step_s=790.10, sync_generation_s=357.41, async_split=(16, 16), speedup=2.66),
    ),
    assumptions=(
        "response lengths log-normal, median 2,000, sigma 1.0, capped at 28,672 (the paper gives only the cap; of medians 1,500, 2,000 and 3,000 this one replays their settings nearest their 2.35x)",
        "prompts of 200 tokens; one engine per GPU (tensor parallel 1)",
        "the trainer's update and log-prob phases: fixed + per-token, through the paper's 64- and 128-GPU sync rows",
        "weights move at 50 GB/s (one 400 Gb/s NIC) per relay; an engine's swap is a copy at half the HBM bandwidth + 20 ms",
    ),
)
_VERL_TOKENS = _VERL_BASE.mean_tokens_per_step()
VERL_7B = msgspec.structs.replace(
    _VERL_BASE,
    update=_fit_phase({64: 133.41, 128: 113.81}, _VERL_TOKENS, 512 * 16),
    logprob=_fit_phase({64: 70.26, 128: 53.92}, _VERL_TOKENS, 512 * 16),
)

# AReaL (arXiv 2505.24298): R1-Distill-Qwen-1.5B, 1,000 PPO steps on 16 nodes (128 H800): sync
# 41.0 h (147.6 s a step), async with interruptible generation and eta = 4: 14.8 h (2.77x). The
# paper gives no phase times: the trainer is costed from FLOPs (6 N a token for the update and
# 2 N for the decoupled PPO's proximal log-probs, at an assumed MFU), so the calibration fits
# the generation to the rest of the step.
_AREAL_MFU = 0.3
_AREAL = Profile(
    name="areal-r1-distill-1.5b-h800",
    source="arXiv 2505.24298 (AReaL), Table 2: 1.5B, 16 nodes, 41.0 h -> 14.8 h",
    model=R1_DISTILL_15B,
    hardware=H800,
    prompts=512,
    group=16,
    prompt_tokens=200,
    lengths=LogNormalLengths(median=2500, sigma=0.8, cap=27648),
    update=Phase(
        fixed_s=5.0,
        batch_rows=512 * 16,
        gpu_s_per_token=6 * R1_DISTILL_15B.params / (H800.flops * _AREAL_MFU),
    ),
    logprob=Phase(
        fixed_s=2.0,
        batch_rows=512 * 16,
        gpu_s_per_token=2 * R1_DISTILL_15B.params / (H800.flops * _AREAL_MFU),
    ),
    published=(
        Published(gpus=128, sync_step_s=147.6, sync_generation_s=0.0, async_split=(96, 32), speedup=2.77),
    ),
    assumptions=(
        "512 prompts x 16 answers a step and answers up to 27,648 tokens (the paper's math setup, as we read it)",
        "response lengths log-normal, median 2,500, sigma 0.8, capped at 27,648 (the paper gives only the cap; of medians 2,000, 2,500, 3,000 and 5,000 this one replays their settings nearest their 2.77x: 2.98x, 2.79x, 2.42x, 1.55x)",
        "the trainer at 30 % MFU, 6N FLOPs a token to update and 2N to recompute log-probs, + 5 s and 2 s a step",
        "AReaL's async split 96:32 (three quarters generating, the paper's default); eta = 4 is async_training.staleness_threshold=4 at trigger 1",
        "no phase times are published: the calibration fits the decode efficiency to the whole sync step",
    ),
)

# No paper: a plain planning default. An 8B model (Llama-3.1-8B's shape) on H100s, answers as
# modes_bench's workload (median 2,000, sigma 0.8, cap 16,000), the trainer at 40 % MFU.
H100 = Hardware(name="H100", memory_bytes=80e9, bandwidth=3.35e12, flops=989e12, link_bytes_per_s=50e9)
LLAMA_8B = ModelShape(name="Llama-3.1-8B", params=8.03e9, layers=32, kv_heads=8, head_dim=128)
_GENERIC_MFU = 0.4
GENERIC_8B = Profile(
    name="generic-8b-h100",
    source="no paper: an 8B model on H100s, for planning",
    model=LLAMA_8B,
    hardware=H100,
    step_overhead_s=0.001,
    prompts=32,
    group=16,
    prompt_tokens=200,
    lengths=LogNormalLengths(median=2000, sigma=0.8, cap=16000),
    update=Phase(
        fixed_s=1.0, batch_rows=512, gpu_s_per_token=6 * LLAMA_8B.params / (H100.flops * _GENERIC_MFU)
    ),
    logprob=Phase(
        fixed_s=0.3, batch_rows=512, gpu_s_per_token=2 * LLAMA_8B.params / (H100.flops * _GENERIC_MFU)
    ),
    assumptions=(
        "reads at 0.8 of the HBM bandwidth and 1 ms a decode step beside them",
        "the trainer at 40 % MFU (6N FLOPs a token to update, 2N to recompute log-probs), + 1 s and 0.3 s per 512 trajectories",
    ),
)

# An agentic variant for planning: the same physics, shorter turns between tool calls (a
# sandbox or a search: median 2 s, sigma 1.0, at most 120 s; 4 calls a trajectory on average).
GENERIC_8B_AGENT = msgspec.structs.replace(
    GENERIC_8B,
    name="generic-8b-h100-agent",
    source="no paper: an 8B model on H100s, a multi-turn tool-using workload, for planning",
    lengths=LogNormalLengths(median=500, sigma=0.8, cap=4000),
    tools=ToolCalls(),
    assumptions=(
        *GENERIC_8B.assumptions,
        "turns of median 500 tokens (sigma 0.8, cap 4,000) between tool calls: 4 a trajectory on average "
        "(geometric, at most 16), each taking a log-normal 2 s (sigma 1.0, cap 120 s) and answering 256 tokens",
    ),
)

PROFILES: dict[str, Profile] = {p.name: p for p in (GENERIC_8B, GENERIC_8B_AGENT, VERL_7B, _AREAL)}


__all__ = [
    "PROFILES",
    "Hardware",
    "ModelShape",
    "Phase",
    "Profile",
    "Published",
    "ToolCalls",
    "lengths_moment",
]
