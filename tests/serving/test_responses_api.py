"""``POST /v1/responses`` through the official ``openai`` client, in front of a real torch
engine: text, a forced function call answered with its output (the second call continuing the
first token for token, recorded like chat calls), ``text.format`` json_schema, streaming, and
what is refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from rlasync.config import EndpointConfig
from rlasync.data import make_problems
from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.serving import Endpoint, samples, trajectory_of

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

CALCULATOR = {
    "type": "function",
    "name": "calculator",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    engine = TorchEngine(model, max_batch=8, tokenizer=tok)
    async with Endpoint(engine, tok, EndpointConfig(), model_name="nano") as endpoint:
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-", max_retries=0) as c:
            yield c
    await engine.close()


async def test_text_in_text_out_and_a_json_schema(client: openai.AsyncOpenAI) -> None:
    reply = await client.responses.create(model="nano", input="hi", max_output_tokens=12, temperature=0)
    assert reply.status in ("completed", "incomplete") and reply.usage is not None
    assert reply.usage.output_tokens <= 12 and reply.output_text == reply.output[0].content[0].text  # type: ignore[union-attr]
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "maximum": 9}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    shaped = await client.responses.create(
        model="nano",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say it as JSON."}]}],
        instructions="Be brief.",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
    )
    value = json.loads(shaped.output_text)
    assert set(value) == {"word", "n"} and len(value["word"]) <= 5 and value["n"] <= 9


async def test_a_stream_says_what_the_whole_reply_says(client: openai.AsyncOpenAI) -> None:
    whole = await client.responses.create(model="nano", input="hi", max_output_tokens=48, temperature=0)
    events = [
        e
        async for e in await client.responses.create(
            model="nano", input="hi", max_output_tokens=48, temperature=0, stream=True
        )
    ]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == whole.output_text and events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    # Sent as generated, not as one delta at the end (a reader that falls behind gets several
    # tokens' text in one delta, so only "more than one" is certain for a reply this long).
    assert len(deltas) > 1 and len(whole.output_text) > 1
    assert kinds.index("response.content_part.added") < kinds.index("response.output_text.delta")
    # The openai client's own stream reader rebuilds the same response from the events.
    async with client.responses.stream(
        model="nano", input="hi", max_output_tokens=48, temperature=0
    ) as stream:
        final = await stream.get_final_response()
    assert final.output_text == whole.output_text


async def test_logprobs_and_their_alternatives_come_with_the_text_when_asked(
    client: openai.AsyncOpenAI,
) -> None:
    asked: dict[str, Any] = {
        "model": "nano",
        "input": "hi",
        "max_output_tokens": 12,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 3,
    }
    whole = await client.responses.create(**asked)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs and "".join(e.token for e in part.logprobs).startswith(whole.output_text)  # type: ignore[union-attr]
    for entry in part.logprobs:  # type: ignore[union-attr]
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)  # greedy: the likeliest
    events = [e async for e in await client.responses.create(**asked, stream=True)]
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]  # type: ignore[union-attr]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in part.logprobs]  # type: ignore[union-attr]
    plain = await client.responses.create(model="nano", input="hi", max_output_tokens=4, temperature=0)
    assert not plain.output[0].content[0].logprobs  # type: ignore[union-attr]  # not asked: none


async def test_a_streamed_function_call_arrives_whole_at_its_end(client: openai.AsyncOpenAI) -> None:
    events = [
        e
        async for e in await client.responses.create(
            model="nano",
            input="2+2?",
            tools=[CALCULATOR],
            tool_choice="required",
            stream=True,  # type: ignore[list-item]
        )
    ]
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    call = events[-1].response.output[-1]  # type: ignore[union-attr]
    assert (
        call.type == "function_call"
        and call.name == "calculator"
        and "expression" in json.loads(call.arguments)
    )
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),  # none kept by that id
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content[0]",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
            "text.format",
        ),
    ],
)
async def test_what_cannot_be_served_is_refused_by_name(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str
) -> None:
    call: dict[str, Any] = {"model": "nano", "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**call)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


async def test_a_function_call_and_its_output_continue_one_recorded_sample(calc_model: Path) -> None:
    """The calculator model calls its tool through the Responses API; the client sends back the
    call and its output as items, and that call continues the first token for token."""
    from rlasync.models import load_pretrained_dir
    from rlasync.tools.calculator import calculator

    model, tok = load_pretrained_dir(calc_model)
    engine = TorchEngine(model, max_batch=8, tokenizer=tok)
    question = make_problems("calc", 1, seed=0, split="val")[0]
    async with Endpoint(engine, tok, recording=True) as endpoint:
        key = endpoint.record(SamplingParams(temperature=0.0, max_new_tokens=64))
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=key, max_retries=0) as client:
            items: list[Any] = [{"role": "user", "content": question.messages[-1]["content"]}]
            first = await client.responses.create(
                model="any", input=items, tools=[CALCULATOR], tool_choice="required"
            )
            (call,) = [o for o in first.output if o.type == "function_call"]
            assert call.name == "calculator"
            result = calculator(json.loads(call.arguments)["expression"])
            items += [o.model_dump(exclude_none=True) for o in first.output]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
            second = await client.responses.create(model="any", input=items, tools=[CALCULATOR])
            assert second.output_text  # the answer, after the tool's result
            # The same turn by reference: only the call's output is sent, after the first response.
            output = [{"type": "function_call_output", "call_id": call.call_id, "output": result}]
            third = await client.responses.create(
                model="any", input=output, tools=[CALCULATOR], previous_response_id=first.id
            )
            assert third.output_text == second.output_text  # greedy, the same conversation
        calls = endpoint.recorded(key)
    await engine.close()
    assert calls[2].prompt_ids == calls[1].prompt_ids  # token for token
    del calls[2]
    assert len(calls) == 2 and samples(calls) == [calls]  # one multi-turn sample
    t = trajectory_of(calls, response_length=1024)
    between = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].completion_ids) :]
    assert result in tok.decode(between)
    assert t.response_ids == calls[0].completion_ids + between + calls[1].completion_ids
