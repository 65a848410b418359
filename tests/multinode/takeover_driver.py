"""The head of the takeover test (test_hostile_netns.py), run inside host A's namespace.

Prints one JSON line per phase; waits for a line on stdin between them."""

from __future__ import annotations

import asyncio
import os
import sys

from netns_driver import say

import rlasync
from rlasync.runtime.types import SECRET_ENV


async def main(listen: str) -> None:
    from sample_actors import Counter, PingPong

    config = rlasync.RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=1.5, join_timeout_s=30)
    async with rlasync.Node(0, listen, config=config, secret=os.environ[SECRET_ENV]) as head:
        await head.local_actor("_membership").wait_members(2, 30)  # type: ignore[attr-defined]
        counter = await head.spawn(Counter)
        bouncer = await head.spawn(PingPong, node=1)  # node-1 calls the head's counter
        victim = (await head.members())[1]
        say(phase="ready", identity=f"{victim.node_id}:{victim.incarnation}")
        traffic = asyncio.ensure_future(bouncer.bounce(counter, 5000))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the attacker is done
        first = await traffic
        await asyncio.sleep(11)  # libzmq aborted the head ~10 s after a takeover
        again = await bouncer.bounce(counter, 10)
        say(
            phase="after",
            first=first,
            again=again,
            members=[m.node_id for m in await head.members()],
            incarnation=(await head.members())[1].incarnation == victim.incarnation,
        )


if __name__ == "__main__":
    rlasync.run(main(sys.argv[1]))
