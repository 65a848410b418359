"""Engine actors on real node processes behind the router: balance, stickiness, caps, dead engines."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from pathlib import Path

import msgspec
import pytest
from waiting import wait_until

from rlasync import ActorError, LocalCluster, RuntimeConfig
from rlasync.engines import (
    EngineActor,
    EngineConfig,
    EngineLostError,
    GenerateRequest,
    NoEngineError,
    Router,
    RouterBusyError,
    RouterConfig,
    SamplingParams,
    TorchEngine,
)
from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

# Cluster tests run on uvloop only: the child nodes always do, and the runtime's own tests
# cover the stock loop.
pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])

FAST = RuntimeConfig(
    heartbeat_interval_s=0.2,
    node_dead_after_s=1.5,
    call_timeout_s=30,
    join_timeout_s=60,
    preload_modules=("rlasync.engines",),
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("nano"))


async def _decoding(engines: list[object]) -> bool:
    """Whether some engine runs a sequence (it reports running rows after the step that
    admitted them, which gave each its first token)."""
    states = await asyncio.gather(*[e.stats() for e in engines])  # type: ignore[attr-defined]
    return any(s.running for s in states)


def _req(rid: str, ids: list[int], n: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_ids=ids,
        params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
    )


async def _three_engines(cluster: LocalCluster, model_dir: Path, max_batch: int = 8) -> list[object]:
    config = EngineConfig(model=str(model_dir), max_batch=max_batch)
    placement = [("engine-a", 1), ("engine-b", 1), ("engine-c", 2)]  # three engines, two node processes
    return list(
        await asyncio.gather(
            *[cluster.spawn(EngineActor, config, node=node, name=name) for name, node in placement]
        )
    )


async def test_balance_stickiness_and_streams_across_three_engines_on_two_nodes(model_dir: Path) -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        engines = await _three_engines(cluster, model_dir)
        async with Router(engines, RouterConfig(load_refresh_s=0.2)) as router:  # type: ignore[arg-type]
            # 30 at once: least-outstanding gives each engine exactly 10.
            prompt = [5, 6, 7, 8]
            outs = await asyncio.gather(*[router.generate(_req(f"burst-{i}", prompt, 40)) for i in range(30)])
            assert collections.Counter(o.engine for o in outs) == {
                "engine-a": 10,
                "engine-b": 10,
                "engine-c": 10,
            }
            assert (
                len({tuple(o.token_ids) for o in outs}) == 1
            )  # same weights everywhere, greedy: same answer
            stats = router.stats()
            assert [e.outstanding for e in stats.engines] == [0, 0, 0]  # counts came back down
            assert {e.name: e.node for e in stats.engines} == {
                "engine-a": "node-1",
                "engine-b": "node-1",
                "engine-c": "node-2",
            }

            # One at a time, the counts are all zero: ties go to the least used engine.
            seq = [await router.generate(_req(f"one-{i}", prompt)) for i in range(6)]
            assert collections.Counter(o.engine for o in seq) == {"engine-a": 2, "engine-b": 2, "engine-c": 2}

            # Sticky sessions: 9 conversations of 3 turns each, all turns of one on one engine.
            async def conversation(k: int) -> list[str]:
                history, served = [10 + k, 11, 12], []
                for turn in range(3):
                    out = await router.generate(
                        _req(f"s{k}-t{turn}", history, 4 + k % 3), session_id=f"session-{k}"
                    )
                    history = history + out.token_ids + [20, 21]  # the next user turn
                    served.append(out.engine)
                return served

            served = await asyncio.gather(*[conversation(k) for k in range(9)])
            assert all(len(set(turns)) == 1 for turns in served), served
            assert collections.Counter(turns[0] for turns in served) == {
                "engine-a": 3,
                "engine-b": 3,
                "engine-c": 3,
            }
            assert router.stats().sessions == 9

            # A stream gives the same tokens as generate.
            chunks = [c async for c in router.generate_stream(_req("stream", prompt, 40))]
            assert [t for c in chunks for t in c.token_ids] == outs[0].token_ids and chunks[
                -1
            ].finish_reason == "length"

            # A caller that gives up stops the generation on the engine (no sequence decodes for nobody).
            long = asyncio.ensure_future(router.generate(_req("abandoned", prompt, 100_000)))
            await wait_until(
                lambda: any(e.outstanding for e in router.stats().engines), what="the router sent the request"
            )
            await wait_until(lambda: _decoding(engines), what="an engine decodes the request")
            long.cancel()

            async def all_idle() -> bool:
                states = await asyncio.gather(*[e.stats() for e in engines])  # type: ignore[attr-defined]
                return all(s.running == 0 and s.waiting == 0 for s in states)

            await wait_until(all_idle, what="the engines stopped the abandoned generation")

            # One view of the cluster: load that another router (another node's agent loops)
            # put on engine-a counts here too, so this router steers around it.
            other = Router([engines[0]])  # type: ignore[list-item]
            await engines[0].pause("wait")  # type: ignore[attr-defined]  # so the four below stay queued there
            hogs = [
                asyncio.ensure_future(other.generate(_req(f"hog-{i}", prompt, 100_000))) for i in range(4)
            ]
            await wait_until(
                lambda: router.stats().engines[0].others == 4, what="engine-a reported the other router's 4"
            )
            spread = [await router.generate(_req(f"view-{i}", prompt)) for i in range(4)]
            assert {o.engine for o in spread} == {"engine-b", "engine-c"}
            for i in range(4):
                assert await other.abort(f"hog-{i}")
            await engines[0].resume()  # type: ignore[attr-defined]
            assert all(o.finish_reason == "abort" for o in await asyncio.gather(*hogs))
            await other.close()

            # The router also aborts by request id, on whichever engine holds it.
            task = asyncio.ensure_future(router.generate(_req("to-abort", prompt, 100_000)))
            await wait_until(lambda: _decoding(engines), what="an engine decodes the request to abort")
            assert await router.abort("to-abort") is True
            out = await asyncio.wait_for(task, 30)
            assert out.finish_reason == "abort" and out.token_ids


@pytest.mark.parametrize("policy", ["retry", "fail"])
async def test_a_killed_engine_node_moves_or_fails_its_requests_never_hangs(
    model_dir: Path, policy: str
) -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        engines = await _three_engines(cluster, model_dir, max_batch=2)
        router = Router(engines, RouterConfig(on_engine_lost=policy, load_refresh_s=0.2))  # type: ignore[arg-type]
        # Long enough (2 rows, 400 steps each: at least 0.4 s, where the kill follows the first
        # step within ~10 ms) that engine-c (node-2) cannot finish even its first two requests
        # before it is killed.
        calls = [asyncio.ensure_future(router.generate(_req(f"r{i}", [5, 6, 7], 400))) for i in range(12)]

        async def all_decoding() -> bool:
            states = await asyncio.gather(*[e.stats() for e in engines])  # type: ignore[attr-defined]
            return all(s.running for s in states)

        await wait_until(all_decoding, timeout_s=30, what="every engine decodes its first requests")
        assert [e.outstanding for e in router.stats().engines] == [4, 4, 4]
        os.kill(cluster.pid(2), signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=120)
        served = [r for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if policy == "retry":
            assert not failed, failed
            assert all(len(r.token_ids) == 400 and r.engine in ("engine-a", "engine-b") for r in served)
            assert router.stats().retries == 4
        else:
            assert len(failed) == 4 and all(isinstance(e, EngineLostError) for e in failed)
            assert "engine-c" in str(failed[0]) and "router.on_engine_lost" in str(failed[0])
            assert len(served) == 8 and all(r.engine != "engine-c" for r in served)
        stats = router.stats()
        assert stats.engines_lost == 1 and [e.name for e in stats.engines] == ["engine-a", "engine-b"]
        # Later requests go to the engines that are left.
        after = await asyncio.gather(*[router.generate(_req(f"after-{i}", [5, 6])) for i in range(4)])
        assert {o.engine for o in after} == {"engine-a", "engine-b"}
        await router.close()


async def test_cap_queue_lru_and_errors_on_one_node(model_dir: Path) -> None:
    async with LocalCluster(nodes=1, config=FAST) as cluster:
        model, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
        hosted = await cluster.spawn(
            EngineActor, engine=TorchEngine(model), name="local"
        )  # a ready engine, this process
        loaded = await cluster.spawn(EngineActor, EngineConfig(model=str(model_dir)), name="loaded")

        # At most 2 outstanding per engine: 12 requests over 2 engines never exceed 4 running.
        router = Router([hosted, loaded], RouterConfig(max_inflight_per_engine=2, sticky_sessions=2))
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, max(e.outstanding for e in router.stats().engines))
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        outs = await asyncio.gather(*[router.generate(_req(f"c{i}", [5, 6], 30)) for i in range(12)])
        watcher.cancel()
        assert peak == 2 and len(outs) == 12 and router.stats().queued == 0

        # Sticky sessions are an LRU of router.sticky_sessions entries.
        for s in ("s1", "s2", "s3"):
            await router.generate(_req(f"lru-{s}", [5]), session_id=s)
        assert router.stats().sessions == 2
        await router.close()

        # A request that finds no slot within the queue timeout fails, naming the setting.
        busy = Router([hosted], RouterConfig(max_inflight_per_engine=1, queue_timeout_s=0.3))
        first = asyncio.ensure_future(busy.generate(_req("hog", [5], 100_000)))
        await wait_until(lambda: busy.stats().engines[0].outstanding == 1, what="the hog holds the only slot")
        with pytest.raises(RouterBusyError, match="router.queue_timeout_s"):
            await busy.generate(_req("late", [5]))
        await busy.abort("hog")
        assert (await first).finish_reason == "abort"
        busy.remove_engine("local")
        with pytest.raises(NoEngineError, match="no live engine"):
            await busy.generate(_req("none", [5]))
        await busy.close()

        # Engine errors reach the caller typed and named.
        with pytest.raises(ActorError, match="empty prompt"):
            await loaded.generate(GenerateRequest(request_id="e", prompt_ids=[]))  # type: ignore[attr-defined]


async def test_bad_engine_configs_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(msgspec.ValidationError, match="max_batch"):
        msgspec.convert({"model": "x", "max_batch": 0}, EngineConfig)
    with pytest.raises(ValueError, match="exactly one"):
        EngineActor()
    async with LocalCluster(nodes=2, config=FAST) as cluster:
        with pytest.raises(ActorError, match="engine.backend='nope'"):
            await cluster.spawn(EngineActor, {"backend": "nope", "model": str(tmp_path)}, node=1)
        with pytest.raises(ActorError, match="no config.json"):
            await cluster.spawn(EngineActor, EngineConfig(model=str(tmp_path)), node=1)
