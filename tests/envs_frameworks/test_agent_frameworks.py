"""Agent frameworks' structured outputs against the endpoint (``rlasync serve``'s, in front of a
real torch engine): LangChain's ``with_structured_output`` in its three methods and pydantic-ai's
output modes return parsed output, because the engine samples within the grammar the request
asks for (a JSON schema, a JSON object, a forced tool call). The model is an untrained one: what
it writes parses only because it is constrained to."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="needs langchain-openai: the envs tier, `make test-envs`"
)
pydantic_ai = pytest.importorskip("pydantic_ai", reason="needs pydantic-ai: the envs tier, `make test-envs`")

from rlasync.agents import ChatTurns  # noqa: E402
from rlasync.compose.warmstart import encode_sft, sft_batch, sft_step  # noqa: E402
from rlasync.config import EndpointConfig  # noqa: E402
from rlasync.data.synthetic import Problem  # noqa: E402
from rlasync.engines import TorchEngine  # noqa: E402
from rlasync.models import TinyLMConfig, build_tiny_lm  # noqa: E402
from rlasync.serving import Endpoint  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_factories=["asyncio"]), pytest.mark.timeout(300)]


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


@pytest.fixture
async def url() -> AsyncIterator[str]:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    engine = TorchEngine(model, max_batch=8, tokenizer=tok)
    async with Endpoint(engine, tok, EndpointConfig(default_max_tokens=160), model_name="nano") as endpoint:
        yield endpoint.url + "/v1"
    await engine.close()


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
async def test_langchain_with_structured_output(url: str, method: str) -> None:
    import openai

    chat = langchain_openai.ChatOpenAI(
        base_url=url, api_key="-", model="nano", temperature=1.0, max_retries=0, max_tokens=400
    )
    # json_mode asks for any JSON object (the schema only reaches the model through the prompt),
    # so LangChain parses it against a schema given as a dict: any object passes. An open object
    # has no length an untrained model must stop at: a reply cut by max_tokens is the one failure
    # allowed, and at least one of six must parse.
    schema: Any = {"title": "Anything", "type": "object"} if method == "json_mode" else Pet
    structured = chat.with_structured_output(schema, method=method)
    parsed = 0
    for _ in range(3 if method != "json_mode" else 6):
        try:
            out = await structured.ainvoke("Describe a pet as JSON.")
        except openai.LengthFinishReasonError:
            assert method == "json_mode"
            continue
        assert isinstance(out, dict) if method == "json_mode" else isinstance(out, Pet), out
        parsed += 1
    assert parsed >= (1 if method == "json_mode" else 3)


@pytest.mark.parametrize("mode", ["tool", "native"])
async def test_pydantic_ai_output_modes(url: str, mode: str) -> None:
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    profile = OpenAIModelProfile(supports_json_schema_output=True, supports_json_object_output=True)
    model = OpenAIChatModel("nano", provider=OpenAIProvider(base_url=url, api_key="-"), profile=profile)
    output = ToolOutput(Pet) if mode == "tool" else NativeOutput(Pet)
    agent = Agent(model, output_type=output, model_settings={"temperature": 1.0})
    for _ in range(3):
        result = await agent.run("Describe a pet.")
        assert isinstance(result.output, Pet), result.output


def _warm_start_on_pets(model: Any, tokenizer: Any, steps: int = 100) -> None:
    """Supervised steps on chats whose replies are pets as JSON, written as the ``json_object``
    grammar writes JSON (``json.dumps``' separators): a model that has seen the task, as a
    prompted output needs. The grammar guarantees an object; only training puts the schema's
    keys in it (a model this small does not read a schema from its prompt)."""
    import torch

    rng = random.Random(0)
    turns = ChatTurns(tokenizer)
    asks = ["Describe a pet.", "A pet, please.", "Tell me about a pet.", "Name an animal you like."]
    schema_note = "Always respond with a JSON object that's compatible with this schema:\n\n"
    rows = []
    for i in range(256):
        pet = {"name": rng.choice(["Rex", "Tom", "Kit", "Max", "Bo"]), "age": rng.randint(1, 9)}
        pet["kind"] = rng.choice(["cat", "dog"])
        system = [{"role": "system", "content": schema_note + json.dumps(Pet.model_json_schema())}]
        messages = system * rng.randint(0, 1) + [{"role": "user", "content": rng.choice(asks)}]
        target = [{"role": "assistant", "content": json.dumps(pet)}]
        rows.append(
            encode_sft(turns, Problem(task="pet", key=str(i), messages=messages, answer="", target=target))
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        sft_step(model, optimizer, *sft_batch(rng.sample(rows, 32), tokenizer.pad_token_id))
    model.eval()


async def test_pydantic_ai_prompted_output_on_a_warm_started_model() -> None:
    """pydantic-ai's third mode: the schema reaches the model only through the prompt, and the
    request asks for ``json_object``. The grammar makes every reply an object; a short
    warm-start on the task makes it a pet (pydantic-ai validates it, retrying once if not)."""
    from pydantic_ai import Agent, PromptedOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    _warm_start_on_pets(model, tok)
    engine = TorchEngine(model, max_batch=8, tokenizer=tok)
    async with Endpoint(engine, tok, EndpointConfig(default_max_tokens=160), model_name="nano") as endpoint:
        profile = OpenAIModelProfile(supports_json_object_output=True)
        provider = OpenAIProvider(base_url=endpoint.url + "/v1", api_key="-")
        chat = OpenAIChatModel("nano", provider=provider, profile=profile)
        agent = Agent(chat, output_type=PromptedOutput(Pet), model_settings={"temperature": 1.0})
        for _ in range(3):
            result = await agent.run("Describe a pet.")
            assert isinstance(result.output, Pet), result.output
    await engine.close()


async def test_openai_agents_sdk_default_responses_model_and_output_type(url: str) -> None:
    """The Agents SDK's default model speaks the Responses API; ``output_type`` asks for a JSON
    schema through ``text.format``, which the engine's grammar meets (an untrained model's free
    text would run to its token limit: the SDK takes that as a failure, rightly)."""
    agents = pytest.importorskip("agents", reason="needs openai-agents: the envs tier, `make test-envs`")
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0)
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    settings = agents.ModelSettings(temperature=1.0, max_tokens=64)
    shaped = agents.Agent(
        name="shaped", instructions="Describe a pet.", model="nano", output_type=Pet, model_settings=settings
    )
    for _ in range(3):
        result = await agents.Runner.run(shaped, "A pet, please.")
        assert isinstance(result.final_output, Pet), result.final_output
    await client.close()
