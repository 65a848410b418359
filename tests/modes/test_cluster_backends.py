"""Engine backends on a placement: what GPU users set reaches the engine on its node, and a run
trains and syncs weights into an SGLang engine (the fake: SGLang has no CPU build) on a node.
vLLM's turn is in the vLLM tier (``tests/engines/test_vllm.py``), real SGLang's in ``gpu`` tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlasync import LocalCluster, RuntimeConfig
from rlasync.compose.run import Run
from rlasync.config import SGLangEngineConfig, load_config
from rlasync.engines import EngineActor
from rlasync.modes import train_sync

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

ROOT = Path(__file__).parents[2]
ENGINES = ROOT / "tests" / "engines"  # fake_sglang_backend lives there; node processes import it by name
PRELOAD = ["rlasync.engines", "fake_sglang_backend"]


@pytest.fixture(autouse=True)
def _importable_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENGINES))  # node processes get this process's path


async def test_gpu_settings_reach_the_sglang_engine_on_its_node(nano_model_dir: Path) -> None:
    from fake_sglang_backend import SGLangInspector

    config = SGLangEngineConfig(
        model=str(nano_model_dir),
        device="cuda:1",
        tensor_parallel_size=2,
        mem_fraction_static=0.55,
        max_batch=8,
        engine_kwargs={"enable_deterministic_inference": True, "log_level": "warning"},
    )
    runtime = RuntimeConfig(join_timeout_s=60, preload_modules=tuple(PRELOAD))
    async with LocalCluster(nodes=2, config=runtime) as cluster:
        await cluster.spawn(EngineActor, config, node=1, name="engine-0")
        inspector = await cluster.spawn(SGLangInspector, node=1, name="inspector")
        args: dict[str, Any] = await inspector.server_args("engine-0")
    assert {
        k: args[k]
        for k in ("tp_size", "mem_fraction_static", "max_running_requests", "base_gpu_id", "device")
    } == {
        "tp_size": 2,
        "mem_fraction_static": 0.55,
        "max_running_requests": 8,
        "base_gpu_id": 1,
        "device": "cuda",
    }
    assert (
        args["enable_deterministic_inference"] and args["log_level"] == "warning"
    )  # engine_kwargs, as given


async def test_a_sync_run_trains_with_an_sglang_engine_on_a_node(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    config = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            f"train.run_dir={tmp_path}",
            f"train.model_dir={nano_model_dir}",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.group_size=2",
            "train.max_new_tokens=8",
            "train.val_size=4",
            "cluster.engines=[1]",
            "engine.backend=sglang",
            "engine.device=cuda",
            "engine.engine_kwargs={enable_deterministic_inference: true}",
            "runtime.join_timeout_s=60",
            f"runtime.preload_modules={PRELOAD}",
            "weights.transport=broadcast",
        ],
    )
    records: list[dict[str, Any]] = []
    run = await Run.open(config)
    await train_sync(config, run=run, on_step=records.append)
    assert [r["step"] for r in records] == [1, 2] and all(r["cluster/engines"] == 1 for r in records)
    assert all(
        r["weights/transfer_s"] > 0 for r in records
    )  # each version crossed to the SGLang engine on node-1
