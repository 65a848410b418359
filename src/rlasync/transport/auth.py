"""Authenticate TCP peers with a cluster secret, through ZeroMQ CURVE.

Every node derives the same CURVE server key pair from the cluster secret, for its ROUTER
socket; the server's public key never travels, so a peer that does not hold the secret
cannot complete a handshake (CURVE needs the server's key to start one). Each process makes
a client key pair of its own for its DEALER sockets: the key a caller authenticated with is
who it is (ZAP hands it to the ROUTER as each message's ``User-Id``), and membership binds
every node to its key, so no member can speak for another by naming it.
ZeroMQ drops the frames of a peer whose handshake failed; ``AuthCounters`` counts them
from the socket monitor, so an operator can see an intruder or a misconfigured node.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def new_secret() -> str:
    """A fresh cluster secret (hex), for a local cluster or ``rlasync launch``."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> CurveKeys:
        raw = secret.encode() if isinstance(secret, str) else secret
        if len(raw) < 16:
            raise ValueError(
                "the cluster secret must be at least 16 bytes; make one with rlasync.new_secret()"
            )

        def derive(role: bytes) -> tuple[bytes, bytes]:
            secret_key = z85.encode(
                hashlib.blake2b(raw, key=b"rlasync-curve-" + role, digest_size=32).digest()
            )
            return zmq.curve_public(secret_key), secret_key

        server_public, server_secret = derive(b"server")
        client_public, client_secret = zmq.curve_keypair()  # this process's own identity
        return cls(server_public, server_secret, client_public, client_secret)

    @property
    def identity(self) -> str:
        """This process's public client key, as ZAP reports it (``User-Id``) to the nodes it calls."""
        return self.client_public.decode()

    def make_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.zap_domain = b"rlasync"

    def make_client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


@dataclass
class AuthCounters:
    """What the authentication layer refused since the node started."""

    handshakes_failed: int = 0  # bad handshakes: wrong secret, garbage bytes, plain ZMTP
    zap_denied: int = 0  # handshakes that reached ZAP without a CURVE key (another mechanism)

    def on_zap_request(self, frames: list[Any]) -> list[bytes]:
        """Answer one ZAP request (RFC 27). A CURVE handshake that got this far knew the
        server's key, so the peer holds the secret: allow it, and name it by its client key
        (the User-Id its messages then carry)."""
        parts = [bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in frames]
        version, request_id = parts[0], parts[1] if len(parts) > 1 else b""
        mechanism = parts[5] if len(parts) > 5 else b""
        key = parts[6] if len(parts) > 6 else b""
        if version == b"1.0" and mechanism == b"CURVE" and len(key) == 32:
            return [b"1.0", request_id, b"200", b"OK", z85.encode(key), b""]
        self.zap_denied += 1
        return [b"1.0", request_id, b"400", b"not a member of this cluster", b"", b""]

    def on_monitor_event(self, frames: list[Any]) -> tuple[int, int]:
        """Count a failed handshake; return the event and its value (a descriptor, for most)."""
        event, value = monitor_event(frames)
        if event & _HANDSHAKE_FAILURES:
            self.handshakes_failed += 1
        return event, value


def monitor_event(frames: list[Any]) -> tuple[int, int]:
    """A ZeroMQ monitor socket's message (frames as a pump reads them): the event and its value."""
    event = parse_monitor_message([bytes(f.buffer) if hasattr(f, "buffer") else f for f in frames])
    return int(event["event"]), int(event["value"])


def monitor_events() -> int:
    return _HANDSHAKE_FAILURES
