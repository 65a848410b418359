"""The simulation engine: decode time follows its latency model in simulated time, it is
event-driven, and cut turns resume where they stopped, under the new version."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from rlasync.engines import EngineError, GenerateRequest, SamplingParams
from rlasync.engines.sim import LatencyModel, LogNormalLengths, SimClock, SimEngine, VirtualTimeLoop

LATENCY = LatencyModel(base_s=0.015, per_seq_s=0.00015, max_batch=256)
LENGTHS = LogNormalLengths(median=2000, sigma=0.8, cap=16000)


def _req(rid: str, seed: int, max_new: int = 100_000) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=max_new, seed=seed)
    )


@pytest.mark.serial  # simulated time on the wall clock: a machine loaded by other tests makes it late
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


def _virtual(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


def test_a_step_slows_as_its_sequences_hold_more_context() -> None:
    """Each step reads every sequence's KV cache: n steps of one sequence cost the sum of
    block * (a + c + k * context) with the context growing by a block a step (taken at the
    middle of each block), after the prefill of its prompt. Exact on a virtual-time loop."""
    latency = LatencyModel(base_s=0.01, per_seq_s=0.001, per_context_token_s=1e-5, prefill_per_token_s=1e-3)
    block = 16

    async def main() -> tuple[float, int]:
        clock = SimClock(0.01)
        engine = SimEngine(clock, latency, LENGTHS, token_block=block, prompt_tokens=97)
        out = await engine.generate(_req("a", 11))
        took = clock.now()
        await engine.close()
        return took, len(out.token_ids)

    took, blocks = _virtual(main())
    context = 97 + 3  # prompt_tokens beside the three prompt ids
    expected = latency.prefill_s(context) + sum(
        block * latency.step_s(1, context + j * block + block / 2) for j in range(blocks)
    )
    assert blocks == -(-LENGTHS.draw(11) // block)
    assert took == pytest.approx(expected, rel=1e-9)
    flat = block * blocks * latency.step_s(1, context)
    assert took > flat + latency.prefill_s(context)  # the growth is charged


def test_the_kv_cache_caps_the_batch_and_a_preempted_sequence_is_prefilled_again() -> None:
    """Eight requests on a cache that holds their prompts but not their answers: the batch is
    capped (never more context held than the cache), the newest are preempted and prefilled
    again when re-admitted, and every answer still comes whole, under its versions."""
    block, capacity = 16, 6_000
    latency = LatencyModel(kv_capacity_tokens=capacity, prefill_per_token_s=1e-4)
    lengths = LogNormalLengths(median=2000, sigma=0.3, cap=4000)

    async def main() -> tuple[list[Any], SimEngine]:
        engine = SimEngine(SimClock(0.01), latency, lengths, token_block=block, prompt_tokens=300)
        outs = await asyncio.gather(*[engine.generate(_req(f"r{i}", 100 + i)) for i in range(8)])
        await engine.close()
        return list(outs), engine

    outs, engine = _virtual(main())
    assert [len(o.token_ids) for o in outs] == [-(-lengths.draw(100 + i) // block) for i in range(8)]
    assert all(o.finish_reason == "stop" and set(o.versions) == {0} for o in outs)
    assert engine.preempted > 0
    assert engine.peak_context <= capacity
    prompts_only = 8 * latency.prefill_s(303)
    assert engine.prefill_s > prompts_only  # the preempted were prefilled again, with their answers so far


def test_a_queued_request_aborted_ends_having_made_nothing() -> None:
    """What a router moving a queued turn elsewhere asks (``router.rebalance_queued``): the turn
    that waits behind a full batch ends at once with no token; the running one goes on."""

    async def main() -> tuple[Any, Any, bool]:
        engine = SimEngine(
            SimClock(0.01), msgspec.structs.replace(LATENCY, max_batch=1), LENGTHS, token_block=16
        )
        running = asyncio.ensure_future(engine.generate(_req("a", 1)))
        queued = asyncio.ensure_future(engine.generate(_req("b", 2)))
        await asyncio.sleep(0.01)
        aborted = await engine.abort("b")
        cut, whole = await queued, await running
        await engine.close()
        return cut, whole, aborted and not await engine.abort("b")

    cut, whole, aborted_once = _virtual(main())
    assert aborted_once and cut.finish_reason == "abort" and cut.token_ids == [] and cut.versions == []
    assert whole.finish_reason == "stop" and len(whole.token_ids) == -(-LENGTHS.draw(1) // 16)
