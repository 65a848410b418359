"""vLLM for real (``make test-vllm``): a quickstart rollout through engine actors and the router.

The warm-started calculator-task model answers held-out questions, calling the tool, from a
vLLM engine hosted on a node process (``engine.backend=vllm``), and its greedy answers agree
with the torch engine's on the same weights.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds its environment)")

from rlasync import LocalCluster, RuntimeConfig  # noqa: E402
from rlasync.compose.warmstart import run_episode  # noqa: E402
from rlasync.config import VLLMEngineConfig  # noqa: E402
from rlasync.config.engine import BACKENDS  # noqa: E402
from rlasync.data import make_problems  # noqa: E402
from rlasync.engines import EngineActor, Router  # noqa: E402
from rlasync.models import load_pretrained_dir  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.mark.timeout(600)
async def test_quickstart_rollout_on_vllm_matches_the_torch_engine(calc_model: Path) -> None:
    _, tokenizer = load_pretrained_dir(calc_model)
    problems = make_problems("calc", 32, seed=0, split="val")
    # vLLM's modules load big C extensions holding the GIL: import them before joining, so
    # the node's heartbeats are not starved while the engine starts (runtime.preload_modules).
    preload = ("rlasync.engines", "rlasync.engines.vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm")
    config = RuntimeConfig(preload_modules=preload, join_timeout_s=120, call_timeout_s=300)
    async with LocalCluster(nodes=2, config=config) as cluster:
        answers = {}
        for backend, node in (("vllm", 1), ("torch", 0)):
            engine = await cluster.spawn(
                EngineActor,
                BACKENDS[backend](model=str(calc_model), max_seq_len=512),
                node=node,
                name=backend,
            )
            async with Router([engine]) as router:
                episodes = await asyncio.gather(
                    *[
                        run_episode(
                            router, tokenizer, p, temperature=0, seed=0, trajectory_id=f"{backend}-{i}"
                        )
                        for i, p in enumerate(problems)
                    ]
                )
            answers[backend] = [(e.metrics.tool_calls, e.messages[-1]["content"], e.reward) for e in episodes]
        vllm, torch_ = answers["vllm"], answers["torch"]
        assert all(calls == 1 for calls, _, _ in vllm)  # every answer went through the calculator
        assert sum(r for _, _, r in vllm) >= 8  # the warm-start answers a good share right
        # Same weights, greedy: the two engines agree (fp32 kernels differ in the last bits,
        # so allow a near-tie to break differently on a few problems).
        agree = sum(a == b for a, b in zip(vllm, torch_))
        assert agree >= len(problems) - 3, (vllm, torch_)


@pytest.mark.timeout(600)
async def test_sync_grpo_with_vllm_serving_keeps_the_engine_on_the_trainers_weights(
    calc_model: Path, tmp_path: Path
) -> None:
    """The quickstart's tool run with engine.backend=vllm: vLLM samples, the trainer steps, the
    new weights go into vLLM. A large learning rate makes the step move the policy a lot, so
    a PPO ratio of 1 at step 2 means vLLM sampled with step 1's weights, not the old ones."""
    from rlasync.config import load_config
    from rlasync.modes import train_sync

    overrides = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={calc_model}",
        "train.steps=2",
        "train.prompts_per_step=8",
        "train.group_size=8",
        "train.val_size=8",
        "train.validate_every=100",
        "engine.backend=vllm",
        "engine.max_seq_len=512",
        "trainer.lr=3e-3",
    ]
    result = await train_sync(
        load_config(Path(__file__).parents[2] / "configs" / "quickstart_tools.yaml", overrides)
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 2 and [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["train/grad_norm"] > 0, records[1]  # some groups were mixed: the step moved
    for record in records[1:]:
        # vLLM's logprobs are the trainer's own, token by token. (Before the tied lm_head was
        # repacked after each update, step 2's ratios spread over 0.61-1.38.)
        assert 0.99 < record["train/ratio_min"] <= record["train/ratio_max"] < 1.01, record


def _prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = load_pretrained_dir(model_dir)[1]
    return [tokenizer.encode(f"What is {a}*{b}?") for a, b in ((12, 7), (31, 4), (9, 88), (45, 45), (3, 71))]


async def _greedy(engine: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    from rlasync.engines import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=12)
    outs = [
        await engine.generate(GenerateRequest(request_id=f"{tag}{i}", prompt_ids=p, params=params))
        for i, p in enumerate(prompts)
    ]
    return [list(o.token_ids) for o in outs]


def _big_step_batch(prompts: list[list[int]]) -> Any:
    """Four rows of one prompt, advantages of alternating sign: at lr 5e-2, a step that changes
    greedy answers."""
    from rlasync.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompts[0] + prompts[1][:4]] * 4)
    return TrainBatch(
        prompts=ids[:, :-4],
        responses=ids[:, -4:],
        response_mask=torch.ones(4, 4, dtype=torch.long),
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(ids.shape[1]).expand(4, -1).clone(),
        logprobs=-torch.rand(4, 4, generator=g) * 3,
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
    )


@pytest.mark.timeout(600)
async def test_after_a_sync_vllm_answers_as_the_torch_engine_does_under_the_same_weights(
    calc_model: Path,
) -> None:
    """The trainer takes a big step; the synchroniser moves its parameters into a vLLM engine
    and into a torch engine. vLLM's greedy answers change, and equal the torch engine's."""
    from rlasync.config import TrainerConfig, WeightsConfig
    from rlasync.engines import TorchEngine, build_engine
    from rlasync.trainer import TrainerActor
    from rlasync.weights import ParameterSynchronizer

    prompts = _prompts(calc_model)
    vllm_engine = await build_engine(VLLMEngineConfig(model=str(calc_model), max_seq_len=512))
    torch_engine = TorchEngine.from_pretrained(str(calc_model))
    before = await _greedy(vllm_engine, prompts, "b")
    batch = _big_step_batch(prompts)
    async with TrainerActor(TrainerConfig(lr=5e-2)) as trainer:
        await trainer.start(calc_model)
        await trainer.step(batch)  # a step big enough to change greedy answers
        sync = ParameterSynchronizer(
            WeightsConfig(bucket_mb=0.25), trainer, [vllm_engine, torch_engine]
        )  # one sync, both engines
        await sync.start()
        report = await sync.sync(1)
        sync.close()
    assert report.engines == {"local-0": 1, "local-1": 1} and report.transports == {
        "local-0": "shm",
        "local-1": "shm",
    }
    after_vllm, after_torch = (
        await _greedy(vllm_engine, prompts, "a"),
        await _greedy(torch_engine, prompts, "t"),
    )
    assert vllm_engine.weight_version == torch_engine.weight_version == 1
    assert after_vllm != before  # vLLM serves the new weights
    assert sum(a == b for a, b in zip(after_vllm, after_torch)) >= len(prompts) - 1, (
        after_vllm,
        after_torch,
    )  # fp32 kernels may break one near-tie
    await vllm_engine.close()
    await torch_engine.close()


@pytest.mark.timeout(600)
async def test_a_fully_async_run_trains_with_vllm_on_a_node_process(calc_model: Path, tmp_path: Path) -> None:
    """The composition with vLLM on node-1 (its agent loops beside it), the trainer's rank under
    the head: a fully asynchronous run trains every step within the staleness bound."""
    from rlasync.config import load_config
    from rlasync.modes import train

    overrides = [
        f"train.run_dir={tmp_path}",
        f"train.model_dir={calc_model}",
        "train.steps=3",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.val_size=8",
        "train.validate_every=100",
        "train.mode=fully_async",
        "async_training.staleness_threshold=1",
        "engine.backend=vllm",
        "engine.max_seq_len=512",
        "cluster.engines=[1]",
        "runtime.join_timeout_s=120",
        "runtime.call_timeout_s=300",
    ]
    records: list[dict[str, object]] = []
    result = await train(
        load_config(Path(__file__).parents[2] / "configs" / "quickstart_tools.yaml", overrides),
        on_step=records.append,
    )
    assert (
        result.steps == 3
        and [r["step"] for r in records] == [1, 2, 3]
        and all(r["cluster/engines"] == 1 for r in records)
    )
    assert max(r["async/staleness_max"] for r in records) <= 1 and records[-1]["async/version"] == 3  # type: ignore[operator]


async def test_engine_settings_are_accepted_by_vllm(calc_model: Path) -> None:
    """What GPU users set reaches vLLM's own engine configuration (the CPU build takes them)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rlasync.engines.vllm import engine_args

    config = VLLMEngineConfig(
        model=str(calc_model),
        max_seq_len=512,
        max_batch=24,
        tensor_parallel_size=1,
        gpu_memory_utilization=0.5,
        engine_kwargs={"max_num_batched_tokens": 2048},
    )
    vllm_config = AsyncEngineArgs(**engine_args(config)).create_engine_config()
    assert (
        vllm_config.parallel_config.tensor_parallel_size == 1
        and vllm_config.cache_config.gpu_memory_utilization == 0.5
    )
    assert (
        vllm_config.scheduler_config.max_num_seqs == 24
        and vllm_config.scheduler_config.max_num_batched_tokens == 2048
    )


@pytest.mark.timeout(600)
async def test_structured_outputs_and_top_logprobs_on_vllm(calc_model: Path) -> None:
    """The serving layer's grammar (llguidance's Lark) reaches vLLM's guidance backend as it is:
    every reply parses and fits the schema; and vLLM's logprobs are returned as top_logprobs."""
    from rlasync.agents.template import ChatTurns
    from rlasync.engines import SamplingParams
    from rlasync.engines.types import GenerateRequest
    from rlasync.engines.vllm import VLLMEngine

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    _, tokenizer = load_pretrained_dir(calc_model)
    engine = await VLLMEngine.create(VLLMEngineConfig(model=str(calc_model), max_seq_len=512))
    try:
        prompt = ChatTurns(tokenizer).prompt_ids([{"role": "user", "content": "What is 2+2?"}])
        params = SamplingParams(
            temperature=1.0, max_new_tokens=64, seed=0, grammar="start: %json " + json.dumps(schema)
        )
        outs = await asyncio.gather(
            *[
                engine.generate(GenerateRequest(request_id=f"r{i}", prompt_ids=list(prompt), params=params))
                for i in range(4)
            ]
        )
        ranked = SamplingParams(temperature=0.0, max_new_tokens=12, top_logprobs=3)
        top = await engine.generate(GenerateRequest(request_id="top", prompt_ids=list(prompt), params=ranked))
    finally:
        await engine.close()
    for out in outs:
        value = json.loads(tokenizer.decode(out.token_ids, skip_special_tokens=True))
        assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 999
    # top_logprobs: each position's three most likely tokens, most likely first; greedy, so the
    # first is the token picked, with its logprob.
    assert len(top.top_logprobs) == len(top.token_ids) > 0
    for token, logprob, alternatives in zip(top.token_ids, top.logprobs, top.top_logprobs):
        assert len(alternatives) == 3 and [lp for _, lp in alternatives] == sorted(
            (lp for _, lp in alternatives), reverse=True
        )
        assert alternatives[0][0] == token and alternatives[0][1] == pytest.approx(logprob, abs=1e-4)


@pytest.mark.timeout(600)
async def test_a_lora_sync_reaches_vllm_as_its_own_lora_adapter(calc_model: Path) -> None:
    """A LoRA trainer (``trainer.lora.sync: adapter``) takes a big step; the synchroniser sends
    only the adapters: vLLM loads them as a LoRA adapter (its own LoRA support on CPU), the
    torch engine merges them into its weights; both then answer greedily as one."""
    from rlasync.config import TrainerConfig, WeightsConfig
    from rlasync.config.train import LoraSettings
    from rlasync.engines import TorchEngine, build_engine
    from rlasync.trainer import TrainerActor
    from rlasync.weights import ParameterSynchronizer

    pytest.importorskip("peft", reason="needs peft (the dev extra)")
    prompts = _prompts(calc_model)
    vllm_engine = await build_engine(
        VLLMEngineConfig(model=str(calc_model), max_seq_len=512, max_lora_rank=8)
    )
    torch_engine = TorchEngine.from_pretrained(str(calc_model))
    before = await _greedy(vllm_engine, prompts, "b")
    batch = _big_step_batch(prompts)
    async with TrainerActor(TrainerConfig(lr=5e-2, lora=LoraSettings(rank=8, alpha=16))) as trainer:
        await trainer.start(calc_model)
        for _ in range(2):  # B starts at zero: the second step moves A too
            await trainer.step(batch)
        sync = ParameterSynchronizer(WeightsConfig(bucket_mb=0.25), trainer, [vllm_engine, torch_engine])
        await sync.start()
        assert sync.total_bytes < 0.2 * sum(p.numel() * 4 for p in torch_engine.model.parameters())
        report = await sync.sync(1)
        sync.close()
    assert report.engines == {"local-0": 1, "local-1": 1}
    after_vllm, after_torch = (
        await _greedy(vllm_engine, prompts, "a"),
        await _greedy(torch_engine, prompts, "t"),
    )
    assert after_vllm != before  # vLLM serves the adapter
    assert sum(a == b for a, b in zip(after_vllm, after_torch)) >= len(prompts) - 1, (after_vllm, after_torch)
    await vllm_engine.close()
    await torch_engine.close()


@pytest.mark.gpu
@pytest.mark.timeout(600)
async def test_on_a_gpu_vllm_sleeps_and_wakes_for_colocation(calc_model: Path) -> None:
    """vLLM's sleep mode (``cluster.colocate``): asleep at level 1 its weights and KV cache leave
    the GPU; awake it answers as before."""
    from rlasync.engines import GenerateRequest, SamplingParams, build_engine

    engine = await build_engine(
        VLLMEngineConfig(model=str(calc_model), device="cuda", max_seq_len=512, sleep_mode=True)
    )
    try:
        prompt = load_pretrained_dir(calc_model)[1].encode("What is 12*7?")
        params = SamplingParams(temperature=0, max_new_tokens=12)
        before = await engine.generate(GenerateRequest(request_id="b", prompt_ids=prompt, params=params))
        free = torch.cuda.mem_get_info()[0]
        await engine.sleep(offload_weights=True)  # type: ignore[attr-defined]
        assert engine.stats().sleeping and torch.cuda.mem_get_info()[0] > free
        await engine.wake_up()  # type: ignore[attr-defined]
        after = await engine.generate(GenerateRequest(request_id="a", prompt_ids=prompt, params=params))
        assert after.token_ids == before.token_ids
    finally:
        await engine.close()
