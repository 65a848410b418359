"""Hostile peers against live nodes: members that lie about who they are or ignore every
limit, outsiders that hold connections open, and nodes cut off past the deadline. Each test
reproduces one way the runtime used to give way (issue 16) with raw pyzmq (``hostile.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from hostile import RawPeer, rss_mb
from sample_actors import Counter, MemberView, PingPong, Pumper, Slow, Streamer, Ticker
from waiting import wait_until

from rlasync import (
    ActorError,
    CallRefused,
    CallTimeout,
    JoinError,
    LocalCluster,
    Node,
    NodeLostError,
    RuntimeConfig,
)
from rlasync.runtime.types import ActorInfo, NodeInfo
from rlasync.transport import Error, Reply, StreamAck

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])  # node processes run uvloop

FAST = RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=1.5, call_timeout_s=30, join_timeout_s=20)
TCP = msgspec.structs.replace(FAST, transport="tcp")


def _forbidden(msg: object) -> bool:
    return isinstance(msg, Error) and msg.type.endswith("Forbidden")


async def test_a_member_reusing_another_members_identity_gets_none_of_its_replies() -> None:
    """Defect 1: a member connecting with node-1's routing id took node-1's replies, and libzmq
    aborted the head about 10 s later. Now a TCP caller is its key and the head names connections."""
    async with LocalCluster(nodes=2, config=TCP) as cluster:
        counter = await cluster.spawn(Counter)  # on the head
        bouncer = await cluster.spawn(PingPong, node=1)  # node-1 calls the head's counter
        victim = (await cluster.members())[1]
        identity = f"{victim.node_id}:{victim.incarnation}".encode()

        def take_over() -> list[object]:
            got: list[object] = []
            for _ in range(5):
                with RawPeer(cluster.head.address, secret=cluster.secret, identity=identity) as peer:
                    peer.call("_membership", "members_list")
                    got += peer.replies(0.5)
            return got

        traffic = asyncio.ensure_future(bouncer.bounce(counter, 3000))
        got = await asyncio.to_thread(take_over)
        assert await traffic == 3000  # node-1 lost none of its replies
        assert got and all(isinstance(m, Reply) and m.id > 1000 for m in got)  # only its own answers
        # (The libzmq abort came ~10 s after a takeover: tests/multinode/test_hostile_netns.py waits for it.)
        assert await bouncer.bounce(counter, 10) == 10
        assert [m.node_id for m in await cluster.members()] == ["node-0", "node-1"]


async def test_members_cannot_join_leave_or_declare_deaths_for_others() -> None:
    """Defect 2: any member could join as node-0 (the head declared itself dead), join under a
    made-up name, evict others, declare deaths and shut nodes down."""
    async with LocalCluster(nodes=2, config=TCP) as cluster:
        counter = await cluster.spawn(Counter, node=1, name="counter")
        head, victim = await cluster.members()

        def attack() -> dict[str, object]:
            out: dict[str, object] = {}
            with RawPeer(head.address, secret=cluster.secret) as peer:
                ask = peer.ask
                out["join as the head"] = ask(
                    "_membership", "join", msgspec.structs.replace(head, incarnation="x", key=peer.key)
                )
                out["join made up"] = ask(
                    "_membership", "join", NodeInfo("evil", "tcp://127.0.0.1:9", "x", key=peer.key)
                )
                out["join with its key"] = ask(
                    "_membership", "join", msgspec.structs.replace(victim, incarnation="x")
                )
                out["join its rank"] = ask(
                    "_membership", "join", msgspec.structs.replace(victim, incarnation="x", key=peer.key)
                )
                out["leave"] = ask("_membership", "leave", victim.node_id, victim.incarnation)
                out["heartbeat"] = ask("_membership", "heartbeat", victim.node_id, victim.incarnation, 0)
                out["register"] = ask("_membership", "register", ActorInfo("fake", victim, {}))
                out["unregister"] = ask("_membership", "unregister", "counter")
                out["head shutdown"] = ask("_node", "shutdown")
            with RawPeer(victim.address, secret=cluster.secret) as peer:
                out["node_dead"] = peer.ask("_node", "node_dead", head.node_id, head.incarnation, "lies")
                out["shutdown"] = peer.ask("_node", "shutdown")
                out["spawn _"] = peer.ask(
                    "_node",
                    "spawn",
                    {"module": "sample_actors", "qualname": "Counter", "name": "_membership"},
                )
                out["start_child"] = peer.ask("_node", "start_child", [])
            return out

        out = await asyncio.to_thread(attack)
        for what in ("join as the head", "join made up"):
            assert isinstance(out[what], Error) and "node-<rank>" in out[what].message, (what, out[what])  # type: ignore[attr-defined]
        for what in (
            "join with its key",
            "leave",
            "heartbeat",
            "register",
            "unregister",
            "head shutdown",
            "node_dead",
            "shutdown",
            "spawn _",
            "start_child",
        ):
            assert _forbidden(out[what]), (what, out[what])
        joined = out["join its rank"]  # its own key, node-1's rank: it waits, node-1 stays
        assert isinstance(joined, Reply) and "still held" in joined.value["retry"], joined
        await asyncio.sleep(0.5)
        assert [(m.node_id, m.incarnation) for m in await cluster.members()] == [
            (head.node_id, head.incarnation),
            (victim.node_id, victim.incarnation),
        ]
        assert await counter.add(1) == 1 and cluster.head.is_running
        assert cluster.head.stats().calls_forbidden >= 6


async def test_calls_that_expire_in_the_queue_are_never_sent_and_the_queue_is_bounded() -> None:
    """Defect 3: 100k calls queued behind the window were all sent after their deadline."""
    config = msgspec.structs.replace(FAST, max_inflight_per_peer=4, max_queued_calls=100)
    async with LocalCluster(nodes=2, config=config) as cluster:
        slow = await cluster.spawn(Slow, node=1)
        results = await asyncio.gather(
            *[slow.sleep.options(timeout=1.0)(3) for _ in range(2000)], return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, CallRefused)]
        timed_out = [r for r in results if isinstance(r, CallTimeout)]
        assert len(refused) == 2000 - 104 and len(timed_out) == 104
        assert "runtime.max_queued_calls=100" in str(refused[0])
        # (Had the expired calls been sent instead, this would never come.)
        await wait_until(
            lambda: cluster.head.stats().calls_expired_unsent >= 96,
            what="the head dropped the queued calls whose deadline passed",
        )
        report = await slow.report()
        assert (
            report["running"] + report["cancelled"] + report["finished"] <= 8
        )  # the first 4, never the queue
        assert cluster.head.stats().calls_expired_unsent >= 96


async def test_one_caller_runs_a_bounded_number_of_calls_that_end_with_it() -> None:
    """Defect 4: one peer ignoring the window ran 150k tasks, and a caller's calls outlived it."""
    config = msgspec.structs.replace(TCP, max_calls_per_caller=50)
    async with LocalCluster(nodes=2, config=config) as cluster:
        slow = await cluster.spawn(Slow, node=1, name="slow")
        address = (await cluster.members())[1].address

        def flood() -> list[object]:
            """300 calls over three connections made with one key: one limit for all three."""
            from rlasync.transport.auth import CurveKeys

            keys = CurveKeys.from_secret(cluster.secret)
            peers = [RawPeer(address, keys=keys) for _ in range(3)]
            answers: list[object] = []
            for peer in peers:
                for _ in range(100):
                    peer.call("slow", "sleep", 60.0, timeout=60.0)
            for peer in peers:
                answers += peer.replies(2.0, want=100)
            for peer in peers:  # then it closes: its calls are pointless now
                peer.close()
            return answers

        answers = await asyncio.to_thread(flood)
        assert sum(isinstance(m, Error) and m.code == "busy" for m in answers) == 250

        async def none_running() -> bool:
            return (await slow.report())["running"] == 0

        await wait_until(none_running, what="the closed caller's calls ended")
        assert await slow.report() == {"running": 0, "max_running": 50, "cancelled": 50, "finished": 0}
        assert (await cluster.head.node_stats(1)).calls_refused == 250

        release = threading.Event()

        def overstay() -> None:  # connected and silent: never cancels, never reads
            with RawPeer(address, secret=cluster.secret) as peer:
                peer.call("slow", "sleep", 60.0, timeout=0.5)
                release.wait(30)  # stays connected until the test has seen the callee give up

        staying = asyncio.ensure_future(asyncio.to_thread(overstay))

        async def gave_up() -> bool:
            return (await slow.report())["cancelled"] == 51

        try:  # its deadline passed (the caller is still connected): the callee gave up too
            await wait_until(gave_up, what="the overstaying call was cancelled at its deadline")
        finally:
            release.set()
        await staying


async def test_forged_stream_credit_sends_no_more_than_the_window() -> None:
    """Defect 4: a StreamAck with a huge n made the head queue gigabytes of items."""
    async with LocalCluster(nodes=2, config=TCP) as cluster:
        streamer = await cluster.spawn(Streamer, node=1, name="streamer")
        address = (await cluster.members())[1].address

        def forge() -> None:
            with RawPeer(address, secret=cluster.secret) as peer:
                call_id = peer.call("streamer", "count", 1_000_000, stream=True, timeout=30.0)
                peer.send(StreamAck(call_id, 10**12))
                peer.send(StreamAck(call_id, -(10**6)))
                time.sleep(1.0)

        await asyncio.to_thread(forge)
        # The window it was sent, and one more window for the items it had been sent: no more.
        assert (await streamer.report())["produced"] <= 2 * RuntimeConfig().stream_window + 1
        assert (await cluster.head.node_stats(1)).credit_refused == 2


async def test_outsiders_get_bounded_connections_time_and_memory() -> None:
    """Defect 5: a stranger made the head allocate 512 MB per connection in the CURVE handshake
    and hold it ~28 s; 1,100 idle connections locked members out."""
    config = msgspec.structs.replace(TCP, handshake_timeout_s=1.0, max_connections=30, max_frame_bytes=2**20)
    async with LocalCluster(nodes=2, config=config) as cluster:
        counter = await cluster.spawn(Counter, node=1)
        host, port = cluster.head.address.removeprefix("tcp://").rsplit(":", 1)
        rss_before = rss_mb()

        def outsiders() -> tuple[int, bool]:
            idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
            # The CURVE greeting, then a command frame announcing 512 MB, then 8 MB of it.
            big = socket.create_connection((host, int(port)), timeout=5)
            try:
                big.sendall(
                    b"\xff"
                    + b"\x00" * 8
                    + b"\x7f"
                    + b"\x03\x00"
                    + b"CURVE".ljust(20, b"\x00")
                    + b"\x00"
                    + b"\x00" * 31
                )
                big.sendall(b"\x06" + (512 * 2**20).to_bytes(8, "big"))
                for _ in range(8):
                    big.sendall(b"\x00" * 2**20)
            except OSError:
                pass  # the node closed it already: over the connection cap, or the frame refused
            closed = 0
            for s in [*idle, big]:
                s.settimeout(5)
                try:
                    while s.recv(65536):
                        pass
                    closed += 1  # end of stream: the node closed it
                except TimeoutError:
                    pass  # still open after 5 s
                except OSError:
                    closed += 1  # reset by the node
                s.close()
            return closed, True

        closed, _ = await asyncio.to_thread(outsiders)
        assert closed == 41  # every stranger's connection ended: cap, handshake deadline, frame limit
        stats = cluster.head.stats()
        assert stats.connections_refused >= 10 and stats.handshakes_failed >= 1
        assert rss_mb() - rss_before < 100
        assert await counter.add(1) == 1
        async with Node(7, "tcp://127.0.0.1:0", head=cluster.head.address, secret=cluster.secret, config=TCP):
            assert len(await cluster.members()) == 3  # a member still gets in


@pytest.mark.serial
async def test_big_bodies_are_refused_and_torch_loads_off_the_loop() -> None:
    """Defect 6: 80 MB of valid msgpack decoded on the loop stalled the head 5 s; the first
    tensor a node received imported torch on its loop (1.3-2.2 s)."""
    import torch  # here, before the head (this process) has heartbeats to answer

    # fork_children=False: the node must start without torch (a forked one has it loaded already)
    config = msgspec.structs.replace(FAST, max_body_bytes=2**20, node_dead_after_s=2.0, fork_children=False)
    async with LocalCluster(nodes=2, config=config) as cluster:
        ticker = await cluster.spawn(Ticker, node=1)
        counter = await cluster.spawn(Counter, node=1, name="counter")
        assert (await ticker.report())["torch"] is False
        address = (await cluster.members())[1].address

        def big_body() -> list[object]:
            with RawPeer(address) as peer:
                peer.call("counter", "echo", list(range(400_000)))  # ~1.6 MB of msgpack
                return peer.replies(1.0)

        assert await asyncio.to_thread(big_body) == []
        assert (await cluster.head.node_stats(1)).oversized_bodies == 1
        tensor = torch.arange(10, dtype=torch.float32)
        echoed = await asyncio.gather(*[counter.echo(tensor) for _ in range(3)], counter.add(1))
        assert all(torch.equal(t, tensor) for t in echoed[:3]) and echoed[3] == 1
        report = await ticker.report()
        assert (
            report["torch"] is True and (await cluster.head.node_stats(1)).held_for_torch >= 1
        )  # loaded in a thread
        assert report["max_gap"] < config.node_dead_after_s, report
        assert [m.node_id for m in await cluster.members()] == ["node-0", "node-1"]


async def test_ipc_sockets_live_in_a_folder_only_their_owner_can_enter(tmp_path: Path) -> None:
    """Defect 7: under umask 000 another user connected to a node's ipc socket and ran code."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(JoinError, match="chmod 700"):
        await Node(0, f"ipc://{shared}/head.sock").start()
    private = tmp_path / "new" / "sockets"
    old = os.umask(0)
    try:
        async with Node(0, f"ipc://{private}/head.sock"):
            assert private.stat().st_mode & 0o777 == 0o700
            assert (private / "head.sock").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


async def test_a_process_declared_dead_gets_no_call_served_after() -> None:
    """Defect 8: a node stopped past the deadline had one more call served after its death."""
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        counter = await cluster.spawn(Counter, node=2)
        view = await cluster.spawn(MemberView, node=2)
        pumper = await cluster.spawn(Pumper, node=1)
        await pumper.start(counter)

        async def pumping() -> bool:
            return await counter.add(0) > 0

        await wait_until(pumping, what="node-1's calls reach node-2")

        async def known() -> bool:  # else node-2, never told of node-1, would "hear" its death at once
            return await view.sees("node-1")

        await wait_until(known, what="node-2 has heard of node-1 joining")
        os.kill(cluster.pid(1), signal.SIGSTOP)
        try:
            await _wait_gone(cluster.head, "node-1")

            async def heard() -> bool:
                return not await view.sees("node-1")

            await wait_until(heard, what="node-2 has heard of node-1's death")
            before = await counter.add(0)
        finally:
            os.kill(cluster.pid(1), signal.SIGCONT)
        assert await asyncio.wait_for(cluster.processes["node-1"].wait(), 10) == 75  # fenced: EX_TEMPFAIL
        assert await counter.add(0) == before


async def test_a_node_cut_off_past_the_deadline_rejoins_and_stops_with_the_head(tmp_path: Path) -> None:
    """Defect 8: a node fenced after a partition exited 0 and never came back. On its own it
    now rejoins as a new process of its rank; when the head stops, it is told and exits 0."""
    config = msgspec.structs.replace(FAST, rejoin_timeout_s=60)
    env = dict(
        os.environ,
        RLASYNC_RUNTIME_CONFIG=msgspec.json.encode(config).decode(),
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    head = await Node(0, f"ipc://{tmp_path}/head.sock", config=config).start()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlasync.runtime.worker",
            "--rank",
            "1",
            "--listen",
            f"ipc://{tmp_path}/n1.sock",
            "--head",
            head.address,
        ],
        env=env,
    )
    try:
        first = await _wait_for_member(head, "node-1", None)
        old = await head.spawn(Counter, node=1)
        worker.send_signal(signal.SIGSTOP)
        await _wait_gone(head, "node-1")
        worker.send_signal(signal.SIGCONT)
        await _wait_for_member(head, "node-1", first.incarnation)
        with pytest.raises(NodeLostError):
            await old.add(1)
        new = await head.spawn(Counter, 5, node=1)
        assert await new.add(1) == 6 and worker.poll() is None
        await head.stop()  # the head tells the node: it stops, and does not try to rejoin
        assert await asyncio.to_thread(worker.wait, 10) == 0
    finally:
        await head.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)


async def test_parameters_are_checked_and_calls_are_futures() -> None:
    """Defect 9: int/float/str parameters went unchecked; asyncio.wait refused a call."""
    async with LocalCluster(nodes=2, config=FAST) as cluster:
        counter = await cluster.spawn(Counter, node=1)
        with pytest.raises(ActorError, match="argument 'n'"):
            await counter.add("1")  # type: ignore[arg-type]
        with pytest.raises(ActorError, match="argument 'n'"):
            await counter.add(True)
        done, _ = await asyncio.wait([counter.add(1), counter.add(1)])
        assert sorted(f.result() for f in done) == [1, 2]
        assert await asyncio.create_task(counter.add(1)) == 3
        async with asyncio.TaskGroup() as group:
            task = group.create_task(counter.add(1))
        assert task.result() == 4


async def _wait_for_member(node: Node, node_id: str, not_incarnation: str | None) -> NodeInfo:
    found: list[NodeInfo] = []

    async def joined() -> bool:
        members = {m.node_id: m for m in await node.members()}
        if node_id in members and members[node_id].incarnation != not_incarnation:
            found.append(members[node_id])
        return bool(found)

    await wait_until(joined, timeout_s=20, what=f"{node_id} (re)joined")
    return found[0]


async def _wait_gone(node: Node, node_id: str) -> None:
    async def gone() -> bool:
        return node_id not in [m.node_id for m in await node.members()]

    await wait_until(gone, timeout_s=20, what=f"{node_id} was declared dead")
