"""Data shapes the runtime's own actors exchange (membership, registry, spawning)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import msgspec

# How a node process gets what must not be on its command line (``ps`` shows that).
SECRET_ENV = "RLASYNC_CLUSTER_SECRET"
CONFIG_ENV = "RLASYNC_RUNTIME_CONFIG"


def _version() -> str:
    try:
        return metadata.version("rlasync")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


VERSION = _version()  # what a node tells the head it runs (NodeInfo.version)


class NodeInfo(msgspec.Struct, frozen=True):
    """One node of the cluster, as the head knows it."""

    node_id: str  # "node-<rank>"; node-0 is the head
    address: str  # where its ROUTER listens, e.g. ipc:///tmp/.../node-1.sock or tcp://10.0.0.2:5555
    incarnation: str  # changes when a node of that rank restarts
    pid: int = 0
    host: str = ""
    key: str = ""  # the CURVE public key its calls authenticate with ("" on ipc: see caller.Caller)
    version: str = ""  # its rlasync version: the head refuses a node of another one
    metrics: str = ""  # host:port of its Prometheus /metrics ("" when runtime.metrics_port is off)


def process_claim(node_id: str, incarnation: str) -> str:
    """Who a process says it is over ``ipc://``, where there is no handshake:
    ``<node>:<incarnation>`` (``caller.Caller.claim``), so a restarted rank is never taken for
    its dead predecessor."""
    return f"{node_id}:{incarnation}"


def ipc_routing_id(node_id: str, incarnation: str, connection: int) -> bytes:
    """The routing id of one of that process's ipc connections: its claim and the connection's
    number. One per connection, since a ROUTER without handover drops a connection whose id
    another still holds (a restarted process's new peer, its predecessor's close not yet seen)."""
    return f"{process_claim(node_id, incarnation)}/{connection}".encode()


def claim_of(routing_id: bytes) -> str:
    """The process an ipc routing id claims (``ipc_routing_id`` read back)."""
    return routing_id.decode(errors="replace").split("/", 1)[0]


class ActorInfo(msgspec.Struct, frozen=True):
    """Where a named actor lives and what it can be called with."""

    name: str
    node: NodeInfo
    endpoints: dict[str, bool]  # endpoint name -> is streaming
    cls: str = ""  # "module:QualName", for messages


class SpawnSpec(msgspec.Struct, frozen=True):
    """How to build an actor on another node: its class must be importable there."""

    module: str
    qualname: str
    name: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    file: str = ""  # for classes defined in a script's __main__: the script's path


class MemberStatus(msgspec.Struct, frozen=True):
    """One live node as ``rlasync status`` shows it."""

    info: NodeInfo
    heartbeat_age_s: float  # since the head last heard from it (0 for the head)
    actors: list[ActorInfo]  # the named actors on it (and on the processes it supervises)


class JoinReply(msgspec.Struct, frozen=True):
    head: NodeInfo
    epoch: int
    members: list[NodeInfo]
    retry: str = ""  # not joined yet, and why (a live process still holds the rank): ask again


class HeartbeatReply(msgspec.Struct, frozen=True):
    epoch: int
    fenced: bool = False  # the head declared this node dead: it must stop
    members: list[NodeInfo] | None = None  # the live members, sent when ``epoch`` changed
    dead: list[NodeInfo] = []  # processes declared dead (recent ones), sent when ``epoch`` changed


class NodeStats(msgspec.Struct):
    """Counters of one node since it started."""

    node_id: str
    calls_sent: int = 0
    calls_served: int = 0
    malformed_frames: int = 0  # frames that were not a valid message: dropped
    unknown_replies: int = 0  # replies for calls that had already ended (timed out, cancelled)
    unroutable_replies: int = 0  # replies whose caller had gone (its node stopped or died)
    handshakes_failed: int = 0  # TCP peers refused by authentication, or speaking garbage
    zap_denied: int = 0
    lost_wakeups: int = 0  # socket wake-ups rescued by the safety timer (should stay 0)
    actors: int = 0
    # Refusals: what a peer asked for past a bound (runtime.*) or beyond its rights.
    calls_refused: int = 0  # past runtime.max_calls_per_caller (served) or max_queued_calls (sent)
    calls_forbidden: int = 0  # a member asked for what only another may do (join as it, declare deaths)
    calls_fenced: int = 0  # calls from a process the head declared dead
    calls_expired_unsent: int = 0  # queued calls whose deadline passed before a slot freed: never sent
    oversized_bodies: int = 0  # message bodies past runtime.max_body_bytes: not decoded
    dropped_messages: int = 0  # outgoing messages dropped past runtime.max_outbox_bytes
    credit_refused: int = 0  # stream credit past runtime.stream_window (a forged StreamAck)
    connections: int = 0  # TCP connections open now
    connections_refused: int = 0  # past runtime.max_connections: closed at once
    held_for_torch: int = 0  # messages held while torch was imported off the loop (a node's first tensor)
