"""The ``cluster`` section resolved into who runs where, and every mistake a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlasync.compose.placement import Placement
from rlasync.config import ConfigError, load_config

ROOT = Path(__file__).parents[2]


def _placement(*overrides: str, config: str = "quickstart.yaml") -> Placement:
    return Placement.of(load_config(ROOT / "configs" / config, list(overrides)))


def test_the_default_is_everything_on_the_head() -> None:
    p = _placement()
    assert (p.nodes, p.engines, p.trainer, p.loops) == (1, [0], [0], "engines")
    assert p.workers() == {0: [0]}


def test_the_quickstart_cluster_places_engines_loops_and_ranks() -> None:
    p = _placement(config="quickstart_cluster.yaml")
    assert (p.nodes, p.engines, p.trainer) == (3, [1, 2], [0, 1])
    assert p.workers() == {1: [0], 2: [1]}  # each engine's loops on its node
    assert _placement("cluster.agent_loops=head", config="quickstart_cluster.yaml").workers() == {0: [0, 1]}
    assert "engine replicas on node-1, node-2" in p.describe()


def test_replicas_per_node_and_repeated_nodes() -> None:
    p = _placement("cluster.nodes=3", "cluster.engines_per_node=2")
    assert p.engines == [1, 1, 2, 2] and p.workers() == {1: [0, 1], 2: [2, 3]}
    assert _placement("cluster.engines_per_node=2", "cluster.nodes=1").engines == [0, 0]
    assert _placement("cluster.engines=[0, 0]", "cluster.trainer=[1, 1]", "trainer.world_size=2").nodes == 2


GPU_PLACEMENT = [
    "cluster.engines=[0, 0, 1]",
    "cluster.trainer=[0, 1, 1]",
    "trainer.world_size=3",
    "engine.device=cuda",
    "engine.backend=vllm",
    "engine.tensor_parallel_size=2",
]


def test_gpus_are_shared_out_on_each_machine_engines_first() -> None:
    # Started elsewhere, each node is a machine of its own, with its own GPUs.
    external = ["cluster.start=external", "cluster.listen=tcp://10.0.0.1:29600"]
    config = load_config(ROOT / "configs" / "quickstart.yaml", GPU_PLACEMENT + external)
    p = Placement.of(config)
    assert [p.engine_device(config, r) for r in range(3)] == ["cuda:0", "cuda:2", "cuda:0"]
    assert p.trainer_devices(config) == [4, 2, 3]  # node-0: engines hold GPUs 0-3; node-1: 0-1
    # A local cluster's nodes all run on this machine: no two of them get the same GPU (an
    # engine on node-1 and rank 0 on node-0 both took GPU 0 when each node counted its own).
    config = load_config(ROOT / "configs" / "quickstart.yaml", GPU_PLACEMENT)
    p = Placement.of(config)
    assert [p.engine_device(config, r) for r in range(3)] == ["cuda:0", "cuda:2", "cuda:4"]
    assert p.trainer_devices(config) == [6, 7, 8]
    one_gpu_each = ["cluster.nodes=2", "cluster.engines=[1]", "engine.device=cuda", "engine.backend=vllm"]
    config = load_config(ROOT / "configs" / "quickstart.yaml", one_gpu_each)
    p = Placement.of(config)
    assert (p.engine_device(config, 0), p.trainer_devices(config)) == ("cuda:0", [1])
    cpu = load_config(
        ROOT / "configs" / "quickstart.yaml", ["cluster.trainer=[0, 0]", "trainer.world_size=2"]
    )
    assert (
        Placement.of(cpu).trainer_devices(cpu) == [0, 1] and Placement.of(cpu).engine_device(cpu, 0) == "cpu"
    )


def test_every_rank_decides_auto_alike_and_a_cpu_fallback_beside_gpus_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks 0-2 after one engine's GPU need GPUs 1-3. On a 3-GPU machine rank 0 and 1 would fit
    and rank 2 would not: ranks on GPUs (NCCL) and on the CPU (gloo) could not form a group, so
    all of them train on the CPU, and say why."""
    import torch

    from rlasync.trainer.device import pick_device

    config = load_config(ROOT / "configs" / "quickstart.yaml", ["engine.device=cuda", "trainer.world_size=3"])
    devices = Placement.of(config).trainer_devices(config)
    assert devices == [1, 2, 3]
    needed = max(devices) + 1  # what the trainer actor gives each rank (RankSpec.devices_needed)
    for count, expected in ((0, ["cpu"] * 3), (3, ["cpu"] * 3), (4, ["cuda:1", "cuda:2", "cuda:3"])):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda count=count: count > 0)
        caplog.clear()
        assert [str(pick_device("auto", index, needed)) for index in devices] == expected
        fell_back = [r.message for r in caplog.records if "runs on the CPU" in r.getMessage()]
        assert len(fell_back) == (3 if count == 3 else 0)
    assert str(pick_device("cpu", 1, needed)) == "cpu"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.trainer=[0, 1]"], "cluster.trainer places 2 trainer rank.*trainer.world_size=1"),
        (["cluster.engines=[]"], "cluster.engines is empty"),
        (["cluster.nodes=2", "cluster.engines=[3]"], "cluster.nodes=2 but the placement names node 3"),
        (["cluster.engines_per_node=1"], "cluster.engines_per_node needs cluster.nodes"),
        (["cluster.engines_per_node=1", "cluster.nodes=2", "cluster.engines=[1]"], "not both"),
        (["cluster.start=external"], "cluster.start=external needs cluster.listen"),
        (["engine.tensor_parallel_size=2"], "tensor_parallel_size > 1 needs engine.backend vllm or sglang"),
    ],
)
def test_placement_mistakes_are_one_line_errors_naming_the_settings(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _placement(*overrides)


def test_unknown_and_mistyped_cluster_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown field `engins` - at `cluster`"):
        _placement("cluster.engins=[1]")
    with pytest.raises(ConfigError, match="cluster.engines"):
        _placement("cluster.engines=[-1]")
    with pytest.raises(ConfigError, match="cluster.agent_loops"):
        _placement("cluster.agent_loops=somewhere")


def test_engine_settings_map_to_vllm_engine_arguments() -> None:
    """What GPU users set, as vLLM's ``AsyncEngineArgs`` (the vLLM tier checks vLLM accepts them)."""
    from rlasync.config import VLLMEngineConfig
    from rlasync.engines.vllm import engine_args

    config = VLLMEngineConfig(
        model="m",
        device="cuda:2",
        max_batch=48,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.6,
        engine_kwargs={"max_num_batched_tokens": 4096, "enable_prefix_caching": False},
    )
    args = engine_args(config)
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"], args["max_num_seqs"]) == (
        2,
        0.6,
        48,
    )
    assert (
        args["max_num_batched_tokens"] == 4096 and args["enable_prefix_caching"] is False
    )  # engine_kwargs come last
    assert args["enable_chunked_prefill"] and not args["enforce_eager"]  # the GPU defaults (CPU differs)
