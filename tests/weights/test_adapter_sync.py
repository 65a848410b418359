"""LoRA's adapter-only weight sync (``trainer.lora.sync: adapter``): only the adapters travel, over
the broadcast and shared memory, and every engine (on node processes and in this one) serves the
merged model the trainer would send whole, within the rounding of one fused multiply-add; the
layers no adapter touches stay the base, bit for bit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from inspect_engine import InspectableEngine
from test_engines_sync import FAST
from tiny_batch import tiny_batch

from rlasync import LocalCluster
from rlasync.config import TrainerConfig, WeightsConfig
from rlasync.config.train import LoraSettings
from rlasync.engines import EngineConfig, Router, RouterConfig, TorchEngine
from rlasync.models import load_pretrained_dir
from rlasync.trainer import TrainerActor
from rlasync.weights import BucketPlan, ParameterSynchronizer, SyncError
from rlasync.weights.adapters import adapted_layers, engine_adapters

pytest.importorskip("peft", reason="needs peft: pip install 'rlasync[lora]'")
pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

LORA = LoraSettings(rank=4, alpha=8)


def _assert_merged(
    served: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], base: dict[str, Any], adapter: Path
) -> None:
    """``served`` is ``expected`` (peft's merge, ``W + s * (B @ A)``) up to the rounding of the two
    merges (the engine's one fused ``addmm``): each computes ``W + s * sum_k b_ik a_kj`` over r
    terms in float32, so each is within ``gamma_(r+1) = (r+1) eps / (1 - (r+1) eps)`` of
    ``|W| + s * |B| @ |A|`` of the exact sum, and they differ by at most twice that (whatever the
    CPU's order of summation). An untouched layer is the base itself."""
    from safetensors.torch import load_file

    adapters = {k.removeprefix("base_model.model."): v for k, v in load_file(str(adapter)).items()}
    assert served.keys() == expected.keys()
    scale, n = LORA.alpha / LORA.rank, LORA.rank + 1
    eps = torch.finfo(torch.float32).eps
    gamma = n * eps / (1 - n * eps)
    adapted = 0
    for name, want in expected.items():
        got, w0 = served[name].detach(), base[name]
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" not in adapters:
            assert torch.equal(got, w0) and torch.equal(want, w0), name
            continue
        adapted += not torch.equal(want, w0)
        a, b = adapters[f"{layer}.lora_A.weight"], adapters[f"{layer}.lora_B.weight"]
        bound = 2 * gamma * (w0.abs() + scale * (b.abs() @ a.abs()))
        assert bool(((got - want).abs() <= bound).all()), name
    assert adapted  # a step moved the adapters: some layers differ from the base


@pytest.mark.parametrize(
    "transport, ranks", [("broadcast", 1), ("auto", 1), ("auto", 2)], ids=["broadcast", "shm", "fsdp2-shm"]
)
async def test_engines_get_only_the_adapters_and_serve_the_merged_model(
    nano_model_dir: Path, tmp_path: Path, transport: str, ranks: int
) -> None:
    base = {n: p.detach().clone() for n, p in load_pretrained_dir(nano_model_dir)[0].named_parameters()}
    local = TorchEngine(load_pretrained_dir(nano_model_dir)[0])
    config = TrainerConfig(world_size=ranks, strategy="fsdp2", lr=1e-2, lora=LORA)  # 1 rank: unsharded
    async with (
        LocalCluster(nodes=3, config=FAST) as cluster,
        TrainerActor(config) as trainer,
    ):
        remote = list(
            await asyncio.gather(
                *[
                    cluster.spawn(
                        InspectableEngine, EngineConfig(model=str(nano_model_dir)), node=n, name=f"engine-{n}"
                    )
                    for n in (1, 2)
                ]
            )
        )
        await trainer.start(nano_model_dir)
        async with Router(remote, RouterConfig()) as router:
            sync = ParameterSynchronizer(
                WeightsConfig(bucket_mb=0.05, transport=transport), trainer, [*remote, local], router=router
            )  # type: ignore[arg-type]
            await sync.start()
            plan = msgspec.msgpack.decode(sync.plan_bytes, type=BucketPlan)
            assert plan.lora_scale == LORA.alpha / LORA.rank
            assert all(".lora_A." in t.name or ".lora_B." in t.name for t in plan.tensors)
            whole = sum(t.numel() * t.element_size() for t in base.values())
            assert plan.total_bytes < whole / 4  # rank 4 on the nano model: the adapters are a fraction
            for version in (1, 2):
                await trainer.step(tiny_batch(version))
                report = await sync.sync(version)
                assert set(report.engines.values()) == {version} and not report.removed
            expected = await trainer.weights()  # the merged model, as a merged sync sends it
            await trainer.save(tmp_path / "ckpt")  # its adapters, to bound the merges' rounding
            for served in [
                *(await asyncio.gather(*[e.parameters() for e in remote])),
                dict(local.model.named_parameters()),
            ]:
                _assert_merged(
                    served, expected, base, tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"
                )
            sync.close()
    await local.close()


async def test_an_engine_that_cannot_take_adapters_or_is_past_its_base_is_named(nano_model_dir: Path) -> None:
    layout = [("model.layers.0.self_attn.q_proj.lora_A.weight", (4, 64), "float32")]
    from rlasync.weights import plan_buckets

    unpaired = plan_buckets(layout, 1 << 20, lora_scale=2.0)
    with pytest.raises(SyncError, match="not A/B pairs: .*q_proj.lora_B.weight"):
        adapted_layers(unpaired)
    pair = plan_buckets(
        [*layout, ("model.layers.0.self_attn.q_proj.lora_B.weight", (64, 4), "float32")],
        1 << 20,
        lora_scale=2.0,
    )
    with pytest.raises(SyncError, match="set trainer.lora.sync=merged"):
        engine_adapters(object(), pair)
    engine = TorchEngine(load_pretrained_dir(nano_model_dir)[0])
    try:
        await engine.update_weights({}, version=3)
        with pytest.raises(SyncError, match="already serves weight version 3"):
            engine_adapters(engine, pair)
    finally:
        await engine.close()
