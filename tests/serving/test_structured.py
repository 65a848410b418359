"""Structured outputs through the endpoint (the official ``openai`` client over HTTP, a real
torch engine): ``response_format`` json_object and json_schema, ``tool_choice`` required and
named. An untrained model's tokens, sampled within the grammar, always parse and fit the schema;
they are its own tokens (recorded as sampled) with logprobs under what it was sampled from."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from rlasync.config import EndpointConfig
from rlasync.engines import TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.serving import Endpoint

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

ASK = [{"role": "user", "content": "Who is it?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
            "required": [
                "a",
                "b",
            ],  # no additionalProperties: closed all the same, as OpenAI's strict mode takes it
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 5}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def nano() -> tuple[Any, Any]:
    return build_tiny_lm(TinyLMConfig.preset("nano", seed=3))


@pytest.fixture
async def client(nano: tuple[Any, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
    model, tok = nano
    engine = TorchEngine(model, max_batch=16, tokenizer=tok)
    async with Endpoint(engine, tok, EndpointConfig(max_n=8), model_name="nano") as endpoint:
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key="-", max_retries=0) as c:
            yield c
    await engine.close()


def _fits(value: dict[str, Any]) -> bool:
    return (
        set(value) == {"name", "age", "kind"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 120
        and value["kind"] in ("cat", "dog")
    )


async def test_a_json_schema_reply_always_parses_and_fits(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="nano",
        messages=ASK,
        n=8,
        max_tokens=200,
        temperature=1.0,
        logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        assert _fits(json.loads(choice.message.content or "")), choice.message.content
        assert choice.logprobs is not None and all(t.logprob <= 0.0 for t in choice.logprobs.content or [])


async def test_a_json_object_reply_is_an_object(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="nano",
        messages=ASK,
        n=8,
        max_tokens=400,
        temperature=1.0,
        response_format={"type": "json_object"},
    )
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished  # an untrained model may write a long object; most end within 400 tokens
    objects = [json.loads(choice.message.content or "") for choice in finished]
    assert all(isinstance(o, dict) for o in objects) and any(o for o in objects)  # any keys, not only {}


async def test_tool_choice_required_and_named_force_a_call_with_valid_arguments(
    client: openai.AsyncOpenAI,
) -> None:
    for choice_param, names in (
        ("required", {"add", "lookup"}),
        ({"type": "function", "function": {"name": "lookup"}}, {"lookup"}),
    ):
        reply = await client.chat.completions.create(
            model="nano",
            messages=ASK,
            n=6,
            max_tokens=200,
            temperature=1.0,
            tools=[ADD, LOOKUP],
            tool_choice=choice_param,
        )
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls or []
            assert call.function.name in names
            arguments = json.loads(call.function.arguments)
            if call.function.name == "add":
                assert set(arguments) == {"a", "b"} and all(
                    isinstance(v, int) and v <= 99 for v in arguments.values()
                )
            else:
                assert set(arguments) == {"word"} and len(arguments["word"]) <= 5


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
async def test_a_request_whose_structure_cannot_be_met_is_refused(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="nano", messages=ASK, max_tokens=8, **extra)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
