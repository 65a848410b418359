"""The SGLang adapter against a fake ``sglang.Engine`` (tests/engines/fake_sglang.py) serving a real
tiny model, and, on a CUDA machine with SGLang installed, against SGLang itself (``gpu``)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from fake_sglang import ContinueGenerationReqInput, PauseGenerationReqInput, make_fake_sglang_engine
from numerics import forward_rtol, rounding_close
from waiting import wait_until

from rlasync.config import SGLangEngineConfig
from rlasync.engines import EngineError, GenerateOutput, GenerateRequest, SamplingParams
from rlasync.engines.sglang import SGLangAPI, SGLangEngine, build_sglang, checkpoint_shapes, engine_kwargs
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir
from rlasync.models.tiny import load_tokenizer

uvloop = pytest.mark.asyncio(loop_factories=["uvloop"])  # the loop SGLang itself installs

PROMPTS = ["Reverse abcd", "What is 37*58?", "hello", "Reverse xyz please now", "a", "12+34="]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def _req(rid: object, ids: list[int], params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(request_id=str(rid), prompt_ids=ids, params=params)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=1))
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("sglang-nano"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    return load_pretrained_dir(model_dir)


def _hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    tokens: list[int] = out[0, len(ids) :].tolist()
    return tokens


def _fresh_logits(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@uvloop
async def test_greedy_tokens_and_logprobs_equal_transformers(
    model_dir: Path, reference: tuple[Any, Any], incremental: bool
) -> None:
    model, tok = reference
    engine = await make_fake_sglang_engine(
        str(model_dir), max_batch=3, incremental_streaming_output=incremental
    )
    ids = [tok.encode(p) for p in PROMPTS]
    lengths = [24, 5, 17, 24, 3, 11]

    async def streamed(i: int) -> GenerateOutput:
        chunks = [chunk async for chunk in engine.generate_stream(_req(i, ids[i], _greedy(lengths[i])))]
        return GenerateOutput(
            request_id=str(i),
            prompt_ids=ids[i],
            token_ids=[t for c in chunks for t in c.token_ids],
            logprobs=[p for c in chunks for p in c.logprobs],
            versions=[v for c in chunks for v in c.versions],
            finish_reason=chunks[-1].finish_reason or "abort",
        )

    # Six requests on three slots (the rest wait in the adapter, then join a batch already decoding);
    # half stream, half do not.
    outs = await asyncio.gather(
        *[
            engine.generate(_req(i, x, _greedy(n))) if i % 2 else streamed(i)
            for i, (x, n) in enumerate(zip(ids, lengths))
        ]
    )
    for x, n, out in zip(ids, lengths, outs):
        assert out.token_ids == _hf_greedy(model, x, n) and out.finish_reason == "length"
        assert out.versions == [0] * n
        fresh = (
            torch.log_softmax(_fresh_logits(model, x, out.token_ids), dim=-1)
            .gather(-1, torch.tensor(out.token_ids)[:, None])
            .flatten()
        )
        # Greedy: under temperature 1. Batched and KV-cached against one whole forward: equal up
        # to a forward's rounding (numerics.forward_rtol).
        rtol = forward_rtol(model.config, sequence=len(x) + n)
        assert rounding_close(torch.tensor(out.logprobs), fresh, rtol)
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.finished == 6 and stats.kv_cache_bytes > 0
    await engine.close()


@uvloop
async def test_sampled_logprobs_are_temperature_scaled_and_seeds_reproduce(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=20, ignore_eos=True, seed=5)
    outs = await asyncio.gather(
        *[engine.generate(_req(i, tok.encode(p), params)) for i, p in enumerate(PROMPTS[:4])]
    )
    for prompt, out in zip(PROMPTS, outs):
        x = tok.encode(prompt)
        fresh = torch.log_softmax(_fresh_logits(model, x, out.token_ids) / 0.7, dim=-1)
        assert rounding_close(  # as above
            torch.tensor(out.logprobs),
            fresh.gather(-1, torch.tensor(out.token_ids)[:, None]).flatten(),
            forward_rtol(model.config, sequence=len(x) + 20),
        )
    again = await engine.generate(_req("again", tok.encode(PROMPTS[0]), params))
    other = await engine.generate(
        _req(
            "other",
            tok.encode(PROMPTS[0]),
            SamplingParams(temperature=0.7, max_new_tokens=20, ignore_eos=True, seed=6),
        )
    )
    assert again.token_ids == outs[0].token_ids != other.token_ids
    await engine.close()


@uvloop
async def test_seeds_are_dropped_with_a_warning_when_sglang_ignores_them(
    model_dir: Path, reference: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir), enable_deterministic_inference=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=1)
    await engine.generate(_req("s1", tok.encode("hello"), params))
    await engine.generate(_req("s2", tok.encode("hello"), params))
    assert sum("ignores per-request seeds" in r.getMessage() for r in caplog.records) == 1
    await engine.close()


@uvloop
async def test_stop_tokens_and_max_seq_len(model_dir: Path, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir), max_seq_len=40)
    ids = tok.encode("hello")
    free = await engine.generate(_req("free", ids, _greedy(24)))
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = await engine.generate(
        _req(
            "stop",
            ids,
            SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop_at]),
        )
    )
    assert (
        out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    )  # the stop token is kept
    # The prompt plus max_new_tokens passes max_seq_len: cut there with "length", as the torch engine does.
    long = await engine.generate(_req("long", ids, _greedy(500)))
    assert long.finish_reason == "length" and len(ids) + len(long.token_ids) == 40
    await engine.close()


@uvloop
async def test_abort_mid_stream_returns_the_partial_tokens(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    chunks = []
    async for chunk in engine.generate_stream(_req("long", tok.encode("hello"), _greedy(800))):
        chunks.append(chunk)
        if len(chunks) == 5:
            assert await engine.abort("long") is True
    assert chunks[-1].finish_reason == "abort"
    tokens = [t for c in chunks for t in c.token_ids]
    assert 5 <= len(tokens) < 800 and len([v for c in chunks for v in c.versions]) == len(tokens)
    assert await engine.abort("long") is False and await engine.abort("never") is False
    assert not engine.engine.tokenizer_manager.rid_to_state  # SGLang let go of it too
    await engine.close()


@uvloop
async def test_pause_abort_returns_partials_keeps_the_queue_and_resume_continues(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir), max_batch=2)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    tasks = [asyncio.ensure_future(engine.generate(_req(i, x, _greedy(300)))) for i, x in enumerate(ids)]
    await wait_until(
        lambda: engine.stats().running == 2, timeout_s=30, interval_s=0.005, what="two requests have tokens"
    )
    partials = await engine.pause("abort")
    assert sorted(p.request_id for p in partials) == ["0", "1"]
    assert all(
        p.finish_reason == "abort" and p.token_ids and len(p.logprobs) == len(p.versions) == len(p.token_ids)
        for p in partials
    )
    assert engine.stats().waiting == 1 and engine.stats().running == 0 and engine.stats().paused
    late = asyncio.ensure_future(engine.generate(_req("late", ids[0], _greedy(4))))
    await asyncio.sleep(0.2)
    assert not tasks[2].done() and not late.done()  # nothing runs while paused
    await engine.resume()
    outs = await asyncio.gather(*tasks, late)
    assert [o.finish_reason for o in outs] == ["abort", "abort", "length", "length"]
    # A caller resumes a partial by sending prompt + tokens so far: greedy continues exactly.
    first = partials[0]
    rest = await engine.generate(_req("again", first.prompt_ids + first.token_ids, _greedy(10)))
    assert first.token_ids + rest.token_ids == _hf_greedy(model, first.prompt_ids, len(first.token_ids) + 10)
    await engine.close()


@uvloop
async def test_a_request_paused_before_its_first_token_is_requeued_unseen(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    ids = tok.encode("hello")
    scheduler = engine.engine.tokenizer_manager.auto_create_handle_loop()
    scheduler.pause(retract=False)  # SGLang's scheduler keeps it queued, not yet prefilled (a full KV pool)
    task = asyncio.ensure_future(engine.generate(_req("early", ids, _greedy(6))))
    await wait_until(
        lambda: len(scheduler.waiting) == 1, timeout_s=30, interval_s=0.005, what="SGLang queued the request"
    )
    assert await engine.pause("abort") == []  # nothing had a token: nothing to hand back
    assert engine.stats().waiting == 1 and not task.done()
    scheduler.resume()
    await engine.resume()
    out = await task
    assert out.finish_reason == "length" and out.token_ids == _hf_greedy(model, ids, 6)
    await engine.close()


@uvloop
async def test_pause_wait_lets_in_flight_requests_finish(model_dir: Path, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    task = asyncio.ensure_future(engine.generate(_req("x", tok.encode("hi"), _greedy(30))))
    await wait_until(
        lambda: engine.stats().running == 1, timeout_s=30, interval_s=0.005, what="the request has tokens"
    )
    assert await engine.pause("wait", timeout=30) == []
    assert task.done() and task.result().finish_reason == "length"
    queued = asyncio.ensure_future(engine.generate(_req("y", tok.encode("hi"), _greedy(3))))
    await asyncio.sleep(0.1)
    assert not queued.done() and engine.stats().waiting == 1
    await engine.resume()
    assert (await queued).finish_reason == "length"
    long = asyncio.ensure_future(engine.generate(_req("z", tok.encode("hi"), _greedy(800))))
    await wait_until(
        lambda: engine.stats().running == 1, timeout_s=30, interval_s=0.005, what="the request has tokens"
    )
    with pytest.raises(TimeoutError):  # "wait" gives up at its timeout while a request runs on
        await engine.pause("wait", timeout=0.05)
    await engine.abort("z")
    assert (await long).finish_reason == "abort"
    await engine.close()


@uvloop
async def test_update_weights_changes_outputs_and_records_the_version(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    ids = tok.encode("Reverse abcd")
    before = await engine.generate(_req("b", ids, _greedy(24)))
    original = {name: p.detach().clone() for name, p in model.named_parameters() if "mlp" in name}
    changed = {name: t + 0.2 * torch.randn_like(t) for name, t in original.items()}
    await engine.update_weights(changed, version=1)
    assert engine.weight_version == 1 and engine.stats().weight_version == 1
    assert engine.engine.server_args.weight_version == "1"  # SGLang's own record of it
    after = await engine.generate(_req("a", ids, _greedy(24)))
    assert set(after.versions) == {1} and after.token_ids != before.token_ids
    # Outside a pause, SGLang's update waits for the request in flight: it keeps one version.
    stream = engine.generate_stream(_req("span", ids, _greedy(60)))
    versions: list[int] = []
    update = None
    async for chunk in stream:
        versions += chunk.versions
        if update is None:
            update = asyncio.ensure_future(engine.update_weights(original, version=2))
    assert update is not None
    await update
    assert versions == [1] * 60 and engine.weight_version == 2
    restored = await engine.generate(_req("r", ids, _greedy(24)))
    assert restored.token_ids == before.token_ids and set(restored.versions) == {2}
    with pytest.raises(EngineError, match="no parameters named"):
        await engine.update_weights({"nope": torch.zeros(1)}, version=3)
    with pytest.raises(EngineError, match="shape"):
        await engine.update_weights({next(iter(original)): torch.zeros(1)}, version=3)
    assert engine.weight_version == 2
    await engine.close()


def _trainer_batch() -> Any:
    from rlasync.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts, responses = (
        torch.randint(3, 300, (4, 5), generator=g),
        torch.randint(3, 300, (4, 6), generator=g),
    )
    return TrainBatch(
        prompts=prompts,
        responses=responses,
        response_mask=torch.ones(4, 6, dtype=torch.long),
        attention_mask=torch.ones(4, 11, dtype=torch.long),
        position_ids=torch.arange(11).expand(4, -1).clone(),
        logprobs=-torch.rand(4, 6, generator=g),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )


async def _sync_from_trainer(model_dir: Path, sglang: Any, lora: Any = None) -> None:
    """A trainer step on ``model_dir``'s weights, synchronised into ``sglang`` and into a torch
    engine together: both then answer greedily alike, and not as before. ``lora``: a LoRA
    trainer's (``LoraSettings``), whose sync sends the adapters alone."""
    from rlasync.config import TrainerConfig, WeightsConfig
    from rlasync.engines import TorchEngine
    from rlasync.trainer import TrainerActor
    from rlasync.weights import ParameterSynchronizer

    torch_engine = TorchEngine.from_pretrained(str(model_dir))
    tokenizer = load_tokenizer(model_dir)
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    before = [
        o.token_ids
        for o in await asyncio.gather(
            *[sglang.generate(_req(f"b{i}", x, _greedy(12))) for i, x in enumerate(ids)]
        )
    ]
    settings = {"lora": lora} if lora is not None else {}
    async with TrainerActor(TrainerConfig(world_size=1, lr=5e-2, **settings)) as trainer:
        await trainer.start(model_dir)
        for _ in range(2 if lora is not None else 1):  # LoRA's B starts at zero: a second step moves A
            await trainer.step(_trainer_batch())
        sync = ParameterSynchronizer(WeightsConfig(), trainer, [sglang, torch_engine])
        await sync.start()
        report = await sync.sync(1)
        sync.close()
    assert report.engines == {"local-0": 1, "local-1": 1} and sglang.weight_version == 1
    after = [
        o.token_ids
        for o in await asyncio.gather(
            *[sglang.generate(_req(f"a{i}", x, _greedy(12))) for i, x in enumerate(ids)]
        )
    ]
    reference = [
        o.token_ids
        for o in await asyncio.gather(
            *[torch_engine.generate(_req(f"t{i}", x, _greedy(12))) for i, x in enumerate(ids)]
        )
    ]
    assert after != before and after == reference
    await torch_engine.close()


@uvloop
async def test_a_weight_sync_reaches_the_sglang_adapter_as_it_does_the_torch_engine(model_dir: Path) -> None:
    engine = await make_fake_sglang_engine(str(model_dir))
    try:
        await _sync_from_trainer(model_dir, engine)
    finally:
        await engine.close()


@uvloop
async def test_bad_requests_get_clear_errors(model_dir: Path) -> None:
    engine = await make_fake_sglang_engine(str(model_dir))
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate(_req("e", [], _greedy(4)))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await engine.generate(_req("v", [10**6], _greedy(4)))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await engine.generate(_req("n", [-1], _greedy(4)))
    with pytest.raises(EngineError, match="max_new_tokens"):
        await engine.generate(_req("m", [1], SamplingParams(max_new_tokens=0)))
    with pytest.raises(EngineError, match="does not fit max_seq_len"):
        await engine.generate(_req("l", [1] * 1024, _greedy(4)))
    task = asyncio.ensure_future(engine.generate(_req("dup", [5, 6], _greedy(200))))
    await asyncio.sleep(0)
    with pytest.raises(EngineError, match="already running"):
        await engine.generate(_req("dup", [5, 6], _greedy(4)))
    await engine.abort("dup")
    assert (await task).finish_reason == "abort"
    # What SGLang itself refuses comes back as an EngineError with its message.
    with pytest.raises(EngineError, match="top_p"):
        await engine.generate(_req("p", [5, 6], SamplingParams(top_p=0.0, max_new_tokens=4)))
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(_req("late", [5], _greedy(4)))


@uvloop
async def test_an_abort_sglang_decides_on_its_own_is_an_error(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    task = asyncio.ensure_future(engine.generate(_req("victim", tok.encode("hello"), _greedy(500))))
    await wait_until(
        lambda: engine.stats().running == 1, timeout_s=30, interval_s=0.005, what="the request has tokens"
    )
    engine.engine.tokenizer_manager.abort_request("victim")  # as SGLang's own abort (memory, queue limits)
    with pytest.raises(EngineError, match="SGLang aborted request 'victim'"):
        await task
    again = await engine.generate(_req("victim", tok.encode("hello"), _greedy(3)))  # the id is free again
    assert again.finish_reason == "length"
    await engine.close()


@uvloop
async def test_a_cancelled_caller_aborts_its_request_in_sglang(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir))
    task = asyncio.ensure_future(engine.generate(_req("gone", tok.encode("hello"), _greedy(10_000))))
    await wait_until(
        lambda: engine.stats().running == 1, timeout_s=30, interval_s=0.005, what="the request has tokens"
    )
    task.cancel()
    await wait_until(
        lambda: engine.stats().running == 0 and not engine.engine.tokenizer_manager.rid_to_state,
        timeout_s=30,
        interval_s=0.005,
        what="SGLang dropped the cancelled request",
    )
    assert engine.stats().finished == 1
    await engine.close()


@uvloop
async def test_close_ends_queued_and_running_requests(model_dir: Path, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    engine = await make_fake_sglang_engine(str(model_dir), max_batch=1)
    running = asyncio.ensure_future(engine.generate(_req("r", tok.encode("hello"), _greedy(10_000))))
    queued = asyncio.ensure_future(engine.generate(_req("q", tok.encode("hello"), _greedy(10_000))))
    await wait_until(
        lambda: engine.stats().running == 1, timeout_s=30, interval_s=0.005, what="the request has tokens"
    )
    await engine.close()
    assert (await running).finish_reason == "abort" and (await queued).finish_reason == "abort"
    assert engine.engine.tokenizer_manager.scheduler.stopped


@uvloop
async def test_the_fake_pauses_in_place_and_retracts_like_sglang(
    model_dir: Path, reference: tuple[Any, Any]
) -> None:
    """The fake's own pause modes, which the adapter does not use (SGLang's semantics, kept honest)."""
    model, tok = reference
    fake = (await make_fake_sglang_engine(str(model_dir))).engine
    tm = fake.tokenizer_manager
    ids = tok.encode("hello")
    for mode in ("in_place", "retract"):
        params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        stream = await fake.async_generate(
            input_ids=ids, sampling_params=params, return_logprob=True, stream=True, rid=mode
        )
        out: dict[str, Any] = {}
        paused = False
        async for out in stream:
            if (
                out["meta_info"]["completion_tokens"] >= 3
                and not paused
                and out["meta_info"]["finish_reason"] is None
            ):
                paused = True
                await tm.pause_generation(PauseGenerationReqInput(mode=mode))
                # A step under way when the pause came ends first (it holds the step lock).
                await wait_until(lambda: not tm.scheduler.step_lock.locked(), what="the step under way ended")
                held = len(tm.rid_to_state[mode].output_ids)
                await asyncio.sleep(0.1)
                assert len(tm.rid_to_state[mode].output_ids) == held < 40  # no step while paused
                assert (mode == "retract") == (len(tm.scheduler.waiting) == 1)
                assert not (await tm.flush_cache()).success  # the request is still there
                await tm.continue_generation(ContinueGenerationReqInput())
        assert (
            out["output_ids"] == _hf_greedy(model, ids, 40)
            and out["meta_info"]["finish_reason"]["type"] == "length"
        )
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert (await tm.flush_cache()).success
    fake.shutdown()


def test_importing_the_adapter_does_not_import_sglang() -> None:
    import rlasync.engines.sglang  # noqa: F401

    if importlib.util.find_spec("sglang") is None:
        assert "sglang" not in sys.modules
        with pytest.raises(EngineError, match="needs SGLang"):
            SGLangAPI.load()


def test_engine_config_maps_to_sglang_server_args(model_dir: Path) -> None:
    config = SGLangEngineConfig(
        model=str(model_dir),
        device="cuda:1",
        dtype="bfloat16",
        max_batch=8,
        max_seq_len=512,
        seed=3,
    )
    assert engine_kwargs(config) == {
        "model_path": str(model_dir),
        "dtype": "bfloat16",
        "device": "cuda",
        "base_gpu_id": 1,
        "skip_tokenizer_init": True,
        "random_seed": 3,
        "max_running_requests": 8,
        "context_length": 512,
        "tp_size": 1,
    }
    gpu = SGLangEngineConfig(
        model="m",
        tensor_parallel_size=4,
        mem_fraction_static=0.7,
        engine_kwargs={"attention_backend": "triton", "tp_size": 2},
    )
    assert (
        engine_kwargs(gpu)["mem_fraction_static"] == 0.7
        and engine_kwargs(gpu)["attention_backend"] == "triton"
    )
    assert engine_kwargs(gpu)["tp_size"] == 2  # engine_kwargs come last: what a user wrote there wins
    shapes = checkpoint_shapes(model_dir)
    assert shapes is not None and shapes["model.embed_tokens.weight"] == (384, 128)


# -- SGLang itself (CUDA) ----------------------------------------------------------------------
async def _real_engine(tmp_path: Path, **extra: Any) -> tuple[SGLangEngine, Any, Any]:
    pytest.importorskip("sglang")
    # micro: head_dim 64, a size every SGLang attention kernel takes (nano's 32 may not be).
    model, tok = build_tiny_lm(TinyLMConfig.preset("micro", seed=3))
    folder = save_pretrained_dir(model, tok, tmp_path / "micro")
    config = SGLangEngineConfig(
        model=str(folder), device="cuda", dtype="float32", max_batch=8, max_seq_len=1024
    )
    engine = await build_sglang(
        config, mem_fraction_static=0.2, disable_cuda_graph=True, attention_backend="triton", **extra
    )
    return engine, model.eval(), tok


@pytest.mark.gpu
@uvloop
async def test_real_sglang_greedy_logprobs_abort_and_seeds(tmp_path: Path) -> None:
    engine, model, tok = await _real_engine(tmp_path, enable_deterministic_inference=True)
    try:
        ids = [tok.encode(p) for p in PROMPTS]
        outs = await asyncio.gather(*[engine.generate(_req(i, x, _greedy(16))) for i, x in enumerate(ids)])
        for x, out in zip(ids, outs):
            assert out.finish_reason == "length" and len(out.token_ids) == 16 and set(out.versions) == {0}
            logits = _fresh_logits(model, x, out.token_ids)
            chosen = logits.gather(-1, torch.tensor(out.token_ids)[:, None]).flatten()
            # SGLang runs the model in bf16 (unit roundoff 2^-8 = 3.9e-3, against float32's 6e-8
            # in this fresh forward): 1e-2 is about two bf16 roundings of a logit of size 1, a
            # measured allowance for the GPU tier (a worst-case bound over the forward is useless
            # in bf16), not a bound; a wrong token or position is off by far more.
            assert torch.all(chosen >= logits.max(-1).values - 1e-2)
            fresh = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).flatten()
            assert torch.allclose(fresh, torch.tensor(out.logprobs), atol=1e-2)
        params = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=4)
        a, b = [await engine.generate(_req(f"seed{i}", ids[0], params)) for i in range(2)]
        assert a.token_ids == b.token_ids
        # top_logprobs through SGLang's top_logprobs_num: the greedy token first, 3 a position.
        top = await engine.generate(_req("top", ids[0], msgspec.structs.replace(_greedy(8), top_logprobs=3)))
        assert len(top.top_logprobs) == 8 and all(len(a) == 3 for a in top.top_logprobs)
        assert [a[0][0] for a in top.top_logprobs] == top.token_ids
        chunks = []
        async for chunk in engine.generate_stream(_req("long", ids[0], _greedy(900))):
            chunks.append(chunk)
            if len(chunks) == 3:
                assert await engine.abort("long")
        assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 900
    finally:
        await engine.close()


@pytest.mark.gpu
@uvloop
async def test_real_sglang_takes_a_weight_sync_from_the_trainer(tmp_path: Path) -> None:
    engine, _, _ = await _real_engine(tmp_path, enable_deterministic_inference=True)
    try:  # the trainer on the CPU: the version reaches SGLang's GPU through update_weights
        await _sync_from_trainer(tmp_path / "micro", engine)
    finally:
        await engine.close()


@pytest.mark.gpu
@uvloop
async def test_real_sglang_takes_a_lora_sync_as_its_own_adapter(tmp_path: Path) -> None:
    from rlasync.config.train import LoraSettings

    engine, _, _ = await _real_engine(
        tmp_path,
        enable_deterministic_inference=True,
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules="all",
    )
    try:  # only the adapters travel; SGLang loads them as a LoRA adapter, the torch engine merges them
        await _sync_from_trainer(tmp_path / "micro", engine, lora=LoraSettings(rank=8, alpha=16))
    finally:
        await engine.close()


@pytest.mark.gpu
@uvloop
async def test_real_sglang_sleeps_and_wakes_for_colocation(tmp_path: Path) -> None:
    engine, _, tok = await _real_engine(tmp_path, enable_memory_saver=True)
    try:
        ids = tok.encode("Reverse abcd")
        before = await engine.generate(_req("before", ids, _greedy(16)))
        await engine.sleep(offload_weights=True)
        assert engine.stats().sleeping and engine.stats().kv_cache_bytes == 0
        await engine.wake_up()
        after = await engine.generate(_req("after", ids, _greedy(16)))
        assert after.token_ids == before.token_ids and not engine.stats().sleeping
    finally:
        await engine.close()


@pytest.mark.gpu
@uvloop
async def test_real_sglang_pause_update_weights_resume(tmp_path: Path) -> None:
    engine, model, tok = await _real_engine(tmp_path)
    try:
        ids = tok.encode("Reverse abcd")
        before = await engine.generate(_req("before", ids, _greedy(24)))
        tasks = [asyncio.ensure_future(engine.generate(_req(f"p{i}", ids, _greedy(900)))) for i in range(3)]
        await wait_until(
            lambda: engine.stats().running == 3,
            timeout_s=120,
            interval_s=0.005,
            what="three requests have tokens",
        )
        partials = await engine.pause("abort", timeout=60)
        assert len(partials) == 3 and all(p.token_ids and p.finish_reason == "abort" for p in partials)
        assert [o.finish_reason for o in await asyncio.gather(*tasks)] == ["abort"] * 3
        changed = {
            n: p.detach() + 0.2 * torch.randn_like(p) for n, p in model.named_parameters() if "mlp" in n
        }
        await engine.update_weights(changed, version=1)
        await engine.resume()
        after = await engine.generate(_req("after", ids, _greedy(24)))
        assert (
            engine.weight_version == 1 and set(after.versions) == {1} and after.token_ids != before.token_ids
        )
        assert engine.stats().kv_cache_bytes > 0
    finally:
        await engine.close()
