"""A hostile peer for the hardening tests: raw pyzmq and the project's wire format and keys,
with none of the runtime's manners (no window, no deadlines, any identity it likes)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from rlasync.transport import Call, Codec
from rlasync.transport.auth import CurveKeys


class RawPeer:
    """A DEALER that speaks our messages. ``secret``: a member (it holds the cluster secret);
    None over TCP: an outsider. ``identity``: a routing id of its choosing (another member's).
    ``keys``: the member's keys, to be the same member on several connections."""

    def __init__(
        self,
        address: str,
        *,
        secret: str | None = None,
        identity: bytes | None = None,
        keys: CurveKeys | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.key = ""  # its CURVE public key (what the nodes it calls know it as)
        if (secret is not None or keys is not None) and address.startswith("tcp://"):
            keys = keys or CurveKeys.from_secret(secret or "")  # ``keys``: one member on many connections
            keys.make_client(self.sock)
            self.key = keys.identity
        self.sock.connect(address)
        self.codec = Codec()
        self.next_id = 1000

    def send(self, msg: Any) -> None:
        self.sock.send_multipart(self.codec.encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def call(self, actor: str, method: str, *args: Any, stream: bool = False, timeout: float = 0.0) -> int:
        """Send a call; return its id (replies come through ``replies``)."""
        self.next_id += 1
        self.send(Call(self.next_id, actor, method, list(args), stream=stream, timeout=timeout))
        return self.next_id

    def replies(self, wait_s: float, want: int = 1 << 30) -> list[Any]:
        """Messages received within ``wait_s`` (or until ``want`` of them), decoded; batches unpacked."""
        import msgspec

        out: list[Any] = []
        deadline = time.monotonic() + wait_s
        while len(out) < want and (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            frames = self.sock.recv_multipart()
            if frames[0][:1] == b"\x00":
                bodies = msgspec.msgpack.decode(frames[0][1:], type=list[bytes])
                out.extend(self.codec.decode([b]) for b in bodies)
            else:
                out.append(self.codec.decode(frames))
        return out

    def ask(self, actor: str, method: str, *args: Any, wait_s: float = 10.0) -> Any:
        """One call and its answer (a Reply or an Error)."""
        call_id = self.call(actor, method, *args)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            for msg in self.replies(left, want=1):
                if getattr(msg, "id", None) == call_id:
                    return msg
        raise TimeoutError(f"no answer to {actor}.{method} within {wait_s}s")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rss_mb(pid: int | str = "self") -> float:
    """The resident memory of process ``pid`` (default: this one), in MB; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- attackers that run for a while (the soak test), each in a thread of its own -------------------


class Attack:
    """A loop in a thread until ``stop()``; counts what it did."""

    def __init__(self) -> None:
        import threading

        self.done = threading.Event()
        self.sent = 0
        self.answers = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name=type(self).__name__)

    def start(self) -> Attack:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.run()
        except (
            Exception
        ) as exc:  # recorded for the test to report; an attacker's own bug must not pass silently
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def run(self) -> None:
        raise NotImplementedError


class Fuzzer(Attack):
    """A member sending random and mutated messages to every node: calls to the runtime's own
    actors with random arguments, calls to actors that do not exist, forged cancels and credit,
    truncated and bit-flipped frames. ``rate``: messages per second, per node."""

    def __init__(self, addresses: list[str], secret: str, rate: int = 200, seed: int = 7) -> None:
        super().__init__()
        self.addresses, self.secret, self.rate = addresses, secret, rate
        import random

        self.rng = random.Random(seed)

    def _value(self, depth: int = 0) -> Any:
        rng = self.rng
        choice = rng.randrange(8 if depth < 2 else 5)
        if choice == 0:
            return rng.randint(-(2**63), 2**63 - 1)
        if choice == 1:
            return rng.random() * 10 ** rng.randint(-3, 12)
        if choice == 2:
            return rng.choice(["", "node-0", "node-1", "engine-0", "x" * rng.randint(1, 300), "\u0000\uffff"])
        if choice == 3:
            return None
        if choice == 4:
            return rng.randbytes(rng.randint(0, 64))
        if choice == 5:
            return [self._value(depth + 1) for _ in range(rng.randint(0, 5))]
        if choice == 6:
            return {
                str(self._value(depth + 1))[:20]: self._value(depth + 1) for _ in range(rng.randint(0, 4))
            }
        return {
            "node_id": rng.choice(["node-0", "node-1", "node-2", "evil"]),
            "address": "tcp://127.0.0.1:1",
            "incarnation": "x",
        }

    def _message(self, peer: RawPeer) -> list[bytes]:
        from rlasync.transport import Cancel, StreamAck

        rng = self.rng
        kind = rng.randrange(6)
        if kind <= 1:  # a call to the runtime's actors, with random arguments
            actor = rng.choice(["_membership", "_node"])
            method = rng.choice(
                [
                    "join",
                    "leave",
                    "heartbeat",
                    "register",
                    "unregister",
                    "lookup",
                    "members_list",
                    "wait_node",
                    "wait_members",
                    "node_dead",
                    "shutdown",
                    "cluster_ends",
                    "spawn",
                    "start_child",
                    "stats",
                    "ping",
                ]
            )
            args = [self._value() for _ in range(rng.randint(0, 4))]
            msg: Any = Call(
                rng.randint(0, 2**40),
                actor,
                method,
                args,
                stream=rng.random() < 0.1,
                timeout=rng.random() * 5,
            )
        elif kind == 2:  # an actor that does not exist
            msg = Call(rng.randint(1, 2**40), f"nobody-{rng.randint(0, 99)}", "m", [self._value()])
        elif kind == 3:
            msg = rng.choice(
                [
                    Cancel(rng.randint(0, 2**40)),
                    StreamAck(rng.randint(0, 2**40), rng.randint(-(2**40), 2**40)),
                ]
            )
        else:
            frames = peer.codec.encode(Call(1, "_node", "ping"))
            body = bytearray(frames[0])
            if kind == 4:  # bit flips
                for _ in range(rng.randint(1, 4)):
                    body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
            else:  # truncated, or garbage behind a real kind byte
                body = (
                    body[: rng.randrange(len(body))]
                    if rng.random() < 0.5
                    else bytearray([rng.randint(0, 8)]) + rng.randbytes(rng.randint(0, 200))
                )
            return [bytes(body)]
        return [bytes(f) for f in peer.codec.encode(msg)]

    def run(self) -> None:
        peers = [RawPeer(address, secret=self.secret) for address in self.addresses]
        try:
            while not self.done.is_set():
                started = time.monotonic()
                for peer in peers:
                    for _ in range(self.rate // 10):
                        peer.send_raw(*self._message(peer))
                        self.sent += 1
                    while peer.sock.poll(0):
                        peer.sock.recv_multipart()
                        self.answers += 1
                self.done.wait(max(0.0, 0.1 - (time.monotonic() - started)))
        finally:
            for peer in peers:
                peer.close()


class Outsider(Attack):
    """A stranger without the secret: keeps ``holding`` TCP connections open to ``address``,
    replacing them as the node closes them, and writes garbage, greetings and huge frame
    headers into some."""

    def __init__(self, address: str, holding: int = 200, seed: int = 11) -> None:
        super().__init__()
        import random

        self.host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.port = int(port)
        self.holding = holding
        self.rng = random.Random(seed)
        self.closed_by_node = 0

    def run(self) -> None:
        import socket

        rng = self.rng
        held: list[socket.socket] = []
        try:
            while not self.done.is_set():
                while len(held) < self.holding:
                    try:
                        s = socket.create_connection((self.host, self.port), timeout=2)
                    except OSError:
                        break
                    s.setblocking(False)
                    choice = rng.randrange(4)
                    try:
                        if choice == 0:
                            s.send(rng.randbytes(rng.randint(1, 512)))
                        elif choice == 1:  # a CURVE greeting, then a frame header announcing 1 GB
                            s.send(
                                b"\xff"
                                + b"\x00" * 8
                                + b"\x7f\x03\x00"
                                + b"CURVE".ljust(20, b"\x00")
                                + b"\x00" * 32
                                + b"\x06"
                                + (2**30).to_bytes(8, "big")
                            )
                    except OSError:
                        pass
                    held.append(s)
                    self.sent += 1
                alive = []
                for s in held:
                    try:
                        if s.recv(4096) == b"":
                            raise ConnectionResetError
                        alive.append(s)
                    except BlockingIOError:
                        alive.append(s)
                    except OSError:
                        self.closed_by_node += 1
                        s.close()
                held = alive
                self.done.wait(0.2)
        finally:
            for s in held:
                s.close()


class Flooder(Attack):
    """A member calling a slow endpoint as fast as it can, ignoring every window: the head's
    ``lookup`` of a name that never appears waits ``wait_s`` before it answers."""

    def __init__(self, address: str, secret: str, wait_s: float = 30.0) -> None:
        super().__init__()
        self.address, self.secret, self.wait_s = address, secret, wait_s
        self.busy = 0

    def run(self) -> None:
        with RawPeer(self.address, secret=self.secret) as peer:
            while not self.done.is_set():
                for _ in range(500):
                    peer.call("_membership", "lookup", "never-spawned", self.wait_s, timeout=self.wait_s + 5)
                    self.sent += 1
                for msg in peer.replies(0.05):
                    self.answers += 1
                    self.busy += getattr(msg, "code", "") == "busy"
