"""SocketPump on real ZeroMQ sockets: batching keeps order and boundaries; garbage batches are handed on."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from waiting import wait_until

from rlasync.transport.zmq_io import BATCH_MARK, SocketPump


async def _pair(received: list[list[bytes]], done: asyncio.Event, expect: int):  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://pump")
    dealer.setsockopt(zmq.IDENTITY, b"caller")
    dealer.connect("inproc://pump")

    def on_request(frames: list[bytes]) -> None:
        received.append(frames)
        if len(received) >= expect:
            done.set()

    server = SocketPump(router, on_request, recheck_s=0.05, routed=True)
    client = SocketPump(dealer, lambda frames: None, recheck_s=0.05)
    return ctx, server, client


async def test_small_messages_of_one_iteration_leave_as_one_batch_in_order() -> None:
    received: list[list[bytes]] = []
    done = asyncio.Event()
    ctx, server, client = await _pair(received, done, 1002)
    sent = [bytes([1]) + i.to_bytes(4, "little") for i in range(1000)]
    for body in sent[:500]:
        client.send([body])
    client.send([bytes([1]) + b"x" * 20000])  # large: flushes the batch first, then goes alone
    client.send([bytes([1]) + b"side", b"side-frame"])  # has a side frame: goes alone
    for body in sent[500:]:
        client.send([body])
    await asyncio.wait_for(done.wait(), 10)
    bodies = [frames[1] for frames in received]
    assert all(frames[0] == b"caller" for frames in received)
    assert bodies[:500] == sent[:500]
    assert bodies[500] == bytes([1]) + b"x" * 20000
    assert received[501][1:] == [bytes([1]) + b"side", b"side-frame"]
    assert bodies[502:] == sent[500:]
    for pump in (server, client):
        pump.close()
        pump.close()  # idempotent
    ctx.term()


async def test_a_frame_that_only_looks_like_a_batch_goes_to_the_handler() -> None:
    received: list[list[bytes]] = []
    done = asyncio.Event()
    ctx, server, client = await _pair(received, done, 1)
    raw = ctx.socket(zmq.DEALER)
    raw.connect("inproc://pump")
    raw.send(BATCH_MARK + b"\xff\xfe garbage")  # the handler decides it is malformed
    await asyncio.wait_for(done.wait(), 10)
    assert received[0][1] == BATCH_MARK + b"\xff\xfe garbage"
    raw.close(linger=0)
    server.close()
    client.close()
    ctx.term()


async def test_a_peer_that_reads_nothing_does_not_block_the_others() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 4)
    router.bind("inproc://stuck")
    stuck, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock, name in ((stuck, b"stuck"), (reader, b"reader")):
        sock.setsockopt(zmq.IDENTITY, name)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.connect("inproc://stuck")
        sock.send(b"hello")
    seen: list[bytes] = []
    server = SocketPump(router, lambda frames: seen.append(frames[0]), recheck_s=0.05, routed=True)
    await wait_until(lambda: len(seen) == 2, what="both peers' hellos arrived")
    big = bytes([2]) + b"x" * 20000  # large: never batched, so each is one ZeroMQ message
    for _ in range(50):
        server.send([b"stuck", big])  # far past what ZeroMQ holds for a peer that never reads
    for i in range(5):
        server.send([b"reader", bytes([2]) + bytes([i]) * 20000])
    got = []

    def five_read() -> bool:  # reads all that has arrived
        while True:
            try:
                got.append(reader.recv(zmq.NOBLOCK))
            except zmq.Again:
                return len(got) >= 5

    await wait_until(five_read, what="the reader got its 5 messages")
    assert [g[1] for g in got] == [0, 1, 2, 3, 4]
    for sock in (stuck, reader):
        sock.close(linger=0)
    server.close()
    ctx.term()


@pytest.mark.serial  # counts wake-ups the safety timer rescues: a loaded machine makes extra ones
async def test_a_lost_wake_up_is_rescued_and_counted_and_a_fresh_arrival_is_not() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://lost")
    push.connect("inproc://lost")
    got: list[list[bytes]] = []
    pump = SocketPump(pull, got.append, recheck_s=0.05, batch=False)
    await asyncio.sleep(0.01)
    push.send(b"one")
    # The hazard itself: a socket operation that reads ZMQ_EVENTS (as a send may) takes the edge
    # before the loop sees it, and the reader is never called for the message.
    assert pull.getsockopt(zmq.EVENTS) & zmq.POLLIN
    await wait_until(lambda: got, what="the timer rescued the message")
    assert got == [[b"one"]] and pump.rescued == 1  # rescued by the timer, and counted
    for i in range(200):  # each a fresh arrival, woken by its edge: not lost
        push.send(b"%d" % i)
        await asyncio.sleep(0.001)  # over several of the timer's rechecks
    await wait_until(lambda: len(got) == 201, what="all 200 arrived")
    assert len(got) == 201 and pump.rescued == 1
    pump.close()
    pull.close(0)
    push.close(0)
    ctx.term()
