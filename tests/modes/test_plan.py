"""``rlasync plan``: the simulator run over the split and the asynchronous knobs, the best point
marked and its overrides printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from rlasync.config import load_config
from rlasync.engines.sim import LogNormalLengths
from rlasync.modes.plan import _gpu_work, plan, pooled_step_s, render, split_step_s
from rlasync.modes.profiles import PROFILES

ROOT = Path(__file__).parents[2]
SMALL = ["train.prompts_per_step=2", "train.group_size=2", "data.synthetic_train_size=64"]
# Short answers: each simulated run takes a fraction of a second.
PROFILE = msgspec.structs.replace(
    PROFILES["generic-8b-h100"], lengths=LogNormalLengths(median=300, sigma=0.8, cap=3000)
)


def test_the_marked_point_is_the_best_of_its_grid() -> None:
    config = load_config(ROOT / "configs" / "quickstart_async.yaml", SMALL)
    result = plan(
        config,
        gpus=4,
        profile=PROFILE,
        splits=(0.25, 0.5, 0.75),
        staleness=(1.0, 4.0),
        triggers=(1, 2),
        require_batches=(1,),
        versions=2,
        workers=0,
    )
    grid = {(g, s, t) for g in (1, 2, 3) for s in (1.0, 4.0) for t in (1.0, 2.0)}
    ran = {
        (p.measure.generation_gpus, p.knobs["staleness_threshold"], p.knobs["trigger_parameter_sync_step"])
        for p in result.points
    }
    assert ran == grid and len(result.points) == len(grid)  # exhaustive: a small grid
    best = max(result.points, key=lambda p: p.measure.samples_per_hour)
    assert result.best is best
    table = render(result, PROFILE)
    marked = [line for line in table.splitlines() if line.startswith("  *")]
    m = best.measure
    assert len(marked) == 1 and f"{m.generation_gpus}:{m.trainer_gpus}" in marked[0]
    assert f"{m.samples_per_hour:10.0f}" in marked[0]
    assert " ".join(best.overrides) in table
    assert f"trainer.world_size={m.trainer_gpus}" in best.overrides
    for point in result.points:  # what it measures holds together
        assert 0 < point.measure.fraction_of_pooled <= 1.0 + 1e-9
        assert 0 < point.measure.split_ceiling <= 1.0 + 1e-9
        assert point.measure.staleness_p50 <= point.measure.staleness_p99 <= 4
        assert point.measure.generation_gpus + point.measure.trainer_gpus == 4
    assert result.sync.staleness_p99 == 0  # sync trains on-policy
    assert result.sync.split_ceiling == 1.0  # sync is not split


def test_the_split_ceiling_is_set_by_the_slower_side() -> None:
    """A split's ideal step is its slower side's, so it is never shorter than the pooled ideal,
    and it is longest at the extremes: one GPU generating, or one training."""
    tokens, rows, gpus = 2e6, 1024, 64
    pooled = pooled_step_s(PROFILE, tokens, rows, gpus, logprobs=True)
    ceiling = {
        g: pooled / split_step_s(PROFILE, tokens, rows, g, gpus - g, logprobs=True) for g in range(1, gpus)
    }
    assert all(0 < c <= 1 + 1e-12 for c in ceiling.values())
    best = max(ceiling, key=lambda g: ceiling[g])
    rising, falling = [ceiling[g] for g in range(1, best + 1)], [ceiling[g] for g in range(best, gpus)]
    assert rising == sorted(rising) and falling == sorted(falling, reverse=True)  # one peak
    generation, training, serial = _gpu_work(PROFILE, tokens, rows, logprobs=True)
    # At the peak the sides swap: one GPU fewer generating and generation is the slower side.
    assert generation / (best - 1) > serial + training / (gpus - best + 1)
    assert generation / (best + 1) < serial + training / (gpus - best - 1)


def test_a_large_grid_is_searched_by_descent_from_the_config_s_knobs() -> None:
    config = load_config(ROOT / "configs" / "quickstart_async.yaml", SMALL)
    result = plan(config, gpus=4, profile=PROFILE, versions=1, workers=0, exhaustive_up_to=0)
    first = result.points[: len({p.measure.generation_gpus for p in result.points})]
    assert all(p.knobs["staleness_threshold"] == config.async_training.staleness_threshold for p in first)
    assert len(result.points) < 3 * 4 * 3 * 2  # not the whole grid
    assert result.best.measure.samples_per_hour == max(p.measure.samples_per_hour for p in result.points)


def test_the_command_says_what_to_change_for_a_bad_profile_or_gpu_count() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rlasync", "plan", str(ROOT / "configs" / "quickstart_async.yaml"), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    unknown = run("--gpus", "8", "--profile", "nope")
    assert (
        unknown.returncode == 2 and "choose one of" in unknown.stderr and "generic-8b-h100" in unknown.stderr
    )
    few = run("--gpus", "1")
    assert few.returncode == 2 and "--gpus must be >= 2" in few.stderr


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_says_what_it_assumed(name: str) -> None:
    assert PROFILES[name].assumptions and PROFILES[name].source


@pytest.mark.serial  # against the wall clock: a loaded machine moves its figures
def test_on_the_wall_clock_the_head_s_own_load_is_measured() -> None:
    from rlasync.modes.plan import measure

    config = load_config(ROOT / "configs" / "quickstart_async.yaml", SMALL)
    virtual = measure(config, PROFILE, generation_gpus=2, trainer_gpus=2, steps=4, warmup=1)
    wall = measure(config, PROFILE, generation_gpus=2, trainer_gpus=2, steps=4, warmup=1, wall_scale=0.002)
    assert virtual.head is None and wall.head is not None
    head = wall.head
    assert head.wall_s > 0 and head.cpu_ms_per_trajectory > 0 and head.trajectories_per_s > 0
    assert head.turns_per_s >= head.trajectories_per_s  # every trained trajectory took a turn at least
    assert 0 <= head.loop_lag_p99_ms <= head.loop_lag_max_ms
