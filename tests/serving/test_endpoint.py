"""The OpenAI-compatible endpoint, spoken to by the official ``openai`` package over real HTTP,
in front of a real torch engine (a nano model built from its config)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rlasync.config import EndpointConfig
from rlasync.data import make_problems
from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.serving import Endpoint, samples, trajectory_of
from rlasync.tools.calculator import CALCULATOR, calculator

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def nano() -> tuple[Any, Any]:
    return build_tiny_lm(TinyLMConfig.preset("nano", seed=3))


@pytest.fixture
async def served(nano: tuple[Any, Any]) -> AsyncIterator[tuple[Endpoint, TorchEngine, openai.AsyncOpenAI]]:
    model, tok = nano
    engine = TorchEngine(model, max_batch=16)
    config = EndpointConfig(max_request_bytes=4096, max_n=4)
    async with Endpoint(engine, tok, config, model_name="nano") as endpoint:
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-", max_retries=0) as client:
            yield endpoint, engine, client
    await engine.close()


async def test_chat_n_choices_logprobs_and_usage_as_generated(served: Any) -> None:
    endpoint, engine, client = served
    reply = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=6, n=3, logprobs=True, seed=5, temperature=1.0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in reply.choices if c.logprobs and c.logprobs.content
    )
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        assert all(t.logprob <= 0.0 for t in choice.logprobs.content)  # type: ignore[union-attr]
    again = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=6, n=3, logprobs=True, seed=5, temperature=1.0
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]  # seeded
    greedy = await client.chat.completions.create(model="nano", messages=HI, max_tokens=6, temperature=0)
    assert greedy.choices[0].message.role == "assistant"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["nano"]


async def test_top_logprobs_are_each_positions_most_likely_tokens(served: Any) -> None:
    endpoint, engine, client = served
    reply = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=8, logprobs=True, top_logprobs=3, temperature=0
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:  # greedy: the token is the most likely one, with the same logprob
        ranked = [a.logprob for a in t.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    chunks = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=8, logprobs=True, top_logprobs=3, temperature=0, stream=True
    )
    streamed = [
        t async for chunk in chunks for c in chunk.choices if c.logprobs for t in c.logprobs.content or []
    ]
    assert [(t.token, [a.logprob for a in t.top_logprobs]) for t in streamed] == [
        (t.token, [a.logprob for a in t.top_logprobs]) for t in content
    ]
    legacy = await client.completions.create(
        model="nano", prompt="hi", max_tokens=5, logprobs=2, temperature=0
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    for token, logprob, top in zip(logprobs.tokens or [], logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and top[token] == logprob  # (two tokens may decode to one text)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="nano", messages=HI, max_tokens=2, top_logprobs=2)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "top_logprobs"


async def test_streaming_sends_what_the_whole_reply_says(served: Any) -> None:
    endpoint, engine, client = served
    whole = await client.chat.completions.create(model="nano", messages=HI, max_tokens=12, temperature=0)
    stream = await client.chat.completions.create(
        model="nano",
        messages=HI,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    completion = await client.completions.create(model="nano", prompt="abc", max_tokens=5, temperature=0)
    streamed = await client.completions.create(
        model="nano", prompt="abc", max_tokens=5, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in streamed]) == completion.choices[0].text


async def test_a_stop_string_ends_the_reply_before_it(served: Any, nano: Any) -> None:
    endpoint, engine, client = served
    whole = await client.chat.completions.create(model="nano", messages=HI, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content or ""
    stop = next(
        (text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip() == text[i : i + 2]), None
    )
    if stop is None:
        pytest.skip("the greedy reply has no usable stop string")
    cut = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("call", "status", "param"),
    [
        ({"model": "gpt-4", "messages": HI}, 404, "model"),
        ({"model": "nano", "messages": HI, "temperature": 3}, 400, "temperature"),
        ({"model": "nano", "messages": HI, "n": 9}, 400, "n"),
        ({"model": "nano", "messages": []}, 400, "messages"),
        ({"model": "nano", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": "nano", "messages": HI, "tool_choice": "required"}, 400, "tool_choice"),  # and no tools
        (
            {
                "model": "nano",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in it?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ],
            },
            400,
            "messages[0].content[1]",
        ),
        ({"model": "nano", "messages": HI, "response_format": {"type": "yaml"}}, 400, "response_format"),
        ({"model": "nano", "messages": HI, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": "nano", "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "nano", "messages": HI, "seed": -1}, 400, "seed"),
    ],
)
async def test_bad_requests_get_openais_error_shape(
    served: Any, call: dict[str, Any], status: int, param: str
) -> None:
    endpoint, engine, client = served
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(**call)
    assert caught.value.status_code == status
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"]


async def test_an_oversize_request_and_a_long_prompt_are_refused(served: Any) -> None:
    endpoint, engine, client = served
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="nano", messages=[{"role": "user", "content": "x" * 5000}])
    assert caught.value.status_code == 413 and "max_request_bytes" in str(caught.value.body)
    too_long = [{"role": "user", "content": "ab " * 1300}]  # under 4 KiB of JSON, over the model's context
    with pytest.raises(openai.BadRequestError) as long_error:
        await client.chat.completions.create(model="nano", messages=too_long)
    assert "max_seq_len" in str(long_error.value.body)
    async with httpx.AsyncClient(base_url=endpoint.url) as http:
        garbage = await http.post(
            "/v1/chat/completions", content=b"\x00{not json", headers={"content-type": "application/json"}
        )
        assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request_error"


async def test_requests_statuses_and_tokens_are_on_the_nodes_metrics_page(served: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from rlasync.metrics.exporter import Exporter

    endpoint, engine, client = served
    reply = await client.chat.completions.create(model="nano", messages=HI, max_tokens=5, seed=1)
    streamed = await client.chat.completions.create(
        model="nano", messages=HI, max_tokens=4, seed=2, stream=True
    )
    async for _ in streamed:
        pass
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=HI)
    await client.models.retrieve("nano")
    exporter = Exporter(asyncio.get_running_loop(), labels={"node": "node-0", "role": "test"})
    exporter.add(lambda: endpoint.metric_families(worker="w0"))
    port = exporter.start(0)
    try:
        async with httpx.AsyncClient() as http:
            page = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        exporter.close()
    samples = {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("node", "role", "worker"))),
        ): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name.startswith("rlasync_endpoint_")
    }
    chat = "/v1/chat/completions"
    assert samples[("rlasync_endpoint_requests_total", (("route", chat), ("status", "200")))] == 2
    assert samples[("rlasync_endpoint_requests_total", (("route", chat), ("status", "404")))] == 1
    assert (
        samples[("rlasync_endpoint_requests_total", (("route", "/v1/models/{model}"), ("status", "200")))]
        == 1
    )
    assert samples[("rlasync_endpoint_request_seconds_count", (("route", chat),))] == 3
    assert reply.usage is not None
    assert samples[("rlasync_endpoint_completion_tokens_total", ())] >= reply.usage.completion_tokens + 1
    assert samples[("rlasync_endpoint_active_requests", ())] == 0
    assert samples[("rlasync_endpoint_sync_continuations_total", ())] == 0


async def test_a_client_that_disconnects_mid_stream_aborts_its_generation(served: Any) -> None:
    endpoint, engine, client = served
    async with httpx.AsyncClient(base_url=endpoint.url, timeout=30) as http:
        # Seed 26: the nano model's 300 tokens hold no end of turn (seed 7's end after 17).
        body = {
            "model": "nano",
            "messages": HI,
            "max_tokens": 300,
            "stream": True,
            "temperature": 1.0,
            "seed": 26,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # a token arrived: the generation runs; go away
            assert engine.stats().running == 1
    finished = engine.stats().finished
    for _ in range(200):  # the engine hears of it within seconds, well before 300 tokens
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().running == 0 and engine.stats().finished == finished + 1
    assert endpoint._active == 0  # noqa: SLF001  (the stream's slot was given back)


async def test_concurrency_beyond_the_limit_is_429(nano: Any) -> None:
    model, tok = nano
    engine = TorchEngine(model, max_batch=4)
    async with Endpoint(
        engine, tok, EndpointConfig(max_concurrent_requests=2), model_name="nano"
    ) as endpoint:
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-", max_retries=0) as client:
            calls = [
                client.chat.completions.create(
                    model="nano", messages=HI, max_tokens=300, temperature=1.0, seed=26
                )
                for _ in range(6)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
    await engine.close()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused and len(refused) <= 4
    assert all(not isinstance(r, BaseException) or isinstance(r, openai.RateLimitError) for r in results)


async def test_tool_calls_recorded_per_key_and_continued_token_for_token(calc_model: Path) -> None:
    """The calculator model (warm-started) calls its tool through the API; the client sends the
    conversation back with the tool's result, and that call continues the first token for token
    (the environment's tokens between); a call that edits history is a sample of its own."""
    from rlasync.models import load_pretrained_dir

    model, tok = load_pretrained_dir(calc_model)
    engine = TorchEngine(model, max_batch=8)
    question = make_problems("calc", 1, seed=0, split="val")[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    async with Endpoint(engine, tok, recording=True) as endpoint:
        key = endpoint.record(params)
        async with openai.AsyncOpenAI(
            base_url=endpoint.url + "/v1", api_key="not-a-key", max_retries=0
        ) as stranger:
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model="any", messages=HI)
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=key, max_retries=0) as client:
            messages: list[dict[str, Any]] = list(question.messages)
            first = await client.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR])
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
            call = message.tool_calls[0]
            assert call.function.name == "calculator" and "expression" in json.loads(call.function.arguments)
            streamed = await client.chat.completions.create(
                model="any", messages=messages, tools=[CALCULATOR], stream=True
            )
            deltas = [chunk.choices[0] async for chunk in streamed if chunk.choices]
            (sent,) = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]  # whole, in one chunk
            assert [(c.index, c.function.name, c.function.arguments) for c in sent] == [  # type: ignore[union-attr]
                (0, "calculator", call.function.arguments)
            ]
            assert deltas[-1].finish_reason == "tool_calls"
            result = calculator(json.loads(call.function.arguments)["expression"])
            messages += [
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result},
            ]
            second = await client.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR])
            assert second.choices[0].message.content  # the answer, after the tool's result
            edited = [*messages[:1], {"role": "user", "content": "What is 2 * 3?"}]
            await client.chat.completions.create(
                model="any", messages=edited, tools=[CALCULATOR], max_tokens=4
            )
            # Sent with X-Rlasync-Train: false, a call is answered but kept out of the trajectory.
            aside = client.with_options(default_headers={"X-Rlasync-Train": "false"})
            reply = await aside.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR])
            assert reply.choices[0].finish_reason in ("stop", "tool_calls", "length")
        calls = endpoint.recorded(key)
        assert endpoint.recorded(key) == []  # handed over once
    await engine.close()
    assert len(calls) == 4 and calls[0].tool_calls == 1  # not the one sent aside
    del calls[1]  # the streamed repeat of the first call: greedy, the same tokens
    groups = samples(calls)
    assert groups == [calls[:2], calls[2:]]
    between = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].completion_ids) :]
    assert result in tok.decode(between)  # the tool's result is the environment's
    t = trajectory_of(calls[:2], response_length=1024)
    assert t.response_ids == calls[0].completion_ids + between + calls[1].completion_ids
    assert t.response_mask == [1] * len(calls[0].completion_ids) + [0] * len(between) + [1] * len(
        calls[1].completion_ids
    )
    assert [v for v, m in zip(t.versions, t.response_mask) if not m] == [-1] * len(between)
    assert all(len(c.completion_ids) == len(c.logprobs) == len(c.versions) for c in calls)
