"""The Engine protocol's contract, run against every engine this machine can run for real.

The torch engine always; vLLM when it is importable (``make test-vllm`` runs this file in
its own environment); SGLang through a fake shaped on its API (its real tests are ``gpu``).
One engine per module and kind: vLLM takes half a minute to start.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from waiting import wait_until

from rlasync.config import EngineConfig, VLLMEngineConfig
from rlasync.engines import Engine, EngineError, GenerateRequest, SamplingParams, build_engine
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir

pytestmark = pytest.mark.asyncio(loop_scope="module", loop_factories=["uvloop"])

PROMPTS = ["Reverse abcd", "What is 37*58?", "hello there", "a", "Reverse xyz please now", "12+34="]


class Kind:
    def __init__(
        self, name: str, build: Callable[[Path], Awaitable[Engine]], logprob_tol: float, logit_tol: float
    ) -> None:
        self.name = name
        self.build = build
        self.logprob_tol = logprob_tol  # |engine logprob - fresh forward's|
        self.logit_tol = logit_tol  # a greedy token's logit may trail the argmax by this much


async def _torch(model_dir: Path) -> Engine:
    return await build_engine(EngineConfig(model=str(model_dir), max_batch=16))


async def _vllm(model_dir: Path) -> Engine:
    return await build_engine(VLLMEngineConfig(model=str(model_dir), max_batch=16, max_seq_len=1024))


async def _fake_sglang(model_dir: Path) -> Engine:
    from fake_sglang import make_fake_sglang_engine

    engine: Engine = await make_fake_sglang_engine(str(model_dir))
    return engine


def _kinds() -> list[Any]:
    kinds = [pytest.param(Kind("torch", _torch, 1e-4, 0.0), id="torch")]
    vllm = importlib.util.find_spec("vllm") is not None
    kinds.append(
        pytest.param(
            Kind("vllm", _vllm, 2e-3, 1e-3),
            id="vllm",
            marks=pytest.mark.skipif(not vllm, reason="vLLM is not installed (make test-vllm)"),
        )
    )
    fake = (Path(__file__).parent / "fake_sglang.py").is_file()
    kinds.append(
        pytest.param(
            Kind("sglang-fake", _fake_sglang, 1e-4, 0.0),
            id="sglang-fake",
            marks=pytest.mark.skipif(not fake, reason="no SGLang fake"),
        )
    )
    return kinds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=7))
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("contract-nano"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    """The same weights in plain transformers, to check the engines against."""
    return load_pretrained_dir(model_dir)


@pytest.fixture(scope="module", params=_kinds())
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(kind: Kind, model_dir: Path) -> AsyncIterator[Engine]:
    built = await kind.build(model_dir)
    yield built
    await built.close()


def _req(
    rid: str, ids: list[int], n: int, temperature: float = 0.0, seed: int | None = None
) -> GenerateRequest:
    params = SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True, seed=seed)
    return GenerateRequest(request_id=rid, prompt_ids=ids, params=params)


def _fresh_logits(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits that predicted each of ``tokens`` after ``prompt``, from one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


async def test_greedy_tokens_are_the_argmax_of_a_forward_pass(
    engine: Engine, kind: Kind, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = await asyncio.gather(*[engine.generate(_req(f"greedy-{i}", p, 24)) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 24 == len(out.logprobs) == len(
            out.versions
        )
        logits = _fresh_logits(model, prompt, out.token_ids)
        chosen = logits.gather(-1, torch.tensor(out.token_ids)[:, None]).flatten()
        assert torch.all(chosen >= logits.max(-1).values - kind.logit_tol), (kind.name, out.token_ids)
    again = await engine.generate(_req("greedy-again", prompts[0], 24))
    assert again.token_ids == outs[0].token_ids  # deterministic


async def test_sampled_logprobs_match_a_forward_pass(
    engine: Engine, kind: Kind, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    outs = await asyncio.gather(
        *[engine.generate(_req(f"sample-{i}", p, 20, temperature=0.8, seed=i)) for i, p in enumerate(prompts)]
    )
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        fresh = torch.log_softmax(_fresh_logits(model, prompt, out.token_ids) / 0.8, dim=-1)
        expected = fresh.gather(-1, torch.tensor(out.token_ids)[:, None]).flatten()
        worst = max(worst, float((expected - torch.tensor(out.logprobs)).abs().max()))
    assert worst <= kind.logprob_tol, (kind.name, worst)
    seeded = await engine.generate(_req("sample-seeded", prompts[0], 20, temperature=0.8, seed=0))
    assert seeded.token_ids == outs[0].token_ids  # a request's seed makes its sample reproducible


async def test_top_logprobs_are_the_likeliest_tokens_of_the_sampling_distribution(
    engine: Engine, kind: Kind, reference: tuple[Any, Any]
) -> None:
    """``top_logprobs``: each position's k likeliest tokens under the distribution its token was
    drawn from (the temperature-scaled one), likeliest first, whole and streamed alike; the sampled
    token's own logprob is among them whenever it is that likely."""
    model, tok = reference
    prompt = tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=3, top_logprobs=3)
    out = await engine.generate(GenerateRequest(request_id="top-3", prompt_ids=prompt, params=params))
    assert len(out.top_logprobs) == len(out.token_ids) == 12
    fresh = torch.log_softmax(_fresh_logits(model, prompt, out.token_ids) / 0.8, dim=-1)
    for position, (alternatives, token, logprob) in enumerate(
        zip(out.top_logprobs, out.token_ids, out.logprobs)
    ):
        ids = [t for t, _ in alternatives]
        values = torch.tensor([v for _, v in alternatives])
        assert len(ids) == 3 and bool((values[:-1] >= values[1:]).all()), alternatives
        assert float((values - fresh[position, ids]).abs().max()) <= kind.logprob_tol, (kind.name, position)
        assert float(fresh[position, ids[-1]]) >= float(fresh[position].topk(3).values[-1]) - kind.logprob_tol
        if token in ids:
            assert abs(dict(alternatives)[token] - logprob) <= kind.logprob_tol
    streamed = [
        a
        async for chunk in engine.generate_stream(
            GenerateRequest(request_id="top-3-streamed", prompt_ids=prompt, params=params)
        )
        for a in chunk.top_logprobs
    ]
    assert [[t for t, _ in a] for a in streamed] == [[t for t, _ in a] for a in out.top_logprobs]


async def test_abort_mid_generation_returns_the_partial_tokens(
    engine: Engine, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    tokens: list[int] = []
    last = None
    async for chunk in engine.generate_stream(_req("abort-me", tok.encode("hello"), 800)):
        if last is None:
            # At the first chunk: a fast engine could otherwise finish all 800 tokens before
            # this consumer got to, say, its fifth.
            assert chunk.finish_reason is None and await engine.abort("abort-me") is True
        tokens += chunk.token_ids
        last = chunk
    assert last is not None and last.finish_reason == "abort"
    assert 1 <= len(tokens) < 800
    assert await engine.abort("abort-me") is False  # already over
    assert await engine.abort("never-existed") is False


async def test_pause_abort_returns_partials_and_resume_serves_again(
    engine: Engine, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    ids = tok.encode("Reverse abcd")
    started = asyncio.Event()
    produced: dict[str, int] = {}

    async def consume(rid: str) -> Any:
        last = None
        async for chunk in engine.generate_stream(_req(rid, ids, 800)):
            produced[rid] = produced.get(rid, 0) + len(chunk.token_ids)
            if len(produced) == 3 and all(produced.values()):
                started.set()
            last = chunk
        return last

    streams = [asyncio.ensure_future(consume(f"pause-{i}")) for i in range(3)]
    await asyncio.wait_for(started.wait(), 60)
    partials = await engine.pause("abort")
    assert {p.request_id for p in partials} == {"pause-0", "pause-1", "pause-2"}
    assert all(
        p.finish_reason == "abort" and p.token_ids and len(p.logprobs) == len(p.token_ids) for p in partials
    )
    finals = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert all(f.finish_reason == "abort" for f in finals)
    # While paused, a new request waits; resume serves it.
    late = asyncio.ensure_future(engine.generate(_req("after-pause", ids, 8)))
    await asyncio.sleep(0.3)
    assert not late.done()
    await engine.resume()
    out = await asyncio.wait_for(late, 60)
    assert out.finish_reason == "length" and len(out.token_ids) == 8


async def test_pause_wait_lets_in_flight_requests_finish(engine: Engine, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    first = asyncio.ensure_future(engine.generate(_req("wait-0", tok.encode("hi"), 40)))
    await wait_until(
        lambda: first.done() or engine.stats().running > 0, what="the request runs when the pause comes"
    )
    assert await engine.pause("wait", timeout=60) == []
    assert first.done() and first.result().finish_reason == "length" and len(first.result().token_ids) == 40
    await engine.resume()


async def test_pause_keep_freezes_requests_and_resume_continues_them(
    engine: Engine, kind: Kind, reference: tuple[Any, Any]
) -> None:
    if kind.name == "sglang-fake":
        pytest.skip("the SGLang adapter has no pause('keep') yet")
    _, tok = reference
    counts = [0, 0]
    started = asyncio.Event()

    async def consume(i: int) -> Any:
        last = None
        async for chunk in engine.generate_stream(_req(f"keep-{i}", tok.encode("hello"), 300)):
            counts[i] += len(chunk.token_ids)
            if all(counts):
                started.set()
            last = chunk
        return last

    streams = [asyncio.ensure_future(consume(i)) for i in range(2)]
    await asyncio.wait_for(started.wait(), 60)
    assert await engine.pause("keep") == []
    await asyncio.sleep(0.2)  # chunks already on their way arrive
    frozen = list(counts)
    await asyncio.sleep(0.5)
    assert counts == frozen and all(0 < n < 300 for n in counts)  # nothing moved while paused
    await engine.resume()
    finals = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert [f.finish_reason for f in finals] == ["length", "length"] and counts == [300, 300]


async def test_many_concurrent_requests(engine: Engine, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    lengths = [1 + (i * 37) % 60 for i in range(64)]
    outs = await asyncio.gather(
        *[
            engine.generate(
                _req(f"many-{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), n, temperature=1.0, seed=i)
            )
            for i, n in enumerate(lengths)
        ]
    )
    assert [len(o.token_ids) for o in outs] == lengths and {o.finish_reason for o in outs} == {"length"}
    assert engine.stats().running == 0


async def test_bad_requests_get_engine_errors(engine: Engine) -> None:
    with pytest.raises(EngineError):
        await engine.generate(_req("empty", [], 4))
    with pytest.raises(EngineError):
        await engine.generate(_req("vocab", [10**7], 4))


async def test_update_weights_changes_outputs_and_versions(
    engine: Engine, kind: Kind, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    ids = tok.encode("Reverse abcd")
    before = await engine.generate(_req("w-before", ids, 24))
    start = engine.weight_version
    original = {name: p.detach().clone() for name, p in model.named_parameters() if "mlp" in name}
    changed = {name: t + 0.2 * torch.randn_like(t) for name, t in original.items()}
    await engine.update_weights(changed, version=start + 1)
    assert engine.weight_version == start + 1 and engine.stats().weight_version == start + 1
    after = await engine.generate(_req("w-after", ids, 24))
    assert after.token_ids != before.token_ids and set(after.versions) == {start + 1}
    await engine.update_weights(original, version=start + 2)  # back to the first weights
    restored = await engine.generate(_req("w-restored", ids, 24))
    assert restored.token_ids == before.token_ids and set(restored.versions) == {start + 2}
