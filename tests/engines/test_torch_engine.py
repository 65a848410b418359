"""The torch engine against transformers itself: greedy tokens, logprobs, abort, pause, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from numerics import forward_rtol, rounding_close
from waiting import wait_until

from rlasync.engines import EngineError, GenerateRequest, SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm

PROMPTS = [
    "Reverse abcd",
    "What is 37*58?",
    "hello",
    "Reverse xyz please now",
    "a",
    "bb",
    "ccc dd",
    "12+34=",
    "tool",
    "f",
]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


GREEDY = _greedy(24)


@pytest.fixture(scope="module")
def nano():  # type: ignore[no-untyped-def]
    return build_tiny_lm(TinyLMConfig.preset("nano", seed=1))


def _req(i: object, ids: list[int], params: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=str(i), prompt_ids=ids, params=params)


@pytest.mark.numerics
async def test_greedy_equals_generate_token_for_token_with_requests_joining_midway(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model, max_batch=4)  # 10 requests, 4 rows: most join a batch already decoding
    ids = [tok.encode(p) for p in PROMPTS]
    lengths = [24, 5, 17, 24, 3, 11, 24, 8, 20, 1]
    outs = await asyncio.gather(
        *[engine.generate(_req(i, x, _greedy(n))) for i, (x, n) in enumerate(zip(ids, lengths))]
    )
    for x, n, out in zip(ids, lengths, outs):
        ref = model.generate(
            torch.tensor([x]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert out.token_ids == ref[0, len(x) :].tolist()
        assert out.finish_reason == "length" and len(out.logprobs) == len(out.versions) == n
    await engine.close()


@pytest.mark.numerics
async def test_logprobs_equal_a_fresh_forward_pass(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model, max_batch=3)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=20, ignore_eos=True, seed=5)
    outs = await asyncio.gather(
        *[engine.generate(_req(i, tok.encode(p), params)) for i, p in enumerate(PROMPTS[:6])]
    )
    for prompt, out in zip(PROMPTS, outs):
        x = tok.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([x + out.token_ids])).logits[0].float()
        fresh = (
            torch.log_softmax(logits / 0.7, dim=-1)[len(x) - 1 : -1]
            .gather(-1, torch.tensor(out.token_ids)[:, None])
            .flatten()
        )
        # The engine's logprobs come from a batched, KV-cached decode, these from one whole forward:
        # the same sums taken in another order, so equal up to a forward's rounding.
        assert rounding_close(
            torch.tensor(out.logprobs), fresh, forward_rtol(model.config, sequence=len(x) + 20)
        )
    await engine.close()


async def test_same_seed_same_sample(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=11)
    a = await engine.generate(_req("a", tok.encode("hello"), params))
    b = await engine.generate(_req("b", tok.encode("hello"), params))
    c = await engine.generate(
        _req(
            "c",
            tok.encode("hello"),
            SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=12),
        )
    )
    assert a.token_ids == b.token_ids != c.token_ids
    await engine.close()


async def test_stop_tokens_end_a_request(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    free = await engine.generate(_req("free", tok.encode("hello")))
    stop_at = free.token_ids[5]
    out = await engine.generate(
        _req(
            "stop",
            tok.encode("hello"),
            SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop_at]),
        )
    )
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_at
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    await engine.close()


async def test_abort_mid_generation_returns_the_partial_tokens(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    long = _greedy(500)
    chunks = []
    async for chunk in engine.generate_stream(_req("long", tok.encode("hello"), long)):
        chunks.append(chunk)
        if len(chunks) == 1:  # at once: the engine could finish 500 tokens before a 5th chunk is read
            assert await engine.abort("long") is True
    assert chunks[-1].finish_reason == "abort"
    tokens = [t for c in chunks for t in c.token_ids]
    assert 1 <= len(tokens) < 500
    assert await engine.abort("long") is False  # already over
    await engine.close()


async def test_pause_abort_returns_partials_and_resume_continues_them(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model, max_batch=2)
    long = _greedy(300)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    tasks = [asyncio.ensure_future(engine.generate(_req(i, x, long))) for i, x in enumerate(ids)]
    # Rows count as running after the step that admitted them, which gave each its first token.
    await wait_until(lambda: engine.stats().running >= 2, what="two requests are decoding")
    partials = await engine.pause("abort")
    assert len(partials) == 2 and all(p.finish_reason == "abort" and p.token_ids for p in partials)
    assert engine.stats().waiting == 1  # the third request waits, it is not lost
    await engine.resume()
    outs = await asyncio.gather(*tasks)
    assert [o.finish_reason for o in outs] == ["abort", "abort", "length"]
    # A caller resumes a partial by sending prompt + tokens so far: greedy continues exactly.
    first = partials[0]
    rest = await engine.generate(_req("again", first.prompt_ids + first.token_ids, _greedy(10)))
    ref = model.generate(
        torch.tensor([first.prompt_ids]),
        max_new_tokens=len(first.token_ids) + 10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert first.token_ids + rest.token_ids == ref[0, len(first.prompt_ids) :].tolist()
    await engine.close()


async def test_pause_wait_lets_in_flight_requests_finish(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    task = asyncio.ensure_future(engine.generate(_req("x", tok.encode("hi"), _greedy(30))))
    await wait_until(lambda: engine.stats().running >= 1, interval_s=0.005, what="the request is decoding")
    assert await engine.pause("wait", timeout=30) == []
    assert task.done() and task.result().finish_reason == "length"
    await engine.resume()
    await engine.close()


async def test_update_weights_changes_outputs_and_versions(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    fresh, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=1))  # same weights, own copy to modify
    engine = TorchEngine(fresh)
    ids = tok.encode("Reverse abcd")
    before = await engine.generate(_req("b", ids))
    assert set(before.versions) == {0}
    new = {
        name: p.detach() + 0.05 * torch.randn_like(p) for name, p in fresh.named_parameters() if "mlp" in name
    }
    await engine.update_weights(new, version=1)
    assert engine.weight_version == 1 and engine.stats().weight_version == 1
    after = await engine.generate(_req("a", ids))
    assert set(after.versions) == {1} and after.token_ids != before.token_ids
    # A request that spans an update carries both versions, in order.
    stream = engine.generate_stream(_req("span", ids, _greedy(200)))
    versions: list[int] = []
    async for chunk in stream:
        versions += chunk.versions
        if len(versions) == 5:
            await engine.update_weights({k: v + 0.01 for k, v in new.items()}, version=2)
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
    with pytest.raises(EngineError, match="no parameters named"):
        await engine.update_weights({"nope": torch.zeros(1)}, version=3)
    with pytest.raises(EngineError, match="shape"):
        await engine.update_weights({next(iter(new)): torch.zeros(1)}, version=3)
    await engine.close()


async def test_swap_weights_takes_staged_tensors_by_reference(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    copied, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=1))
    swapped, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=1))
    by_copy, by_swap = TorchEngine(copied), TorchEngine(swapped)
    staged = {
        name: p.detach() + 0.05 * torch.randn_like(p) for name, p in copied.named_parameters()
    }  # embeddings too
    await by_copy.update_weights(staged, version=1)
    pause = await by_swap.swap_weights({k: v.clone() for k, v in staged.items()}, version=1)
    assert 0 <= pause == by_swap.last_swap_s and by_swap.weight_version == 1
    ids = tok.encode("Reverse abcd")
    assert (await by_copy.generate(_req("c", ids))).token_ids == (
        await by_swap.generate(_req("s", ids))
    ).token_ids
    with pytest.raises(EngineError, match="does not fit"):
        await by_swap.swap_weights({next(iter(staged)): torch.zeros(1)}, version=2)
    await by_copy.close()
    await by_swap.close()


async def test_bad_requests_get_clear_errors(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate(_req("e", []))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await engine.generate(_req("v", [10**6]))
    with pytest.raises(EngineError, match="max_new_tokens"):
        await engine.generate(_req("m", [1], SamplingParams(max_new_tokens=0)))
    task = asyncio.ensure_future(engine.generate(_req("dup", [5, 6], _greedy(200))))
    await asyncio.sleep(0)
    with pytest.raises(EngineError, match="already running"):
        await engine.generate(_req("dup", [5, 6]))
    await engine.abort("dup")
    assert (await task).finish_reason == "abort"
    await engine.close()


async def test_the_event_loop_keeps_running_during_steps(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model, max_batch=16)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    tick_task = asyncio.ensure_future(ticker())
    steps_before = ticks
    await asyncio.gather(*[engine.generate(_req(i, tok.encode("hello"), _greedy(40))) for i in range(16)])
    tick_task.cancel()
    assert ticks - steps_before > 40  # the loop ran many times while the model computed in its thread
    await engine.close()


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    real_decode = engine._batch.decode
    calls = 0

    def broken_once(m):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("simulated out of memory")
        return real_decode(m)

    engine._batch.decode = broken_once  # type: ignore[method-assign]
    long = _greedy(50)
    results = await asyncio.gather(
        *[engine.generate(_req(i, tok.encode("hello"), long)) for i in range(3)], return_exceptions=True
    )
    assert all(isinstance(r, EngineError) and "simulated out of memory" in str(r) for r in results), results
    again = await engine.generate(_req("after", tok.encode("hello"), _greedy(5)))
    assert again.finish_reason == "length" and len(again.token_ids) == 5
    await engine.close()


async def test_a_cancelled_caller_frees_its_row(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    task = asyncio.ensure_future(engine.generate(_req("gone", tok.encode("hello"), _greedy(10_000))))
    await wait_until(lambda: engine.stats().running >= 1, interval_s=0.005, what="the request is decoding")
    task.cancel()
    await wait_until(lambda: engine.stats().running == 0, what="the cancelled request's row was freed")
    assert engine.stats().running == 0 and engine.stats().finished == 1
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(_req("late", [5]))


async def test_a_seeded_request_resumed_from_its_partial_output_samples_the_same_tokens(nano) -> None:  # type: ignore[no-untyped-def]
    model, tok = nano
    engine = TorchEngine(model)
    ids = tok.encode("Reverse abcd")
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=42)
    whole = await engine.generate(_req("whole", ids, params))
    rest = await engine.generate(
        _req(
            "rest",
            ids + whole.token_ids[:7],
            SamplingParams(temperature=1.0, max_new_tokens=13, ignore_eos=True, seed=42),
        )
    )
    assert whole.token_ids[7:] == rest.token_ids
    await engine.close()
