from __future__ import annotations

from pathlib import Path

import pytest

from rlasync.config import ConfigError, RuntimeConfig, load_config


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert cfg.runtime == RuntimeConfig()
    assert cfg.runtime.node_dead_after_s <= 5.0  # the bound on the default


def test_yaml_and_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("runtime:\n  call_timeout_s: 7\n  transport: tcp\n")
    cfg = load_config(path, ["runtime.max_inflight_per_peer=8"])
    assert cfg.runtime.call_timeout_s == 7.0
    assert cfg.runtime.transport == "tcp"
    assert cfg.runtime.max_inflight_per_peer == 8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("runtime.call_timeout_s=-1", "runtime.call_timeout_s"),
        ("runtime.call_timeout_s=soon", "runtime.call_timeout_s"),
        ("runtime.transport=udp", "runtime.transport"),
        ("runtime.no_such_knob=1", "no_such_knob"),
        ("runtime", "section.field=value"),
        ("engine.max_batch=0", "engine.max_batch"),
        ("router.on_engine_lost=ignore", "router.on_engine_lost"),
        ("router.max_inflight=3", "max_inflight"),
        ("trainer.call_timeout_s=60", "was renamed to `trainer.operation_timeout_s`"),
    ],
)
def test_bad_values_name_their_dotted_path(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_one_default_for_max_new_tokens() -> None:
    from rlasync.engines.types import SamplingParams

    assert load_config().train.max_new_tokens == SamplingParams().max_new_tokens


def test_shipped_configs_load() -> None:
    for path in Path(__file__).parents[2].joinpath("configs").glob("*.yaml"):
        load_config(path)


def test_unreadable_or_non_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_the_engine_section_is_its_backends_settings(tmp_path: Path) -> None:
    from rlasync.config import EngineConfig, SimEngineConfig, VLLMEngineConfig

    assert type(load_config().engine) is EngineConfig and load_config().engine.backend == "torch"
    path = tmp_path / "vllm.yaml"
    path.write_text("engine:\n  backend: vllm\n  gpu_memory_utilization: 0.5\n")
    vllm = load_config(path, ["engine.engine_kwargs={max_num_batched_tokens: 2048}"]).engine
    assert isinstance(vllm, VLLMEngineConfig) and vllm.gpu_memory_utilization == 0.5
    assert vllm.engine_kwargs == {"max_num_batched_tokens": 2048}
    sim = load_config(None, ["engine.backend=sim", "engine.scale=0.01", "engine.median=24"]).engine
    assert sim == SimEngineConfig(scale=0.01, median=24)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["engine.backend=nope"],
            "engine.backend='nope' is not an engine backend .*torch, vllm, sglang, sim",
        ),
        (
            ["engine.gpu_memory_utilization=0.5"],
            "`engine.gpu_memory_utilization` is a setting of engine.backend vllm, not of torch",
        ),
        (["engine.backend=sim", "engine.engine_kwargs={}"], "engine.backend vllm or sglang, not of sim"),
        (
            ["engine.backend=vllm", "engine.typo=1"],
            "unknown field `engine.typo`; engine.backend vllm takes .*gpu_memory_utilization",
        ),
        (["engine.tensor_parallel_size=2"], "tensor_parallel_size > 1 needs engine.backend vllm or sglang"),
        (["engine.backend=sim", "engine.scale=0"], "engine.scale"),
    ],
)
def test_engine_mistakes_name_the_backend(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
