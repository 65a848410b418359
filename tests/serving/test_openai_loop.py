"""The ``openai`` loop: agents written as plain OpenAI-client code, trained through ``rlasync
train``; a call cut by a weight sync continues inside the endpoint."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "agents"))

from calc_run import CONFIG, ROOT, train

from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.serving import Endpoint

AGENT = ROOT / "examples" / "openai_calc_agent.py"


def openai_config(agent: str, extra: str = "") -> str:
    return f"  default_loop: openai\n  openai_agent: {agent}\n{extra}"


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_call_cut_by_a_weight_sync_goes_on_and_the_client_sees_one_reply() -> None:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    engine = TorchEngine(model, max_batch=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=200, seed=1, ignore_eos=True)
    async with Endpoint(engine, tok, recording=True) as endpoint:
        key = endpoint.record(params, "traj-0")
        async with openai.AsyncOpenAI(base_url=endpoint.url + "/v1", api_key=key, max_retries=0) as client:
            reply = asyncio.create_task(
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            )
            while not engine.stats().running:  # the call is generating
                await asyncio.sleep(0.01)
            cut = await engine.pause("abort")  # what a weight sync does
            assert cut and 0 < len(cut[0].token_ids) < 200
            await asyncio.sleep(0.2)  # the endpoint's continuation waits while the engine is paused
            await engine.resume()
            done = await asyncio.wait_for(reply, 60)
        (call,) = endpoint.recorded(key)
        counted = {f.name: f.samples[0].value for f in endpoint.metric_families() if f.samples}
    await engine.close()
    assert done.usage is not None and done.usage.completion_tokens == 200  # one reply, all of it
    assert call.aborts == 1 and len(call.completion_ids) == len(call.logprobs) == 200
    assert counted["rlasync_endpoint_sync_continuations"] == 1  # on the worker's /metrics
    assert counted["rlasync_endpoint_completion_tokens"] == 200
    assert call.completion_ids[: len(cut[0].token_ids)] == cut[0].token_ids


def run_config(
    tmp_path: Path, model: Path, agent: str, *, train_extra: str = "", agent_extra: str = ""
) -> Path:
    """calc_run's two-step calc run, its rows rolled out by the ``openai`` loop running ``agent``."""
    text = CONFIG.format(
        model=model,
        run_dir=tmp_path / "run",
        agent=f"  default_loop: openai\n  openai_agent: {agent}\n{agent_extra}",
    )
    config = tmp_path / "run.yaml"
    config.write_text(text.replace("  steps: 2\n", f"  steps: 2\n{train_extra}"))
    return config


@pytest.mark.timeout(400)  # the calculator warm-start (calc_model) is built by the first test that asks
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_an_openai_agent_trains_in_every_mode(tmp_path: Path, calc_model: Path, mode: str) -> None:
    config = run_config(
        tmp_path, calc_model, f"{AGENT}:solve", train_extra=f"  mode: {mode}\n  validate_every: 1\n"
    )
    done = train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "reward" in r]
    assert len(trained) == 2 and all(r["response_tokens"] > 0 for r in trained)
    assert all(r["rollout/tool_calls_mean"] > 0.5 for r in trained)  # the agent's calculator calls, recorded
    assert all(r.get("rollout/termination/error", 0.0) == 0.0 for r in trained)


AGENTS = """\
import openai


async def raises(client: openai.AsyncOpenAI, row: dict) -> float:
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def silent(client: openai.AsyncOpenAI, row: dict) -> float:
    return 1.0


def not_async(client, row):
    return 1.0
"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("agent", ["raises", "silent"])
def test_an_agent_that_fails_ends_its_trajectories_not_the_run(
    tmp_path: Path, calc_model: Path, agent: str
) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    done = train(run_config(tmp_path, calc_model, f"{tmp_path / 'agents.py'}:{agent}"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "reward" in r]
    assert [r["rollout/termination/error"] for r in trained] == [1.0, 1.0]
    assert all(r["reward"] == 0.0 for r in trained)
    said = "the agent's own bug" if agent == "raises" else "made no call to the endpoint"
    assert said in done.stderr


@pytest.mark.parametrize(
    ("agent", "error"),
    [
        ("{folder}/agents.py:not_async", "is not an async function"),
        ("{folder}/agents.py:missing", "defines no 'missing'"),
        ("no_such_module:solve", "cannot import 'no_such_module:solve'"),
    ],
)
def test_an_agent_that_cannot_be_used_stops_the_run_before_it_starts(
    tmp_path: Path, nano_model_dir: Path, agent: str, error: str
) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    done = train(run_config(tmp_path, nano_model_dir, agent.format(folder=tmp_path)))
    assert done.returncode == 2
    assert "agent.openai_agent" in done.stderr and error in done.stderr
