"""Planning on the simulator: run a config's schedule on a profile's simulated cluster, measure
it against the pooled ideal, and search the split between generation and training and the
asynchronous knobs for the best point.

    result = plan(load_config("configs/quickstart_async.yaml"), gpus=32, profile=PROFILES["generic-8b-h100"])
    print(result.best.overrides)     # ["trainer.world_size=12", "async_training.staleness_threshold=2", ...]

Each point is one simulated run on a virtual-time loop (``measure``). A small grid (at most
``exhaustive_up_to`` points) is run whole; a larger one by coordinate descent: first the split
at the config's knobs, then ``staleness_threshold``, then
``trigger_parameter_sync_step``, then ``require_batches``, each at the best found so far, then
the split again at the best knobs. Every point run is in ``PlanResult.points``; the best of them
(the most samples trained on an hour) is ``best``. Runs go to ``workers`` processes at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..config import Config
from ..engines.sim import SimClock, VirtualTimeLoop
from .profiles import Profile, lengths_moment
from .sim import SimCluster, train_run

BLOCK = 32  # real tokens per simulated token in planning runs


class Measure(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated run, after its warm-up steps."""

    generation_gpus: int
    trainer_gpus: int
    step_s: float  # simulated seconds per trainer step
    steps_per_hour: float
    samples_per_hour: float  # prompt groups trained on per hour: comparable across require_batches
    fraction_of_pooled: float  # the pooled ideal's time over the run's
    split_ceiling: float  # the most fraction_of_pooled can be at this split (``split_step_s``); 1 for sync
    staleness_p50: int  # versions behind, over every trained token
    staleness_p99: int
    gpu_idle: float  # of all GPUs' time, the part neither generating nor training
    trainer_busy: float
    generation_busy: float
    head: HeadLoad | None = None  # on the wall clock: what the head's own work cost


class HeadLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The head's process on the wall clock: what keeping the simulated cluster going cost it."""

    wall_s: float
    cpu_ms_per_trajectory: float  # the process's CPU time (head, loops, simulated GPUs) per trajectory
    trajectories_per_s: float  # finished per wall second
    turns_per_s: float  # generate calls through the router per wall second (two messages each)
    loop_lag_p99_ms: float  # how late a 10 ms timer woke: the loop's responsiveness
    loop_lag_max_ms: float


class Point(msgspec.Struct, frozen=True, kw_only=True):
    knobs: dict[str, float]  # staleness_threshold, trigger_parameter_sync_step, require_batches
    measure: Measure

    @property
    def overrides(self) -> list[str]:
        """The command-line overrides that give this point (the engines, ``generation_gpus``
        over the engine's tensor-parallel size, are placed with ``cluster.engines``)."""
        return [
            f"trainer.world_size={self.measure.trainer_gpus}",
            *[f"async_training.{k}={_number(v)}" for k, v in self.knobs.items()],
        ]


class PlanResult(msgspec.Struct, frozen=True, kw_only=True):
    gpus: int
    profile: str
    sync: Measure  # the config in sync mode on every GPU, for reference
    points: list[Point]

    @property
    def best(self) -> Point:
        """The point that trains on the most samples an hour."""
        return max(self.points, key=lambda p: p.measure.samples_per_hour)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _gpu_work(profile: Profile, tokens: float, rows: int, *, logprobs: bool) -> tuple[float, float, float]:
    """A step's work at its ideal: GPU-seconds of generation and of training, and the trainer's
    serial part (its fixed costs per batch of rows, which more GPUs do not shorten). A token's
    decode costs ``a / b + c + k * context`` at the mean context of a running sequence (half
    its answer, length-biased: E[L^2] / 2 E[L], plus the prompt), at the largest batch the KV
    cache allows, and no prefill. The moments are the profile's distribution's, not the step's
    draws: over a few trajectories (a smoke run) a heavy tail is rarely drawn, and a run can
    read above 1."""
    latency = profile.latency()
    mean, square = lengths_moment(profile.lengths, 1), lengths_moment(profile.lengths, 2)
    context = profile.prompt_tokens + square / (2 * mean)
    batch = latency.max_batch
    if latency.kv_capacity_tokens:
        batch = max(1, min(batch, int(latency.kv_capacity_tokens / context)))
    generation = tokens * (latency.base_s / batch + latency.per_seq_s + latency.per_context_token_s * context)
    trained = tokens + rows * profile.prompt_tokens
    phases = [profile.update, profile.logprob] if logprobs else [profile.update]
    training = sum(p.gpu_s_per_token * trained for p in phases)
    serial = sum(p.fixed_s * rows / p.batch_rows for p in phases)
    return generation, training, serial


def pooled_step_s(profile: Profile, tokens: float, rows: int, gpus: int, *, logprobs: bool) -> float:
    """The pooled ideal of a step of ``tokens`` generated tokens and ``rows`` trajectories: every
    GPU busy, generating (``_gpu_work``) or training, nothing paused, no split between the two."""
    generation, training, serial = _gpu_work(profile, tokens, rows, logprobs=logprobs)
    return max(serial, (generation + training) / gpus)


def split_step_s(
    profile: Profile, tokens: float, rows: int, generation_gpus: int, trainer_gpus: int, *, logprobs: bool
) -> float:
    """The same step's ideal with its GPUs split: generation on ``generation_gpus`` and training on
    ``trainer_gpus``, each busy all the time, so the slower side sets the step. The trainer pays
    its serial part on top of its share of the tokens, as the simulated one does (``Phase``).
    Its ratio to ``pooled_step_s`` is the most of the pooled ideal any schedule reaches at that
    split."""
    generation, training, serial = _gpu_work(profile, tokens, rows, logprobs=logprobs)
    return max(generation / generation_gpus, serial + training / trainer_gpus)


async def _lag(lags: list[float], counting: list[bool], period: float = 0.01) -> None:
    """How late a ``period`` timer wakes, while ``counting[0]`` (from the first trainer step to
    the last: the run's start-up, imports and all, and its close block the loop once each,
    which is not the head's steady load)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        if counting[0]:
            lags.append(max(0.0, loop.time() - due))


async def _run(
    config: Config,
    profile: Profile,
    generation_gpus: int,
    trainer_gpus: int,
    warmup: int,
    scale: float,
    wall: bool,
) -> Measure:
    clock = SimClock(scale)
    cluster = SimCluster.of_profile(
        clock,
        profile,
        generation_gpus=generation_gpus,
        trainer_gpus=trainer_gpus,
        token_block=BLOCK,
        logprobs_in_step=config.train.mode == "sync",
    )
    times: list[float] = []
    ideal: list[float] = []
    split: list[float] = []
    hist: list[int] = []
    gpus = generation_gpus if config.train.mode == "sync" else generation_gpus + trainer_gpus
    logprobs = config.train.mode == "sync" or not config.async_training.use_rollout_log_probs
    batches = 1 if config.train.mode == "sync" else config.async_training.require_batches
    rows = config.train.prompts_per_step * config.train.group_size * batches  # trajectories a step
    start = clock.now()

    counting = [False]

    def on_step(record: dict[str, Any]) -> None:
        times.append(clock.now() - start)
        counting[0] = len(times) < config.train.steps  # from the first step to the last
        if len(times) <= warmup:
            return
        tokens = record["response_tokens"] * BLOCK
        ideal.append(pooled_step_s(profile, tokens, rows, gpus, logprobs=logprobs))
        split.append(
            ideal[-1]
            if config.train.mode == "sync"
            else split_step_s(profile, tokens, rows, generation_gpus, trainer_gpus, logprobs=logprobs)
        )
        for behind, count in enumerate(record.get("async/staleness_token_hist", [])):
            hist.extend([0] * (behind + 1 - len(hist)))
            hist[behind] += count

    lags: list[float] = []
    monitor = asyncio.ensure_future(_lag(lags, counting)) if wall else None
    began, cpu = time.perf_counter(), time.process_time()
    try:
        await train_run(config, cluster, on_step=on_step)
    finally:
        if monitor is not None:
            monitor.cancel()
    head = None
    if wall:
        wall_s, finished = time.perf_counter() - began, sum(e.finished for e in cluster.engines)
        lags.sort()
        head = HeadLoad(
            wall_s=wall_s,
            cpu_ms_per_trajectory=1000 * (time.process_time() - cpu) / max(1, len(times) * rows),
            trajectories_per_s=len(times) * rows / wall_s,
            turns_per_s=finished / wall_s,
            loop_lag_p99_ms=1000 * lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
            loop_lag_max_ms=1000 * lags[-1] if lags else 0.0,
        )
    elapsed = clock.now() - start
    measured = times[-1] - (times[warmup - 1] if warmup else 0.0)
    counted = len(times) - warmup
    generation = cluster.generation_busy_s() / max(1, len(cluster.engines)) / elapsed
    trainer = cluster.trainer.busy_s / elapsed
    if config.train.mode == "sync":  # the same GPUs take turns: busy is either
        idle = 1 - min(1.0, generation + trainer)
    else:
        idle = 1 - (generation * generation_gpus + trainer * trainer_gpus) / gpus
    samples = config.train.prompts_per_step * (
        1 if config.train.mode == "sync" else config.async_training.require_batches
    )
    return Measure(
        generation_gpus=generation_gpus,
        trainer_gpus=trainer_gpus,
        step_s=measured / counted,
        steps_per_hour=counted / measured * 3600,
        samples_per_hour=counted * samples / measured * 3600,
        fraction_of_pooled=sum(ideal) / measured,
        split_ceiling=sum(ideal) / sum(split) if split else 1.0,
        staleness_p50=_quantile(hist, 0.5),
        staleness_p99=_quantile(hist, 0.99),
        gpu_idle=max(0.0, idle),
        trainer_busy=trainer,
        generation_busy=generation,
        head=head,
    )


def _quantile(hist: Sequence[int], q: float) -> int:
    total = sum(hist)
    if not total:
        return 0
    seen = 0
    for behind, count in enumerate(hist):
        seen += count
        if seen >= q * total:
            return behind
    return len(hist) - 1


def measure(
    config: Config,
    profile: Profile,
    *,
    generation_gpus: int,
    trainer_gpus: int,
    steps: int,
    warmup: int,
    wall_scale: float | None = None,
) -> Measure:
    """``config`` (any mode) for ``steps`` trainer steps on ``profile``'s simulated cluster, on a
    virtual-time loop of its own (exact: the schedulers' Python work takes no simulated time);
    the first ``warmup`` steps are left out. A sync run generates and trains on the same
    ``generation_gpus``. ``wall_scale``: on a normal loop instead, one simulated second per
    ``wall_scale`` wall seconds, so the head's own work must keep up (``Measure.head``)."""
    # Answers as long as the profile's (in simulated tokens of BLOCK real ones), not the config's.
    budget = -(-profile.lengths.cap // BLOCK)
    calls = profile.tools.max_calls if profile.tools is not None else 0
    with tempfile.TemporaryDirectory() as run_dir:
        config = msgspec.structs.replace(
            config,
            train=msgspec.structs.replace(
                config.train,
                steps=steps,
                run_dir=run_dir,
                validate_every=1_000_000,
                model_dir="simulated",
                max_new_tokens=budget,
            ),
            # Every model turn and tool turn of an agentic profile's longest trajectory fits.
            agent=msgspec.structs.replace(config.agent, response_length=(budget + 64) * (1 + calls)),
        )
        wall = wall_scale is not None
        with asyncio.Runner(loop_factory=None if wall else VirtualTimeLoop) as runner:
            return runner.run(
                _run(config, profile, generation_gpus, trainer_gpus, warmup, wall_scale or 0.01, wall)
            )


def _knobbed(config: Config, knobs: dict[str, float]) -> Config:
    settings = msgspec.structs.replace(
        config.async_training,
        staleness_threshold=float(knobs["staleness_threshold"]),
        trigger_parameter_sync_step=int(knobs["trigger_parameter_sync_step"]),
        require_batches=int(knobs["require_batches"]),
    )
    return msgspec.structs.replace(config, async_training=settings)


def _measure_point(args: tuple[Config, Profile, int, int, dict[str, float], int]) -> Point:
    config, profile, gpus, generation, knobs, versions = args
    steps_per_version = int(knobs["trigger_parameter_sync_step"])
    steps = max(8, versions * steps_per_version)
    result = measure(
        _knobbed(config, knobs),
        profile,
        generation_gpus=generation,
        trainer_gpus=gpus - generation,
        steps=steps,
        warmup=steps // 3,
    )
    return Point(knobs=knobs, measure=result)


class _Inline:
    """The executor's two calls, run here one after the other (``workers=0``)."""

    def map(self, fn: Callable[[Any], Point], jobs: list[Any]) -> list[Point]:
        return [fn(job) for job in jobs]

    def submit(
        self, fn: Callable[..., Measure], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Measure]:
        future: concurrent.futures.Future[Measure] = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


def plan(
    config: Config,
    *,
    gpus: int,
    profile: Profile,
    splits: Sequence[float] = (0.25, 0.375, 0.5, 0.625, 0.75),
    staleness: Sequence[float] = (0.5, 1.0, 2.0, 4.0),
    triggers: Sequence[int] = (1, 2, 4),
    require_batches: Sequence[int] = (1, 2),
    versions: int = 8,
    workers: int = 2,
    exhaustive_up_to: int = 16,
    progress: Callable[[Point], None] | None = None,
) -> PlanResult:
    """Search ``config``'s fully async schedule on ``gpus`` simulated GPUs of ``profile``: every
    point of the grid (the ``splits`` of the GPUs given to generation, times the knobs' values)
    when it has at most ``exhaustive_up_to`` points, else by coordinate descent (the module
    docstring). Every run lasts ``versions`` weight versions (a third left out); ``workers``
    processes run at once (0: here, one after the other)."""
    if gpus < 2:
        raise ValueError(
            f"planning splits the GPUs between generation and training: --gpus must be >= 2, got {gpus}"
        )
    config = msgspec.structs.replace(config, train=msgspec.structs.replace(config.train, mode="fully_async"))
    base = config.async_training
    knobs: dict[str, float] = {
        "staleness_threshold": float(base.staleness_threshold),
        "trigger_parameter_sync_step": float(base.trigger_parameter_sync_step),
        "require_batches": float(base.require_batches),
    }
    axes = [
        ("staleness_threshold", [float(v) for v in staleness]),
        ("trigger_parameter_sync_step", [float(v) for v in triggers]),
        ("require_batches", [float(v) for v in require_batches]),
    ]
    generation_splits = sorted({min(gpus - 1, max(1, round(gpus * f))) for f in splits})
    points: list[Point] = []
    with contextlib.ExitStack() as stack:
        pool: Any = _Inline()
        if workers > 0:  # spawned: a fork would copy a running loop's state
            context = multiprocessing.get_context("spawn")
            pool = stack.enter_context(
                concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context)
            )

        def run_all(candidates: list[tuple[int, dict[str, float]]]) -> None:
            seen = {(p.measure.generation_gpus, tuple(p.knobs.values())) for p in points}
            jobs = [
                (config, profile, gpus, g, k, versions)
                for g, k in candidates
                if (g, tuple(k.values())) not in seen
            ]
            for point in pool.map(_measure_point, jobs):
                points.append(point)
                if progress is not None:
                    progress(point)

        def best() -> Point:
            return max(points, key=lambda p: p.measure.samples_per_hour)

        sync_config = msgspec.structs.replace(
            config, train=msgspec.structs.replace(config.train, mode="sync")
        )
        sync_future = pool.submit(
            measure, sync_config, profile, generation_gpus=gpus, trainer_gpus=gpus, steps=4, warmup=1
        )
        grid = [
            (g, dict(zip(knobs, values)))
            for g in generation_splits
            for values in itertools.product(*[v for _, v in axes])
        ]
        if len(grid) <= exhaustive_up_to:
            run_all(grid)
        else:
            run_all([(g, dict(knobs)) for g in generation_splits])
            for name, values in axes:
                top = best()
                run_all([(top.measure.generation_gpus, {**top.knobs, name: v}) for v in values])
            run_all([(g, dict(best().knobs)) for g in generation_splits])
        sync = sync_future.result()
    return PlanResult(gpus=gpus, profile=profile.name, sync=sync, points=points)


def render(result: PlanResult, profile: Profile) -> str:
    """The plan as a table: every point run, in the order run, the best marked with ``*``."""
    best = result.best
    lines = [
        f"{result.gpus} GPUs of profile {profile.name} ({profile.model.name} on {profile.hardware.name}; {profile.source})",
        *[f"  assumed: {a}" for a in profile.assumptions],
        "  samples/h: prompt groups trained on an hour; of pooled: the pooled ideal's time over the run's (every GPU busy,",
        "  full batches, nothing paused); ceiling: the most of it the split allows (the slower side busy all the time);",
        "  staleness: versions behind of the trained tokens; idle: GPU time with nothing to do",
        "",
        f"  {'':1s} {'gen:train':>10s} {'staleness':>9s} {'trigger':>7s} {'batches':>7s} {'samples/h':>10s} {'steps/h':>8s} {'of pooled':>9s} {'ceiling':>7s} {'p50':>4s} {'p99':>4s} {'idle':>5s}",
    ]
    sync = result.sync
    lines.append(
        f"  {'':1s} {'sync ' + str(result.gpus):>10s} {'-':>9s} {'-':>7s} {'-':>7s} {sync.samples_per_hour:10.0f} {sync.steps_per_hour:8.1f} "
        f"{sync.fraction_of_pooled:9.3f} {sync.split_ceiling:7.3f} {sync.staleness_p50:4d} {sync.staleness_p99:4d} {sync.gpu_idle:5.2f}"
    )
    for point in result.points:
        m, k = point.measure, point.knobs
        lines.append(
            f"  {'*' if point is best else '':1s} {f'{m.generation_gpus}:{m.trainer_gpus}':>10s} {_number(k['staleness_threshold']):>9s} "
            f"{_number(k['trigger_parameter_sync_step']):>7s} {_number(k['require_batches']):>7s} {m.samples_per_hour:10.0f} {m.steps_per_hour:8.1f} "
            f"{m.fraction_of_pooled:9.3f} {m.split_ceiling:7.3f} {m.staleness_p50:4d} {m.staleness_p99:4d} {m.gpu_idle:5.2f}"
        )
    engines = best.measure.generation_gpus // profile.engine_gpus
    lines += [
        "",
        f"best: {best.measure.samples_per_hour / max(sync.samples_per_hour, 1e-9):.2f}x the samples an hour of sync on all {result.gpus} GPUs; "
        f"{engines} engine replicas of {profile.engine_gpus} GPU(s) (cluster.engines) and",
        "  " + " ".join(best.overrides),
    ]
    return "\n".join(lines)


__all__ = [
    "HeadLoad",
    "Measure",
    "PlanResult",
    "Point",
    "measure",
    "plan",
    "pooled_step_s",
    "render",
    "split_step_s",
]
