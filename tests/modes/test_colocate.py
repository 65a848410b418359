"""Colocation (``cluster.colocate``): the engines sleep through each train step, their KV cache
given up, and wake for the next rollout; the torch engine's sleep refuses a busy engine and holds
requests until it wakes; a placement that cannot colocate is named before anything starts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlasync.config import ConfigError, load_config
from rlasync.engines import EngineError, GenerateRequest, SamplingParams, TorchEngine
from rlasync.models import load_pretrained_dir
from rlasync.modes import train

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])
CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _request(rid: str, tokens: int = 64) -> GenerateRequest:
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=1)
    return GenerateRequest(request_id=rid, prompt_ids=[5, 6, 7, 8], params=params)


async def test_the_torch_engine_sleeps_only_idle_and_holds_requests_until_it_wakes(
    nano_model_dir: Path,
) -> None:
    engine = TorchEngine(load_pretrained_dir(nano_model_dir)[0])
    try:
        stream = engine.generate_stream(_request("busy", tokens=200))
        await anext(stream)  # decoding: its KV cache is the engine's
        assert engine.stats().kv_cache_bytes > 0
        with pytest.raises(EngineError, match="pause the engine first"):
            await engine.sleep()
        async for _ in stream:
            pass
        await engine.sleep(offload_weights=True)  # on a CPU the weights stay where they are
        stats = engine.stats()
        assert stats.sleeping and stats.kv_cache_bytes == 0
        held = asyncio.ensure_future(engine.generate(_request("held", tokens=4)))
        await asyncio.sleep(0.3)
        assert not held.done() and engine.stats().generated_tokens == 200  # nothing decoded asleep
        await engine.wake_up()
        out = await asyncio.wait_for(held, 30)
        assert len(out.token_ids) == 4 and not engine.stats().sleeping
    finally:
        await engine.close()


@pytest.mark.timeout(300)
async def test_a_colocated_run_sleeps_its_engine_through_every_train_step(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    overrides = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={nano_model_dir}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=16",
        "train.val_size=8",
        "train.validate_every=2",
        "train.steps=2",
        "cluster.colocate=true",
    ]
    config = load_config(CONFIG, overrides)
    assert config.weights.transport == "shm"  # the same-device path, set by colocate
    await train(config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and records[2]["val_accuracy"] is not None
    for record in records[1:]:
        assert record["colocate/engines_asleep"] == 1 and record["colocate/kv_bytes_training"] == 0, record
        assert record["colocate/sleep_s"] >= 0 and record["colocate/wake_s"] >= 0
        assert record["weights/transfer_s"] > 0  # the new weights reached the woken engine


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.mode=one_step_off"], "needs train.mode=sync"),
        (["weights.transport=broadcast"], "set weights.transport=shm or auto"),
        (["engine.backend=vllm"], "use engine.device=cuda, or engine.backend=torch"),
        (
            ["cluster.start=external", "cluster.listen=tcp://10.0.0.1:1", "cluster.engines=[1]"],
            "set cluster.engines to",
        ),
    ],
)
async def test_a_placement_that_cannot_colocate_is_named(overrides: list[str], match: str) -> None:
    from rlasync.compose.placement import Placement

    with pytest.raises(ConfigError, match=match):
        Placement.of(load_config(CONFIG, ["cluster.colocate=true", *overrides]))
