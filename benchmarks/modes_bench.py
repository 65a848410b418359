"""The three schedules compared, in one run: on a simulated 32-GPU cluster and on the real tiny
model on this machine's 2 cores.

    .venv/bin/python benchmarks/modes_bench.py [--scale 0.01] [--check-scale] [--real-steps 60] [--real-repeats 3] [--skip-sim] [--smoke]

**Simulated cluster** (``rlasync.modes.sim``: simulated GPUs behind the real engine actors,
router, agent loops, rollouter, queue and controllers; the trainer's step and the weight sync
take modelled times). Sync uses all 32 GPUs for generation, then training (colocated); the
async modes split them 16 : 16. For each mode: steps/hour (after the first sync period, in
simulated time), the GPU busy fraction, the mode's own ideal (an analytic bound with zero
idle time on the workload the run actually drew, its formula printed) and how close the mode
came to it, and the fraction of the **pooled ideal**: every GPU busy at a full batch and
nothing paused, ``T x ((a + c*256)/256 + 1/r) / 32`` for the run's tokens T, the same bound
for every schedule. The simulator charges what real engines pay to take a version: the
transfer (engines decode meanwhile), each engine's swap, and the prefill of every turn cut.
Fully async runs four ways (``async_training.interrupt``, ``commit``): keep (the default:
turns go on across the swap), abort (cut and re-prefilled), drain (finish first), and
``commit=together`` abort (the old global pause: every engine stopped for the whole sync).
``--check-scale`` runs the simulation again at half the scale (twice as fast
against the wall clock) and prints how much the results moved.

**Real tiny model on 2 cores**: the quickstart task, the engine's process on core 0 and the
trainer's rank on core 1 (``taskset``, ``trainer.cpu_affinity``): sync against fully async wall
time for the same number of samples. Fully overlapped, async would take the longer of the two
phases, so its ideal on this workload is (generation + training) / max(generation, training),
from the sync run's phase times: 2x only when the two phases take equally long. The pair runs
``--real-repeats`` times, alternating, and the median ratio is reported (the machines are shared).
A third run shares both cores between the roles (nothing pinned, the trainer in two data-parallel
ranks, ``SHARED``): whichever role has work takes both, so its ideal is 2x whatever the phases.

Last line JSON: ``{"sim_speedup_async_vs_sync", "sim_speedup_one_step_vs_sync", "sim_keep_gain_vs_together",
"sim_async_fraction_of_ideal", "sim_sync_fraction_of_ideal", "sim_<mode>_fraction_of_pooled_ideal"
(each schedule), "real_speedup_async_vs_sync", "real_speedup_shared_cores_vs_sync"}``; fully async is its default, ``interrupt=keep``.

**At scale** (``--gpus N``, e.g. 1024): N simulated GPUs of an 8B model on H100s (the
``generic-8b-h100`` profile's physics: decode steps that slow with context, KV-capped batches),
three quarters generating and a quarter training, N prompts x 16 a step, answers log-normal with
a heavy tail (median 4,000, sigma 1.0, cap 32,000), one step per version (k = 1) and every
token at most 2 versions old (eta = 2). Fully async with pulled versions, ``interrupt=keep`` and
long-tail repacking against the same with the global pause (``commit=together``,
``interrupt=abort``) at the same bound, on a virtual-time loop: the fraction of the pooled
ideal of each, their ratio, the most of the pooled ideal the 3:1 split allows whatever the
schedule (``Measure.split_ceiling``: the slower side busy all the time), token staleness p99,
and the wall time the simulator took per simulated hour. ``--check-scale`` then runs the first at half the GPUs twice, on virtual time
and against the wall clock (one simulated second per ``--wall-scale`` s), so the head's own
work counts: how far the figures move, the process's CPU per trajectory (the head, the agent
loops and the simulated GPUs all run in it), trajectories and turns it handles per second, and
its loop lag from the first step to the last (how late a 10 ms timer wakes). JSON keys:
``{"scale_gpus", "scale_fraction_of_pooled", "scale_together_fraction_of_pooled", "scale_split_ceiling",
"scale_gain_vs_together", "scale_staleness_p99", "scale_wall_s_per_sim_hour",
"scale_check_max_change", "scale_head_cpu_ms_per_trajectory", "scale_head_loop_lag_p99_ms",
"scale_head_loop_lag_max_ms", "scale_head_trajectories_per_s"}``.

``--smoke`` (for ``make test``; its figures mean nothing): two simulated steps of each mode, 16
samples a step, and one real pair of 2 steps of a few short trajectories from an untrained
model, every run drawing its prompts from 64 synthetic problems (not 20,000).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from rlasync.config import Config, load_config
from rlasync.engines.sim import LatencyModel, LogNormalLengths, SimClock, VirtualTimeLoop
from rlasync.modes.sim import SimCluster, train_run

ROOT = Path(__file__).resolve().parents[1]
LATENCY = LatencyModel(base_s=0.015, per_seq_s=0.00015, max_batch=256)  # prefill and swap: its defaults
LENGTHS = LogNormalLengths(median=2000, sigma=0.8, cap=16000)
GPUS, PROMPTS, GROUP, TRAIN_RATE, SYNC_S, BLOCK = 32, 32, 16, 10_000.0, 1.0, 16
# Four steps per weight version (verl's recipe). The bound is exact per token, so it must leave a
# long response time to finish: the longest (16,000 tokens) takes 16,000 decoding steps, about
# 850 s at a full batch, which is many trainer steps. Measured with partial rollouts, before the
# simulator charged swaps and re-prefills (160 steps, the first 60 left out): staleness 4 -> 0.87
# of the ideal (the trainer waits for the tail at its deadline and the GPUs drain), 5 -> 0.90,
# 6 -> 0.94 and 167 steps/h, 8 -> 0.84 (a pipeline that long has not settled in 160 steps).
# 6: tokens at most 6 versions (24 steps) old.
ASYNC = {"trigger_parameter_sync_step": 4, "staleness_threshold": 6.0, "require_batches": 1}
# --smoke: 64 synthetic problems to draw prompts from, not 20,000 (making them took ~0.4 s a run).
SMOKE_DATA = ["data.synthetic_train_size=64"]
# --smoke's real runs: a few short trajectories a step, a few prompts to validate; what remains
# is mostly the processes' start-up.
REAL_SMOKE = [
    "train.prompts_per_step=2",
    "train.group_size=2",
    "train.max_new_tokens=8",
    "train.val_size=4",
    *SMOKE_DATA,
]
# --smoke: SMOKE_DATA for the simulated runs too.
SIM_EXTRA: list[str] = []


class Mode(msgspec.Struct, kw_only=True):
    key: str  # in the JSON line's keys
    label: str
    mode: str
    steps: int
    warmup: int  # steps left out of the rate (the pipeline filling)
    interrupt: str = "keep"
    commit: str = "each"
    trigger: int = 1


def _fully_async(interrupt: str, commit: str = "each") -> Mode:
    # 160 steps, the first 60 left out: the bound lets the pipeline hold about 28 steps of samples.
    together = ", together" if commit == "together" else ""
    return Mode(
        key=f"fully_async_{commit + '_' if commit == 'together' else ''}{interrupt}",
        label=f"fully async, {interrupt}{together} (16:16)",
        mode="fully_async",
        steps=160,
        warmup=60,
        interrupt=interrupt,
        commit=commit,
        trigger=int(ASYNC["trigger_parameter_sync_step"]),
    )


MODES = [
    Mode(key="sync", label="sync (32 colocated)", mode="sync", steps=4, warmup=0),
    Mode(key="one_step_off", label="one-step-off (16:16)", mode="one_step_off", steps=6, warmup=1),
    _fully_async("keep"),
    _fully_async("abort"),
    _fully_async("drain"),
    _fully_async("abort", "together"),  # the old behaviour: every engine stopped for the whole sync
]
ASYNC_KEEP, TOGETHER = "fully_async_keep", "fully_async_together_abort"


def sim_config(mode: Mode, run_dir: str) -> Config:
    max_new = -(-LENGTHS.cap // BLOCK)  # simulated tokens: each stands for BLOCK tokens
    overrides = [
        f"train.mode={mode.mode}",
        f"train.steps={mode.steps}",
        f"train.prompts_per_step={PROMPTS}",
        f"train.group_size={GROUP}",
        f"train.max_new_tokens={max_new}",
        f"agent.response_length={max_new + 64}",
        "train.validate_every=100000",
        f"train.run_dir={run_dir}",
        "train.model_dir=simulated",
        f"async_training.interrupt={mode.interrupt}",
        f"async_training.commit={mode.commit}",
        f"async_training.trigger_parameter_sync_step={mode.trigger}",
        f"async_training.staleness_threshold={ASYNC['staleness_threshold']}",
        f"async_training.require_batches={ASYNC['require_batches']}",
        f"async_training.max_concurrent_samples={ASYNC.get('max_concurrent_samples', 0)}",
        *SIM_EXTRA,
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", overrides)


def ideal_step_s(mode: Mode, record: dict[str, Any], batch: float | None = None) -> float:
    """The mode's own bound for one step with zero idle time, on the step's real workload.
    ``batch``: sequences a generation GPU decodes together (the async modes: the mean batch the
    staleness bound let the run keep; None: the most the hardware takes, 256)."""
    tokens = record["response_tokens"] * BLOCK  # real tokens generated and trained on
    longest = record["response_len_max"] * BLOCK
    a, c, h = LATENCY.base_s, LATENCY.per_seq_s, LATENCY.swap_s
    s = SYNC_S + 2 * h  # a sync: the transfer, then each half of the engines swaps in turn
    half = GPUS // 2
    if (
        mode.mode == "sync"
    ):  # all 32 generate (16 sequences each), the longest response alone last; then all train
        b = min(LATENCY.max_batch, PROMPTS * GROUP / GPUS)
        return max(longest * (a + c), tokens * (a / b + c) / GPUS) + tokens / (TRAIN_RATE * GPUS) + s
    if mode.mode == "one_step_off":  # 16 generate the next batch while 16 train on this one
        b = min(LATENCY.max_batch, PROMPTS * GROUP / half)
        return max(longest * (a + c), tokens * (a / b + c) / half, tokens / (TRAIN_RATE * half)) + s
    # The engines decode through the transfer and lose only their swap; the trainer waits for all.
    b = min(LATENCY.max_batch, batch or LATENCY.max_batch)
    return max(
        tokens * (a / b + c) / half + h / mode.trigger, tokens / (TRAIN_RATE * half) + s / mode.trigger
    )


def pooled_step_s(record: dict[str, Any]) -> float:
    """The pooled ideal of one step, the same for every schedule: its tokens made and trained on
    with every GPU busy at a full batch and nothing paused."""
    a, c, b = LATENCY.base_s, LATENCY.per_seq_s, LATENCY.max_batch
    return record["response_tokens"] * BLOCK * ((a + c * b) / b + 1 / TRAIN_RATE) / GPUS


FORMULAS = {
    "sync": "sum over steps of  max(L_max*(a+c), T*(a/b+c)/32) + T/(r*32) + s + 2h,  b = min(256, 512/32)",
    "one_step_off": "sum over steps of  max(max(L_max*(a+c), T*(a/b+c)/16), T/(r*16)) + s + 2h,  b = min(256, 512/16)",
    "fully_async": "sum over steps of  max(T*(a/b+c)/16 + h/trigger, T/(r*16) + (s + 2h)/trigger),  b = the mean batch the bound let the run keep (and b = 256: 'full batch')",
    "pooled (every mode)": "sum over steps of  T*((a + c*256)/256 + 1/r)/32: every GPU busy at a full batch, no pause",
}


async def simulate(mode: Mode, scale: float) -> dict[str, float]:
    clock = SimClock(scale)
    trainer_gpus = GPUS if mode.mode == "sync" else GPUS // 2
    engines = GPUS if mode.mode == "sync" else GPUS // 2
    with tempfile.TemporaryDirectory() as run_dir:
        config = sim_config(mode, run_dir)
        cluster = SimCluster(
            clock,
            engines=engines,
            trainer_gpus=trainer_gpus,
            latency=LATENCY,
            lengths=LENGTHS,
            token_block=BLOCK,
            tokens_per_s_per_gpu=TRAIN_RATE,
            sync_s=SYNC_S,
        )
        records: list[dict[str, Any]] = []
        start = clock.now()

        def on_step(record: dict[str, Any]) -> None:
            records.append(
                {
                    **record,
                    "sim_t": clock.now() - start,
                    "generated": sum(gpu.tokens for gpu in cluster.engines),
                }
            )

        await train_run(config, cluster, on_step=on_step)
        elapsed = clock.now() - start
        busy = cluster.generation_busy_s() + cluster.trainer.busy_s * trainer_gpus
        mean_batch = sum(g.batch_s for g in cluster.engines) / max(cluster.generation_busy_s(), 1e-9)
        gen_busy = cluster.generation_busy_s() / (engines * elapsed)
        stopped = sum(g.stopped_s for g in cluster.engines) / (engines * elapsed)
        prefill = sum(g.prefill_s for g in cluster.engines) / (engines * elapsed)
    first = records[mode.warmup - 1]["sim_t"] if mode.warmup else 0.0
    counted = records[mode.warmup :]
    measured = records[-1]["sim_t"] - first
    ideal = sum(ideal_step_s(mode, r, mean_batch) for r in counted)
    generated = records[-1]["generated"] - (records[mode.warmup - 1]["generated"] if mode.warmup else 0)
    trained = sum(r["response_tokens"] for r in counted) * BLOCK
    full = sum(ideal_step_s(mode, r) for r in counted)
    return {
        "steps_per_hour": len(counted) / measured * 3600,
        "gpu_busy": busy / (GPUS * elapsed),
        "fraction_of_ideal": ideal / measured,
        "fraction_of_pooled_ideal": sum(pooled_step_s(r) for r in counted) / measured,
        "stopped": stopped,
        "prefill": prefill,
        "ideal_steps_per_hour": len(counted) / ideal * 3600,
        "full_batch_steps_per_hour": len(counted) / full * 3600,
        "sim_s": elapsed,
        "mean_batch": mean_batch,
        "generation_busy": gen_busy,
        "generated_per_trained": generated / max(trained, 1),
    }


def run_sim(clock: str, scale: float) -> dict[str, dict[str, float]]:
    """Every mode on the simulated cluster, by its key: on a ``VirtualTimeLoop`` (the schedulers'
    own Python time costs no simulated time: exact at any scale) or against the wall clock.
    Each mode on a loop of its own: on one shared with the runs before it, a run's start-up
    took a different simulated time from one run of the benchmark to the next."""
    results = {}
    for mode in MODES:
        began = time.perf_counter()
        with asyncio.Runner(loop_factory=VirtualTimeLoop if clock == "virtual" else None) as runner:
            results[mode.key] = runner.run(simulate(mode, scale))
        results[mode.key]["wall_s"] = time.perf_counter() - began
    return results


def print_sim(results: dict[str, dict[str, float]], scale: float, clock_name: str) -> None:
    print(
        "(of ideal: steps/h over the ideal's; gen busy: generation GPUs' time with work; batch: their mean batch; full-batch/h: the ideal at 256;"
    )
    print(
        " gen/trained: tokens generated in the measured steps over those trained, 1 when the pipeline is steady;"
    )
    print(
        " of pooled: the pooled ideal's time over the mode's; paused, prefill: generation GPUs' time stopped for weights, prefilling)"
    )
    print(
        f"\n{'mode':36s} {'steps/h':>8s} {'ideal/h':>8s} {'of ideal':>9s} {'of pooled':>10s} {'GPU busy':>9s} {'gen busy':>9s} {'paused':>7s} {'prefill':>8s} {'batch':>6s} {'full-batch/h':>13s} {'gen/trained':>12s} {'sim s':>7s} {'wall s':>7s}   ({clock_name} clock, scale {scale:g})"
    )
    labels = {mode.key: mode.label for mode in MODES}
    for key, r in results.items():
        print(
            f"{labels[key]:36s} {r['steps_per_hour']:8.2f} {r['ideal_steps_per_hour']:8.2f} {r['fraction_of_ideal']:9.3f} {r['fraction_of_pooled_ideal']:10.3f} {r['gpu_busy']:9.3f} "
            f"{r['generation_busy']:9.3f} {r['stopped']:7.3f} {r['prefill']:8.3f} {r['mean_batch']:6.1f} {r['full_batch_steps_per_hour']:13.2f} {r['generated_per_trained']:12.3f} {r['sim_s']:7.0f} {r['wall_s']:7.1f}"
        )


# Both cores for both roles: nothing pinned, the trainer in two data-parallel ranks (one torch
# thread each), so whichever role has work takes both cores (a second torch thread per process
# costs more than it gives here: the torch engine's cpu_threads docstring).
SHARED = ["trainer.cpu_affinity=[]", "trainer.world_size=2"]


def real_run(
    mode: str, model_dir: Path, steps: int, out: Path, extra: list[str], *, shared: bool = False
) -> tuple[float, float, float]:
    """``steps`` RL steps of the quickstart (and ``extra`` overrides) in ``mode``, the controller
    (and the engine in it) on core 0, the trainer's rank on core 1: (wall seconds, of which
    generating, of which training; the last two only for sync, whose phases take turns)."""
    overrides = [
        f"train.mode={mode}",
        f"train.steps={steps}",
        f"train.model_dir={model_dir}",
        f"train.run_dir={out}",
        "train.validate_every=100000",
        "train.val_size=8",
        "trainer.cpu_affinity=[1]",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
        *extra,
        *(SHARED if shared else []),
    ]
    command = [
        "taskset",
        "-c",
        "0,1" if shared else "0",
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        *overrides,
    ]
    subprocess.run(
        command,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_only = [r for r in records if r["step"] > 0]
    # From the first step's start to the last step's end (validation left out).
    if mode != "sync":
        return sum(r["step_s"] for r in steps_only), 0.0, 0.0
    generating, training = sum(r["rollout_s"] for r in steps_only), sum(r["train_s"] for r in steps_only)
    return generating + training, generating, training


def real_runs(steps: int, repeats: int, *, smoke: bool = False) -> dict[str, float]:
    """Sync and fully async, alternating ``repeats`` times; the median pair's figures. From the
    quickstart's warm-started model; ``smoke``: from an untrained one, with ``REAL_SMOKE``."""
    from rlasync.compose.warmstart import warm_start
    from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:
            model_dir = save_pretrained_dir(
                *build_tiny_lm(TinyLMConfig.preset("nano", seed=0)), Path(tmp) / "nano"
            )
        else:
            model_dir = warm_start("reverse", run_dir=tmp, seed=1)
        extra = REAL_SMOKE if smoke else []
        for i in range(repeats):
            sync_s, generating, training = real_run("sync", model_dir, steps, Path(tmp) / f"sync{i}", extra)
            async_s, _, _ = real_run("fully_async", model_dir, steps, Path(tmp) / f"async{i}", extra)
            shared_s, _, _ = real_run(
                "fully_async", model_dir, steps, Path(tmp) / f"shared{i}", extra, shared=True
            )
            ideal = (generating + training) / max(generating, training)
            pairs.append(
                {
                    "sync_s": sync_s,
                    "async_s": async_s,
                    "speedup": sync_s / async_s,
                    "shared_speedup": sync_s / shared_s,
                    "ideal": ideal,
                    "generating_s": generating,
                    "training_s": training,
                }
            )
            print(
                f"  run {i + 1}: sync {sync_s:6.1f} s (generating {generating:5.1f} s, training {training:5.1f} s)   fully async {async_s:6.1f} s   "
                f"speedup {sync_s / async_s:.2f}x   ideal {ideal:.2f}x   shared cores {shared_s:6.1f} s, {sync_s / shared_s:.2f}x (ideal 2x)",
                flush=True,
            )
    return sorted(pairs, key=lambda pair: pair["speedup"])[len(pairs) // 2]


def simulated_cluster(args: argparse.Namespace) -> dict[str, float]:
    """The simulated cluster's part: its parameters, the table, and the summary's sim_* figures."""
    print("simulated cluster:")
    print(
        f"  {GPUS} GPUs; sync: all {GPUS} generate, then train (colocated); async modes: {GPUS // 2} generate : {GPUS // 2} train"
    )
    print(
        f"  {PROMPTS} prompts x {GROUP} samples per step; response lengths log-normal, median {LENGTHS.median:g}, sigma {LENGTHS.sigma}, capped at {LENGTHS.cap}"
    )
    print(
        f"  decode step of b sequences: a + c*b = {LATENCY.base_s * 1e3:g} ms + {LATENCY.per_seq_s * 1e3:g} ms * b, b <= {LATENCY.max_batch}"
    )
    print(
        f"  prefill {LATENCY.prefill_per_token_s * 1e6:.0f} us per token of context (every request's; a cut turn's again when re-submitted); h = {LATENCY.swap_s:g} s per engine to swap weights"
    )
    print(
        f"  training r = {TRAIN_RATE:,.0f} tokens/s per GPU; s = {SYNC_S:g} s per weight transfer (engines decode meanwhile); fully async: {ASYNC}"
    )
    print(
        f"  one simulated second per {args.scale * 1e3:g} ms of the event loop's {args.clock} clock; each simulated token stands for {BLOCK} (T: a step's tokens)"
    )
    for mode, formula in FORMULAS.items():
        print(f"  ideal, {mode}: {formula}")
    results = run_sim(args.clock, args.scale)
    print_sim(results, args.scale, args.clock)
    rate = {key: r["steps_per_hour"] for key, r in results.items()}
    summary: dict[str, float] = {
        "sim_speedup_async_vs_sync": rate[ASYNC_KEEP] / rate["sync"],
        "sim_speedup_one_step_vs_sync": rate["one_step_off"] / rate["sync"],
        "sim_keep_gain_vs_together": rate[ASYNC_KEEP] / rate[TOGETHER],
        "sim_async_fraction_of_ideal": results[ASYNC_KEEP]["fraction_of_ideal"],
        "sim_sync_fraction_of_ideal": results["sync"]["fraction_of_ideal"],
        **{
            f"sim_{key}_fraction_of_pooled_ideal": r["fraction_of_pooled_ideal"] for key, r in results.items()
        },
    }
    if args.check_scale:
        half = run_sim(args.clock, args.scale / 2)
        print_sim(half, args.scale / 2, args.clock)
        moved = max(abs(half[key]["steps_per_hour"] / rate[key] - 1) for key in results)
        print(f"at half the scale the steps/hour moved by at most {moved * 100:.1f} %")
        summary["sim_scale_check_max_change"] = moved
    return summary


def scale_config(gpus: int, commit: str, interrupt: str, repack: bool) -> Config:
    overrides = [
        "train.mode=fully_async",
        f"train.prompts_per_step={gpus}",
        "train.group_size=16",
        f"data.synthetic_train_size={max(64, 2 * gpus)}",
        "async_training.staleness_threshold=2",
        "async_training.trigger_parameter_sync_step=1",
        f"async_training.commit={commit}",
        f"async_training.interrupt={interrupt}",
        *([f"router.repack_below={REPACK_BELOW}", "router.load_refresh_s=10"] if repack else []),
    ]
    return load_config(ROOT / "configs" / "quickstart.yaml", overrides)


REPACK_BELOW = 4  # turns: an engine running this few while others wait hands them on


def at_scale(args: argparse.Namespace) -> dict[str, float]:
    """The ``--gpus`` part (module docstring)."""
    from rlasync.modes.plan import measure
    from rlasync.modes.profiles import PROFILES

    def run(gpus: int, commit: str, interrupt: str, repack: bool, wall_scale: float | None = None) -> Any:
        profile = msgspec.structs.replace(
            PROFILES["generic-8b-h100"],
            lengths=LogNormalLengths(median=4000, sigma=1.0, cap=32000),
            prompts=gpus,
        )
        began = time.perf_counter()
        result = measure(
            scale_config(gpus, commit, interrupt, repack),
            profile,
            generation_gpus=gpus * 3 // 4,
            trainer_gpus=gpus - gpus * 3 // 4,
            steps=args.scale_steps,
            warmup=args.scale_steps // 3,
            wall_scale=wall_scale,
        )
        wall = time.perf_counter() - began
        simulated = result.step_s * args.scale_steps
        clock = f"wall clock x{wall_scale:g}" if wall_scale else "virtual"
        print(
            f"  {gpus} GPUs, {commit}/{interrupt}{' + repack' if repack else ''} ({clock}): {result.steps_per_hour:.1f} steps/h, "
            f"of pooled {result.fraction_of_pooled:.3f} (the split allows {result.split_ceiling:.3f}), staleness p50/p99 {result.staleness_p50}/{result.staleness_p99}, "
            f"trainer busy {result.trainer_busy:.2f}, generation busy {result.generation_busy:.2f}; {wall:.0f} s wall "
            f"= {wall / simulated * 3600:.0f} s per simulated hour",
            flush=True,
        )
        return result, wall / simulated * 3600

    gpus = args.gpus
    print(
        f"at scale: {gpus} simulated GPUs ({gpus * 3 // 4} generating, {gpus - gpus * 3 // 4} training), {gpus} prompts x 16 a step, k = 1, eta = 2:"
    )
    ours, per_hour = run(gpus, "each", "keep", True)
    together, _ = run(gpus, "together", "abort", False)
    summary = {
        "scale_gpus": float(gpus),
        "scale_fraction_of_pooled": ours.fraction_of_pooled,
        "scale_together_fraction_of_pooled": together.fraction_of_pooled,
        "scale_split_ceiling": ours.split_ceiling,
        "scale_gain_vs_together": ours.steps_per_hour / together.steps_per_hour,
        "scale_staleness_p99": float(ours.staleness_p99),
        "scale_wall_s_per_sim_hour": per_hour,
    }
    if args.check_scale:
        half = max(4, gpus // 2)
        virtual, _ = run(half, "each", "keep", True)
        wall, _ = run(half, "each", "keep", True, wall_scale=args.wall_scale)
        moved = max(
            abs(wall.steps_per_hour / virtual.steps_per_hour - 1),
            abs(wall.fraction_of_pooled / virtual.fraction_of_pooled - 1),
        )
        head = wall.head
        print(
            f"  against the wall clock the figures moved by {moved * 100:.1f} %; the simulator's process (head, loops and simulated GPUs in one): {head.cpu_ms_per_trajectory:.3f} ms of CPU "
            f"per trajectory, {head.trajectories_per_s:.0f} trajectories and {head.turns_per_s:.0f} turns a second, loop lag "
            f"p99 {head.loop_lag_p99_ms:.1f} ms, max {head.loop_lag_max_ms:.1f} ms"
        )
        summary |= {
            "scale_check_max_change": moved,
            "scale_head_cpu_ms_per_trajectory": head.cpu_ms_per_trajectory,
            "scale_head_loop_lag_p99_ms": head.loop_lag_p99_ms,
            "scale_head_loop_lag_max_ms": head.loop_lag_max_ms,
            "scale_head_trajectories_per_s": head.trajectories_per_s,
        }
    print(
        f"  goals: of pooled {ours.fraction_of_pooled:.3f} >= 0.9; {summary['scale_gain_vs_together']:.2f}x >= 1.5x the global pause; "
        f"staleness p99 {ours.staleness_p99} <= 2; {per_hour:.0f} s <= 600 s of wall per simulated hour"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=0.01, help="event-loop seconds per simulated second")
    parser.add_argument(
        "--clock",
        choices=["virtual", "wall"],
        default="virtual",
        help="virtual: the loop jumps to the next event (exact); wall: scaled wall time (the schedulers' CPU time counts)",
    )
    parser.add_argument(
        "--check-scale", action="store_true", help="also run the simulation at half the scale and compare"
    )
    parser.add_argument("--real-steps", type=int, default=60)
    parser.add_argument(
        "--real-repeats",
        type=int,
        default=3,
        help="sync/async pairs on the real model; the median is reported",
    )
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument(
        "--gpus", type=int, default=0, help="also run the schedules at this many simulated GPUs (e.g. 1024)"
    )
    parser.add_argument(
        "--scale-steps", type=int, default=9, help="trainer steps of each --gpus run (a third left out)"
    )
    parser.add_argument(
        "--wall-scale",
        type=float,
        default=0.2,
        help="--check-scale at --gpus: wall seconds per simulated second",
    )
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few simulated and real steps of each mode (seconds; the figures mean nothing)",
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.smoke:
        global MODES, PROMPTS, GROUP, SIM_EXTRA
        PROMPTS, GROUP = 4, 4
        # Two steps: one left out as the pipeline filling (where a mode leaves any out), one counted.
        MODES = [msgspec.structs.replace(m, steps=2, warmup=min(m.warmup, 1)) for m in MODES]
        SIM_EXTRA = SMOKE_DATA
        args.real_steps, args.real_repeats = 2, 1
        args.gpus, args.scale_steps, args.wall_scale = args.gpus or 8, 3, 0.002
    summary: dict[str, float] = {}
    if args.gpus:
        summary.update(at_scale(args))
    if not args.skip_sim:
        summary.update(simulated_cluster(args))
    if not args.skip_real:
        samples = args.real_steps * (2 * 2 if args.smoke else 16 * 8)  # REAL_SMOKE: 2 prompts x 2
        print(
            f"\nreal tiny model, 2 cores (engine on core 0, trainer on core 1), {args.real_steps} steps = {samples} samples per run:"
        )
        real = real_runs(args.real_steps, args.real_repeats, smoke=args.smoke)
        print(
            f"  median: speedup {real['speedup']:.2f}x; this workload's ideal (generation + training) / max(generation, training) = "
            f"{real['ideal']:.2f}x (2x only for equal phases): {real['speedup'] / real['ideal']:.3f} of it"
        )
        summary["real_speedup_async_vs_sync"] = real["speedup"]
        summary["real_speedup_shared_cores_vs_sync"] = real["shared_speedup"]
        summary["real_ideal"] = real["ideal"]
    print(json.dumps({k: round(v, 3) for k, v in summary.items()}))


if __name__ == "__main__":
    main()
