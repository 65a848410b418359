"""The simulation engine: decode time follows its latency model in simulated time, it is
event-driven, and cut turns resume where they stopped, under the new version."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rlasync.engines import EngineError, GenerateRequest, SamplingParams
from rlasync.engines.sim import LatencyModel, LogNormalLengths, SimClock, SimEngine

LATENCY = LatencyModel(base_s=0.015, per_seq_s=0.00015, max_batch=256)
LENGTHS = LogNormalLengths(median=2000, sigma=0.8, cap=16000)


def _req(rid: str, seed: int, max_new: int = 100_000) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=max_new, seed=seed)
    )


@pytest.mark.parametrize("scale", [0.002, 0.001])
async def test_decode_time_follows_the_model_at_any_scale(scale: float) -> None:
    clock = SimClock(scale)
    engine = SimEngine(clock, LATENCY, LENGTHS, token_block=16)
    seeds = [1, 2, 3, 4]
    started = clock.now()
    outs = await asyncio.gather(*[engine.generate(_req(f"r{s}", s)) for s in seeds])
    took = clock.now() - started
    blocks = sorted(-(-LENGTHS.draw(s) // 16) for s in seeds)
    assert sorted(len(o.token_ids) for o in outs) == blocks and all(o.finish_reason == "stop" for o in outs)
    # Four run together until the shortest ends, then three, two, one: the model's sum.
    expected, done = 0.0, 0
    for i, b in enumerate(blocks):
        expected += (b - done) * LATENCY.step_s(len(blocks) - i) * 16
        done = b
    assert took == pytest.approx(expected, rel=0.05)
    assert engine.busy_s == pytest.approx(expected, rel=0.05) and engine.tokens == 16 * sum(blocks)
    await engine.close()


@pytest.mark.serial  # "about half way" is real time: a loaded machine can pause it before its first block
async def test_a_cut_turn_resumes_where_it_stopped_under_the_new_version() -> None:
    engine = SimEngine(SimClock(0.002), LATENCY, LENGTHS, token_block=16)
    total = -(-LENGTHS.draw(7) // 16)
    first = asyncio.ensure_future(engine.generate(_req("a", 7)))
    await asyncio.sleep(total * LATENCY.step_s(1) * 16 * 0.002 / 2)  # about half way
    partials = await engine.pause("abort")
    cut = await first
    assert (
        cut.finish_reason == "abort"
        and 0 < len(cut.token_ids) < total
        and partials[0].token_ids == cut.token_ids
    )
    queued = asyncio.ensure_future(
        engine.generate(_req("a-resumed", 7))
    )  # the loop re-submits at once: it waits
    await asyncio.sleep(0.01)
    assert not queued.done() and engine.stats().waiting == 1
    await engine.update_weights({}, version=1)
    await engine.resume()
    rest = await queued
    assert (
        len(cut.token_ids) + len(rest.token_ids) == total
        and set(cut.versions) == {0}
        and set(rest.versions) == {1}
    )
    limited = await engine.generate(_req("b", 8, max_new=3))
    assert limited.finish_reason == "length" and len(limited.token_ids) == 3
    await engine.close()


async def test_a_failing_simulated_gpu_fails_its_requests_instead_of_hanging_them() -> None:
    broken = SimEngine(SimClock(0.001), LatencyModel(base_s="not a number"), token_block=1)  # type: ignore[arg-type]  # Structs do not check on init
    request = GenerateRequest(
        request_id="r", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=8, seed=1)
    )
    with pytest.raises(EngineError, match="simulated engine .*failed"):
        await asyncio.wait_for(broken.generate(request), 5)
    with pytest.raises(EngineError, match="closed"):
        await broken.generate(msgspec.structs.replace(request, request_id="s"))
