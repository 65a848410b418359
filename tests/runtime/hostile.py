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
    None over TCP: an outsider. ``identity``: a routing id of its choosing (another member's)."""

    def __init__(self, address: str, *, secret: str | None = None, identity: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.key = ""  # its CURVE public key (what the nodes it calls know it as)
        if secret is not None and address.startswith("tcp://"):
            keys = CurveKeys.from_secret(secret)
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
