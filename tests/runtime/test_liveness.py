"""A node is dead when its process or its link is gone, not when its event loop is busy.

Liveness comes from libzmq's heartbeats, which its I/O threads send and answer whatever
Python does: a script that blocks the head's loop for 20 s, or an endpoint that blocks a
node's, keeps every node; a stopped process still loses its place within
``runtime.node_dead_after_s``. The blocking code is named once, in a WARNING.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest
from sample_actors import Blocker, Counter, PingPong

from rlasync import LocalCluster, NodeLostError, RuntimeConfig

# Liveness tuned fast; a stall is told after 5 s, so a slow start on a loaded machine is not one.
FAST = RuntimeConfig(
    heartbeat_interval_s=0.2,
    node_dead_after_s=1.5,
    loop_stall_warn_s=5.0,
    call_timeout_s=60,
    join_timeout_s=20,
)


async def test_a_script_blocking_its_loop_for_20s_keeps_its_cluster_and_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        counters = [await cluster.spawn(Counter, node=n) for n in (1, 2)]
        bouncer = await cluster.spawn(PingPong, node=1)
        assert [await c.add(1) for c in counters] == [1, 1]
        with caplog.at_level(logging.INFO):
            time.sleep(20)  # noqa: ASYNC251  (a script loading a model inside async def main())
            # The calls right after, to both nodes, and from one node to the other.
            assert [await c.add(1) for c in counters] == [2, 2]
            assert await bouncer.bounce(counters[1], 3) == 3 and await counters[1].add(0) == 5
            assert [m.node_id for m in await cluster.members()] == ["node-0", "node-1", "node-2"]
        assert all(p.returncode is None for p in cluster.processes.values())
    stalls = [
        r.getMessage()
        for r in caplog.records
        if r.name == "rlasync.runtime.stall" and r.levelno >= logging.WARNING
    ]
    assert len(stalls) == 1, stalls
    warnings = stalls
    assert "time.sleep(20)" in warnings[0] and "test_liveness.py" in warnings[0], warnings[0]
    assert "asyncio.to_thread" in warnings[0] and "runtime.loop_stall_warn_s" in warnings[0]
    assert not [
        r for r in caplog.records if "declared dead" in r.getMessage() and "shut down" not in r.getMessage()
    ]


async def test_an_endpoint_blocking_its_nodes_loop_is_waited_for_not_declared_dead() -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        blocker = await cluster.spawn(Blocker, node=1)
        counter = await cluster.spawn(Counter, node=2)
        # Three times node_dead_after_s without a heartbeat from node-1, its connection alive.
        assert await blocker.block(3 * FAST.node_dead_after_s) == 3 * FAST.node_dead_after_s
        assert [m.node_id for m in await cluster.members()] == ["node-0", "node-1", "node-2"]
        assert await counter.add(1) == 1 and await blocker.block(0) == 0


async def test_a_stopped_process_is_still_declared_dead_within_the_deadline() -> None:
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        counter = await cluster.spawn(Counter, node=1)
        survivor = await cluster.spawn(Counter, node=2)
        assert await counter.add(1) == 1
        stopped_at = time.monotonic()
        os.kill(cluster.pid(1), signal.SIGSTOP)  # its libzmq stops answering PINGs too
        try:
            while "node-1" in [m.node_id for m in await cluster.members()]:
                assert time.monotonic() - stopped_at < 10, "node-1 was never declared dead"
                await asyncio.sleep(0.05)
            elapsed = time.monotonic() - stopped_at
            # Its link dropped within node_dead_after_s of its last word; then the check period.
            assert elapsed <= FAST.node_dead_after_s + FAST.heartbeat_interval_s + 1.0, elapsed
            with pytest.raises(NodeLostError):
                await counter.add(1)
            assert await survivor.add(1) == 1
        finally:
            os.kill(cluster.pid(1), signal.SIGCONT)
        assert await asyncio.wait_for(cluster.processes["node-1"].wait(), 10) == 75  # fenced: EX_TEMPFAIL
