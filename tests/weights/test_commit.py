"""How engines take a staged version (``rlasync.weights.commit``), on real torch engines: each
interrupt policy does what it says to a running turn, and engines committed in waves are never
all paused at one instant."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from waiting import wait_until

from rlasync.engines import GenerateRequest, SamplingParams, TorchEngine
from rlasync.models import load_pretrained_dir
from rlasync.weights.commit import Commit, all_paused, in_waves, take_version

uvloop = pytest.mark.asyncio(loop_factories=["uvloop"])
LONG = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=0)


def _engine(model_dir: Path) -> TorchEngine:
    model, _ = load_pretrained_dir(model_dir)
    return TorchEngine(model, max_batch=4)


async def _running(engine: TorchEngine, name: str) -> asyncio.Future:
    """A long request, once it has made some tokens."""
    task = asyncio.ensure_future(
        engine.generate(GenerateRequest(request_id=name, prompt_ids=[5, 6, 7], params=LONG))
    )
    await wait_until(lambda: engine.stats().generated_tokens >= 20, interval_s=0.001, what="tokens")
    return task


async def _swap(engine: TorchEngine, version: int) -> float:
    params = dict(engine.model.named_parameters())
    return await engine.swap_weights(
        {"model.norm.weight": params["model.norm.weight"].detach().clone()}, version
    )


@pytest.mark.parametrize("interrupt", ["keep", "abort", "drain"])
@uvloop
async def test_each_interrupt_does_what_it_says_to_a_running_turn(
    interrupt: str, nano_model_dir: Path
) -> None:
    engine = _engine(nano_model_dir)
    task = await _running(engine, "r")
    commit = await take_version(engine, lambda: _swap(engine, 1), version=1, interrupt=interrupt)  # type: ignore[arg-type]
    out = await task
    await engine.close()
    assert engine.weight_version == 1 and commit.version == 1 and commit.interrupt == interrupt
    if interrupt == "keep":  # carried across the swap: its later tokens carry the new version
        assert out.finish_reason == "length" and len(out.token_ids) == 300
        assert out.versions[0] == 0 and out.versions[-1] == 1 and commit.cut == commit.reprefill_tokens == 0
    elif interrupt == "abort":  # cut; its tokens so far come back, to be prefilled again
        assert out.finish_reason == "abort" and set(out.versions) == {0} and commit.cut == 1
        assert commit.reprefill_tokens == 3 + len(out.token_ids)
    else:  # finished first, all under the old version
        assert out.finish_reason == "length" and set(out.versions) == {0} and commit.cut == 0


@uvloop
async def test_engines_committed_in_waves_are_never_all_paused(nano_model_dir: Path) -> None:
    engines = [_engine(nano_model_dir) for _ in range(3)]
    tasks = [await _running(engine, f"r{i}") for i, engine in enumerate(engines)]

    async def drain(engine: TorchEngine) -> Commit:
        return await take_version(engine, lambda: _swap(engine, 1), version=1, interrupt="drain")

    commits = await in_waves(engines, drain)
    assert all(isinstance(c, Commit) for c in commits)
    assert not all_paused(commits, len(engines))  # type: ignore[arg-type]
    first, second = commits[:2], commits[2:]  # two halves: the second began after the first ended
    assert min(c.began for c in second) >= max(c.ended for c in first) - 1e-3  # type: ignore[union-attr]
    await asyncio.gather(*tasks)
    # Together (all at once), their drains overlap: an instant with every engine paused.
    tasks = [await _running(engine, f"s{i}") for i, engine in enumerate(engines)]
    at_once = await asyncio.gather(*[drain(engine) for engine in engines])
    assert all_paused(at_once, len(engines))
    await asyncio.gather(*tasks)
    for engine in engines:
        await engine.close()
