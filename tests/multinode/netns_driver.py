"""The head of a two-host test cluster; run inside its network namespace by test_netns.py.

Prints one JSON line per phase on stdout; waits for "kill" on stdin between phases.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import rlasync
from rlasync.runtime.types import SECRET_ENV


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(listen: str) -> None:
    from sample_actors import Counter, Slow, Streamer
    from waiting import wait_until  # tests/ is on PYTHONPATH (the test passes its sys.path)

    config = rlasync.RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=1.5, join_timeout_s=30)
    async with rlasync.Node(0, listen, config=config, secret=os.environ[SECRET_ENV]) as head:
        await head.local_actor("_membership").wait_members(2, 30)  # type: ignore[attr-defined]
        counter = await head.spawn(Counter, 40, node=1)
        streamer = await head.spawn(Streamer, node=1)
        slow = await head.spawn(Slow, node=1)
        members = await head.members()
        say(
            phase="calls",
            add=await counter.add(2),
            remote_pid=await counter.pid(),
            stream=[i async for i in streamer.count(100)],
            hosts=[m.address for m in members],
        )
        pending = asyncio.ensure_future(slow.sleep(60))

        async def running() -> bool:
            return (await slow.report())["running"] == 1

        await wait_until(running, what="the call runs on node-1")
        say(phase="waiting")
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the test kills node-1
        killed = time.monotonic()
        try:
            await asyncio.wait_for(pending, 30)
            say(phase="lost", error=None)
        except rlasync.NodeLostError as exc:
            say(
                phase="lost",
                error=type(exc).__name__,
                seconds=time.monotonic() - killed,
                members=[m.node_id for m in await head.members()],
            )


if __name__ == "__main__":
    rlasync.run(main(sys.argv[1]))
