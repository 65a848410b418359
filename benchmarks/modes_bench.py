"""The three schedules compared, in one run: on a simulated 32-GPU cluster and on the real tiny
model on this machine's 2 cores.

    .venv/bin/python benchmarks/modes_bench.py [--scale 0.01] [--check-scale] [--real-steps 60] [--real-repeats 3] [--skip-sim] [--smoke]

**Simulated cluster** (``rlasync.modes.sim``: simulated GPUs behind the real engine actors,
router, agent loops, rollouter, queue and controllers; the trainer's step and the weight sync
take modelled times). Sync uses all 32 GPUs for generation, then training (colocated); the
async modes split them 16 : 16. For each mode: steps/hour (after the first sync period, in
simulated time), the GPU busy fraction, and the mode's own ideal: an analytic bound with zero
idle time on the workload the run actually drew (its formula is printed), and how close the
mode came to it. ``--check-scale`` runs the simulation again at half the scale (twice as fast
against the wall clock) and prints how much the results moved.

**Real tiny model on 2 cores**: the quickstart task, the engine's process on core 0 and the
trainer's rank on core 1 (``taskset``, ``trainer.cpu_affinity``): sync against fully async wall
time for the same number of samples. Fully overlapped, async would take the longer of the two
phases, so its ideal on this workload is (generation + training) / max(generation, training),
from the sync run's phase times: 2x only when the two phases take equally long. The pair runs
``--real-repeats`` times, alternating, and the median ratio is reported (the machines are shared).

Last line JSON: ``{"sim_speedup_async_vs_sync", "sim_speedup_one_step_vs_sync", "sim_partial_gain",
"sim_async_fraction_of_ideal", "sim_sync_fraction_of_ideal", "real_speedup_async_vs_sync"}``.

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
LATENCY = LatencyModel(base_s=0.015, per_seq_s=0.00015, max_batch=256)
LENGTHS = LogNormalLengths(median=2000, sigma=0.8, cap=16000)
GPUS, PROMPTS, GROUP, TRAIN_RATE, SYNC_S, BLOCK = 32, 32, 16, 10_000.0, 1.0, 16
# Four steps per weight version (verl's recipe). The bound is exact per token, so it must leave a
# long response time to finish: the longest (16,000 tokens) takes 16,000 decoding steps, about
# 850 s at a full batch, which is many trainer steps. Measured (160 steps, the first 60 left
# out): staleness 4 -> 0.87 of the ideal (the trainer waits for the tail at its deadline and the
# GPUs drain), 5 -> 0.90, 6 -> 0.94 and 167 steps/h, 8 -> 0.84 (a pipeline that long has not
# settled in 160 steps). 6: tokens at most 6 versions (24 steps) old.
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
    label: str
    mode: str
    steps: int
    warmup: int  # steps left out of the rate (the pipeline filling)
    partial: bool = True
    trigger: int = 1


MODES = [
    Mode(label="sync (32 colocated)", mode="sync", steps=4, warmup=0),
    Mode(label="one-step-off (16:16)", mode="one_step_off", steps=6, warmup=1),
    # 160 steps, the first 60 left out: the bound lets the pipeline hold about 28 steps of samples.
    Mode(
        label="fully async, no partial (16:16)",
        mode="fully_async",
        steps=160,
        warmup=60,
        partial=False,
        trigger=ASYNC["trigger_parameter_sync_step"],
    ),
    Mode(
        label="fully async + partial (16:16)",
        mode="fully_async",
        steps=160,
        warmup=60,
        partial=True,
        trigger=ASYNC["trigger_parameter_sync_step"],
    ),
]


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
        f"async_training.partial_rollout={str(mode.partial).lower()}",
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
    a, c, s = LATENCY.base_s, LATENCY.per_seq_s, SYNC_S
    half = GPUS // 2
    if (
        mode.mode == "sync"
    ):  # all 32 generate (16 sequences each), the longest response alone last; then all train
        b = min(LATENCY.max_batch, PROMPTS * GROUP / GPUS)
        return max(longest * (a + c), tokens * (a / b + c) / GPUS) + tokens / (TRAIN_RATE * GPUS) + s
    if mode.mode == "one_step_off":  # 16 generate the next batch while 16 train on this one
        b = min(LATENCY.max_batch, PROMPTS * GROUP / half)
        return max(longest * (a + c), tokens * (a / b + c) / half, tokens / (TRAIN_RATE * half)) + s
    b = min(LATENCY.max_batch, batch or LATENCY.max_batch)
    return max(tokens * (a / b + c) / half + s / mode.trigger, tokens / (TRAIN_RATE * half))


FORMULAS = {
    "sync": "sum over steps of  max(L_max*(a+c), T*(a/b+c)/32) + T/(r*32) + s,  b = min(256, 512/32)",
    "one_step_off": "sum over steps of  max(max(L_max*(a+c), T*(a/b+c)/16), T/(r*16)) + s,  b = min(256, 512/16)",
    "fully_async": "sum over steps of  max(T*(a/b+c)/16 + s/trigger, T/(r*16)),  b = the mean batch the bound let the run keep (and b = 256: 'full batch')",
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
        "ideal_steps_per_hour": len(counted) / ideal * 3600,
        "full_batch_steps_per_hour": len(counted) / full * 3600,
        "sim_s": elapsed,
        "mean_batch": mean_batch,
        "generation_busy": gen_busy,
        "generated_per_trained": generated / max(trained, 1),
    }


async def simulate_all(scale: float) -> dict[str, dict[str, float]]:
    results = {}
    for mode in MODES:
        began = time.perf_counter()
        results[mode.label] = await simulate(mode, scale)
        results[mode.label]["wall_s"] = time.perf_counter() - began
    return results


def run_sim(clock: str, scale: float) -> dict[str, dict[str, float]]:
    """Every mode on the simulated cluster: on a ``VirtualTimeLoop`` (the schedulers' own Python
    time costs no simulated time: exact at any scale) or against the wall clock."""
    if clock == "virtual":
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            return runner.run(simulate_all(scale))
    return asyncio.run(simulate_all(scale))


def print_sim(results: dict[str, dict[str, float]], scale: float, clock_name: str) -> None:
    print(
        "(of ideal: steps/h over the ideal's; gen busy: generation GPUs' time with work; batch: their mean batch; full-batch/h: the ideal at 256;"
    )
    print(
        " gen/trained: tokens generated in the measured steps over those trained, 1 when the pipeline is steady)"
    )
    print(
        f"\n{'mode':34s} {'steps/h':>8s} {'ideal/h':>8s} {'of ideal':>9s} {'GPU busy':>9s} {'gen busy':>9s} {'batch':>6s} {'full-batch/h':>13s} {'gen/trained':>12s} {'sim s':>7s} {'wall s':>7s}   ({clock_name} clock, scale {scale:g})"
    )
    for label, r in results.items():
        print(
            f"{label:34s} {r['steps_per_hour']:8.2f} {r['ideal_steps_per_hour']:8.2f} {r['fraction_of_ideal']:9.3f} {r['gpu_busy']:9.3f} "
            f"{r['generation_busy']:9.3f} {r['mean_batch']:6.1f} {r['full_batch_steps_per_hour']:13.2f} {r['generated_per_trained']:12.3f} {r['sim_s']:7.0f} {r['wall_s']:7.1f}"
        )


def real_run(
    mode: str, model_dir: Path, steps: int, out: Path, extra: list[str]
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
    ]
    command = [
        "taskset",
        "-c",
        "0",
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
            ideal = (generating + training) / max(generating, training)
            pairs.append(
                {
                    "sync_s": sync_s,
                    "async_s": async_s,
                    "speedup": sync_s / async_s,
                    "ideal": ideal,
                    "generating_s": generating,
                    "training_s": training,
                }
            )
            print(
                f"  run {i + 1}: sync {sync_s:6.1f} s (generating {generating:5.1f} s, training {training:5.1f} s)   fully async {async_s:6.1f} s   "
                f"speedup {sync_s / async_s:.2f}x   ideal {ideal:.2f}x",
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
        f"  training r = {TRAIN_RATE:,.0f} tokens/s per GPU; s = {SYNC_S:g} s per weight sync; fully async: {ASYNC}"
    )
    print(
        f"  one simulated second per {args.scale * 1e3:g} ms of the event loop's {args.clock} clock; each simulated token stands for {BLOCK} (T: a step's tokens)"
    )
    for mode, formula in FORMULAS.items():
        print(f"  ideal, {mode}: {formula}")
    results = run_sim(args.clock, args.scale)
    print_sim(results, args.scale, args.clock)
    labels = [m.label for m in MODES]
    rate = {label: results[label]["steps_per_hour"] for label in labels}
    summary: dict[str, float] = {
        "sim_speedup_async_vs_sync": rate[labels[3]] / rate[labels[0]],
        "sim_speedup_one_step_vs_sync": rate[labels[1]] / rate[labels[0]],
        "sim_partial_gain": rate[labels[3]] / rate[labels[2]],
        "sim_async_fraction_of_ideal": results[labels[3]]["fraction_of_ideal"],
        "sim_sync_fraction_of_ideal": results[labels[0]]["fraction_of_ideal"],
    }
    if args.check_scale:
        half = run_sim(args.clock, args.scale / 2)
        print_sim(half, args.scale / 2, args.clock)
        moved = max(
            abs(half[label]["steps_per_hour"] / results[label]["steps_per_hour"] - 1) for label in labels
        )
        print(f"at half the scale the steps/hour moved by at most {moved * 100:.1f} %")
        summary["sim_scale_check_max_change"] = moved
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
    summary: dict[str, float] = {}
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
        summary["real_ideal"] = real["ideal"]
    print(json.dumps({k: round(v, 3) for k, v in summary.items()}))


if __name__ == "__main__":
    main()
