"""The real schedules on a simulated cluster (simulated GPUs behind real engine actors and the
router, on a virtual-time loop): deterministic, exact at any scale, and async beats sync when
response lengths have a long tail. Its weight sync charges what real engines pay: a swap's
hold, the re-prefill of cut turns, and never all engines paused unless ``commit=together``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rlasync.config import load_config
from rlasync.engines import GenerateRequest, SamplingParams
from rlasync.engines.sim import LatencyModel, LogNormalLengths, SimClock, SimEngine, VirtualTimeLoop
from rlasync.modes.sim import SimCluster, SimSync, train_run
from rlasync.weights import SyncReport
from rlasync.weights.commit import Interrupt

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _simulate(mode: str, scale: float, run_dir: Path, **extra: str) -> tuple[float, list[dict[str, Any]]]:
    overrides = [
        f"train.mode={mode}",
        "train.steps=6",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=200",
        "agent.response_length=260",
        "train.validate_every=1000",
        f"train.run_dir={run_dir}",
        "train.model_dir=simulated",
        *[f"async_training.{k}={v}" for k, v in extra.items()],
    ]
    config = load_config(CONFIG, overrides)

    async def main() -> tuple[float, list[dict[str, Any]]]:
        clock = SimClock(scale)
        records: list[dict[str, Any]] = []
        cluster = SimCluster(
            clock,
            engines=2,
            trainer_gpus=2,
            latency=LatencyModel(),
            lengths=LogNormalLengths(median=300, sigma=0.8, cap=3000),
        )
        start = clock.now()
        await train_run(config, cluster, on_step=records.append)
        return clock.now() - start, records

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())


def test_the_simulation_is_exact_at_any_scale_and_async_overlaps_the_long_tail(tmp_path: Path) -> None:
    sync_s, sync_records = _simulate("sync", 0.01, tmp_path / "a")
    again_s, _ = _simulate("sync", 0.005, tmp_path / "b")
    # The same simulated time at half the scale: float64 sums of the same step times scaled by 0.01
    # and 0.005, exact to ~1e-13 of the total; 1e-6 would still catch a single step counted twice.
    assert abs(again_s - sync_s) < 1e-6 * sync_s
    async_s, async_records = _simulate(
        "fully_async", 0.01, tmp_path / "c", staleness_threshold="2", trigger_parameter_sync_step="2"
    )
    assert len(sync_records) == len(async_records) == 6
    assert async_s < 0.8 * sync_s, (async_s, sync_s)
    assert all(r["async/staleness_max"] <= 2 for r in async_records)


def _virtual(main: Any) -> Any:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


LONG = LogNormalLengths(median=4000, sigma=0.3, cap=16000)  # every turn still running at the sync


def _sync_during_turns(interrupt: Interrupt) -> tuple[float, SyncReport, list[SimEngine], list[list[int]]]:
    """Eight turns on two simulated GPUs, re-submitted with their tokens when cut (as the agent
    loops do); a sync 20 simulated seconds in. The time until all are done, the sync's report,
    the GPUs and each turn's token versions."""

    async def main() -> tuple[float, SyncReport, list[SimEngine], list[list[int]]]:
        clock = SimClock(0.01)
        gpus = [SimEngine(clock, LatencyModel(), LONG, token_block=16, name=f"gpu{i}") for i in range(2)]
        sync = SimSync(clock, gpus, weight_bytes=16_000_000_000, bandwidth=16e9)

        async def turn(gpu: SimEngine, seed: int) -> list[int]:
            made: list[int] = []
            versions: list[int] = []
            for attempt in range(10):
                out = await gpu.generate(
                    GenerateRequest(
                        request_id=f"{seed}.{attempt}",
                        prompt_ids=[1] * 100 + made,
                        params=SamplingParams(max_new_tokens=100_000, seed=seed),
                    )
                )
                made += out.token_ids
                versions += out.versions
                if out.finish_reason != "abort":
                    break
            return versions

        turns = [asyncio.ensure_future(turn(gpus[seed % 2], seed)) for seed in range(8)]
        await clock.sleep(20.0)
        report = await sync.sync(1, interrupt=interrupt)
        versions = await asyncio.gather(*turns)
        took = clock.now()
        for gpu in gpus:
            await gpu.close()
        return took, report, gpus, versions

    return _virtual(main())


def test_an_abort_costs_the_re_prefill_of_the_cut_turns_and_keep_does_not() -> None:
    keep_s, keep, keep_gpus, keep_versions = _sync_during_turns("keep")
    abort_s, abort, abort_gpus, abort_versions = _sync_during_turns("abort")
    latency = LatencyModel()
    # keep: each GPU holds only for its swap, the two halves one after the other, never together.
    assert keep.reprefill_tokens == 0 and not keep.all_paused
    assert keep.engine_idle_s == pytest.approx(0.01 * 2 * latency.swap_s)
    assert sum(g.prefill_s for g in keep_gpus) == pytest.approx(latency.prefill_s(8 * 100))  # the prompts
    # abort: every turn was cut; each pays the prefill of its prompt and its tokens again
    # (the report counts the simulator's tokens, a block one; the GPU pays 16 real tokens a block).
    made = [sum(1 for v in versions if v == 0) for versions in abort_versions]
    assert all(n > 0 for n in made) and not abort.all_paused
    assert abort.reprefill_tokens == sum(100 + n for n in made)
    again = latency.prefill_s(sum(100 + 16 * n for n in made))
    assert sum(g.prefill_s for g in abort_gpus) == pytest.approx(latency.prefill_s(8 * 100) + again)
    # The same work, each GPU stalled by its re-prefill: the abort run ends later by at least
    # the smaller GPU's share of it.
    assert abort_s > keep_s + again / 2 * 0.9, (abort_s, keep_s, again)
    assert sorted(map(len, keep_versions)) == sorted(map(len, abort_versions))


def test_tokens_before_a_swap_carry_the_old_version_and_after_it_the_new() -> None:
    async def main() -> tuple[float, list[int], float]:
        clock = SimClock(0.01)
        gpu = SimEngine(clock, LatencyModel(), LONG, token_block=16, name="gpu0")
        sync = SimSync(clock, [gpu], weight_bytes=16_000_000_000, bandwidth=16e9)
        request = GenerateRequest(
            request_id="r", prompt_ids=[1] * 100, params=SamplingParams(max_new_tokens=100_000, seed=3)
        )
        out = asyncio.ensure_future(gpu.generate(request))
        await clock.sleep(20.0)
        await sync.sync(1, interrupt="keep")  # the transfer (1 s, decoding), then the swap
        versions = (await out).versions
        took = clock.now()
        await gpu.close()
        return took, versions, gpu.stopped_s

    took, versions, stopped = _virtual(main())
    latency = LatencyModel()
    step = latency.step_s(1) * 16
    began = latency.prefill_s(100)  # the first step starts after the prompt's prefill
    before = int((21.0 - began) / step)  # whole steps made when the GPU took version 1, at 21 s
    assert versions == [0] * before + [1] * (len(versions) - before)
    assert stopped == pytest.approx(latency.swap_s)
    # Decoding lost the swap's hold and nothing else.
    assert took == pytest.approx(began + len(versions) * step + latency.swap_s)


def test_each_engine_takes_a_version_while_the_others_decode_and_together_pauses_them_all(
    tmp_path: Path,
) -> None:
    _, keep = _simulate(
        "fully_async", 0.01, tmp_path / "keep", staleness_threshold="2", trigger_parameter_sync_step="2"
    )
    _, together = _simulate(
        "fully_async",
        0.01,
        tmp_path / "together",
        staleness_threshold="2",
        trigger_parameter_sync_step="2",
        commit="together",
        interrupt="abort",
    )
    synced = [r for r in keep if "weights/all_paused" in r]
    assert synced and all(r["weights/all_paused"] == 0 and r["weights/reprefill_tokens"] == 0 for r in synced)
    synced = [r for r in together if "weights/all_paused" in r]
    assert synced and all(r["weights/all_paused"] == 1 for r in synced)
    assert sum(r["weights/reprefill_tokens"] for r in synced) > 0
