"""Actor calls across real node processes: typed calls, streaming, cancellation, deadlines, errors."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from sample_actors import Counter, Failer, Point, Slow, Streamer, Tasky
from waiting import wait_until

from rlasync import ActorError, ActorNotFound, CallTimeout, LocalCluster, NotAnEndpoint, RuntimeConfig


@pytest.fixture
async def cluster():
    async with LocalCluster(nodes=3, config=RuntimeConfig(call_timeout_s=20)) as c:
        yield c


async def test_typed_calls_on_another_process(cluster: LocalCluster) -> None:
    counter = await cluster.spawn(Counter, 10, node=1, name="counter")
    assert await counter.add(5) == 15
    assert await counter.pid() == cluster.pid(1) != os.getpid()
    assert await counter.norm1(Point(3, -4)) == 7  # a Struct argument arrives as a Struct
    assert await counter.mirror(Point(1, 2)) == Point(2, 1)  # and a Struct result returns as one
    with pytest.raises(ActorError, match="argument 'p'.*Expected `object`"):
        await counter.norm1(5)  # type: ignore[arg-type]


async def test_lookup_by_name_from_any_node(cluster: LocalCluster) -> None:
    await cluster.spawn(Counter, 1, node=2, name="shared")
    from sample_actors import PingPong

    ping = await cluster.spawn(PingPong, node=1)
    shared = await cluster.lookup("shared", Counter)
    assert await ping.bounce(shared, 10) == 10  # node-1 calls node-2 through a ref it was sent
    assert await shared.add(0) == 11
    with pytest.raises(ActorNotFound, match="never spawned"):
        await cluster.lookup("nobody")
    with pytest.raises(ActorError, match="taken"):
        await cluster.spawn(Counter, node=1, name="shared")


async def test_lookup_waits_for_a_late_actor(cluster: LocalCluster) -> None:
    async def spawn_later() -> None:
        await asyncio.sleep(0.3)
        await cluster.spawn(Counter, 3, node=1, name="late")

    task = asyncio.create_task(spawn_later())
    late = await cluster.lookup("late", Counter, timeout=10)
    assert await late.add(1) == 4
    await task


async def test_remote_exception_keeps_type_message_and_traceback(cluster: LocalCluster) -> None:
    failer = await cluster.spawn(Failer, node=1)
    with pytest.raises(ActorError) as info:
        await failer.fail("boom")
    err = info.value
    assert err.remote_type == "KeyError" and err.node == "node-1"
    assert "'boom'" in err.message
    assert "_deep" in err.remote_traceback and "sample_actors.py" in err.remote_traceback
    assert "remote traceback" in str(err)


async def test_calling_a_non_endpoint_names_the_fix(cluster: LocalCluster) -> None:
    counter = await cluster.spawn(Counter, node=1)
    with pytest.raises(NotAnEndpoint, match="@rlasync.endpoint"):
        await counter.helper()


async def test_streaming(cluster: LocalCluster) -> None:
    streamer = await cluster.spawn(Streamer, node=2)
    assert [i async for i in streamer.count(500)] == list(range(500))
    seen = []
    with pytest.raises(ActorError, match="stream broke after 3"):
        async for i in streamer.fail_after(3):
            seen.append(i)
    assert seen == [0, 1, 2]


async def test_stream_backpressure_and_early_close(cluster: LocalCluster) -> None:
    window = cluster.config.stream_window
    streamer = await cluster.spawn(Streamer, node=1)
    stream = streamer.count(10_000)
    assert await stream.__anext__() == 0

    async def window_full() -> bool:
        return (await streamer.report())["produced"] >= window

    # The producer fills its window, and may run at most one window ahead of what we consumed
    # (unbounded, it would be thousands of items further by the time the window is full).
    await wait_until(window_full, what=f"the producer filled its window of {window} items")
    assert (await streamer.report())["produced"] <= window + 1
    await stream.aclose()  # closing our end stops the generator on the other node

    async def closed() -> bool:
        return (await streamer.report())["closed"] == 1

    await wait_until(closed, what="the generator on the other node was closed")


async def test_cancelling_the_caller_cancels_the_remote_call(cluster: LocalCluster) -> None:
    slow = await cluster.spawn(Slow, node=1)
    task = asyncio.create_task(slow.sleep(30))

    async def running() -> bool:
        return (await slow.report())["running"] == 1

    await wait_until(running, what="the call runs on node-1")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def cancelled() -> bool:
        return (await slow.report())["cancelled"] == 1

    await wait_until(cancelled, what="the remote call was cancelled")
    assert await slow.report() == {"running": 0, "max_running": 1, "cancelled": 1, "finished": 0}


async def test_deadline_raises_call_timeout_naming_the_setting(cluster: LocalCluster) -> None:
    slow = await cluster.spawn(Slow, node=1)
    started = time.monotonic()
    with pytest.raises(CallTimeout, match=r"runtime.call_timeout_s or pass .options\(timeout=...\)"):
        await slow.sleep.options(timeout=0.3)(30)
    assert time.monotonic() - started < 10

    async def cancelled() -> bool:
        return (await slow.report())["cancelled"] == 1

    await wait_until(cancelled, what="the callee was told to stop")


async def test_backpressure_bounds_calls_in_flight() -> None:
    config = RuntimeConfig(max_inflight_per_peer=4, call_timeout_s=30)
    async with LocalCluster(nodes=2, config=config) as cluster:
        slow = await cluster.spawn(Slow, node=1)
        results = await asyncio.gather(*[slow.sleep(0.05) for _ in range(40)])
        assert results == [0.05] * 40
        report = await slow.report()
        assert report["max_running"] == 4 and report["finished"] == 40


async def test_calls_waiting_for_a_slot_time_out_or_cancel_without_being_sent() -> None:
    config = RuntimeConfig(max_inflight_per_peer=1, call_timeout_s=30)
    async with LocalCluster(nodes=2, config=config) as cluster:
        slow = await cluster.spawn(Slow, node=1)
        first = asyncio.ensure_future(slow.sleep(1.0))  # holds the only slot
        with pytest.raises(CallTimeout, match="max_inflight_per_peer=1"):
            await slow.sleep.options(timeout=0.2)(0.0)
        queued = slow.sleep(0.0)
        queued.cancel()
        assert await first == 1.0
        report = await slow.report()
        assert report["finished"] == 1 and report["max_running"] == 1  # neither waiting call ran


async def test_tensors_and_large_bytes_through_actors(cluster: LocalCluster) -> None:
    counter = await cluster.spawn(Counter, node=1)
    payload = {
        "bf16": torch.randn(300, 300).to(torch.bfloat16),
        "view": torch.arange(10_000, dtype=torch.int64).reshape(100, 100)[:, ::7],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 5),
        "blob": os.urandom(1 << 20),
    }
    back = await counter.echo(payload)
    for key in ("bf16", "view", "scalar", "empty"):
        assert back[key].dtype == payload[key].dtype and torch.equal(back[key], payload[key]), key
    assert back["blob"] == payload["blob"]
    assert await counter.echo(payload["blob"]) == payload["blob"]  # a top-level bytes argument


async def test_local_calls_skip_the_wire_but_keep_semantics(cluster: LocalCluster) -> None:
    counter = await cluster.spawn(Counter, 1)  # on the head, this process
    assert counter.node_id == "node-0"
    assert await counter.add(1) == 2
    marker = object()
    assert await counter.echo(marker) is marker  # same object: no serialisation
    failer = await cluster.spawn(Failer)
    with pytest.raises(ActorError, match="KeyError"):
        await failer.fail("x")
    slow = await cluster.spawn(Slow)
    with pytest.raises(CallTimeout):
        await slow.sleep.options(timeout=0.1)(5)
    streamer = await cluster.spawn(Streamer)
    assert [i async for i in streamer.count(5)] == [0, 1, 2, 3, 4]


async def test_members_and_stats(cluster: LocalCluster) -> None:
    members = await cluster.members()
    assert [m.node_id for m in members] == ["node-0", "node-1", "node-2"]
    assert cluster.start_seconds > 0


async def test_endpoints_run_in_a_task_from_their_first_line(cluster: LocalCluster) -> None:
    tasky = await cluster.spawn(Tasky, node=1)
    assert await tasky.has_task() is True
    assert await tasky.with_timeout(5.0) == "ok"
    assert await tasky.with_taskgroup(4) == 6


async def test_an_unsendable_result_is_an_error_and_spares_its_batch(cluster: LocalCluster) -> None:
    tasky = await cluster.spawn(Tasky, node=1)
    counter = await cluster.spawn(Counter, node=1)
    calls = [counter.add(1), tasky.too_big(), counter.add(1), tasky.cancels_itself(), counter.add(1)]
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert results[0::2] == [1, 2, 3]  # sent in one batch with the failing ones, all answered
    assert isinstance(results[1], ActorError) and "cannot send the result" in str(results[1])
    assert isinstance(results[3], ActorError) and results[3].remote_type.endswith("CancelledError")
