"""Data shapes the runtime's own actors exchange (membership, registry, spawning)."""

from __future__ import annotations

from typing import Any

import msgspec

# How a node process gets what must not be on its command line (``ps`` shows that).
SECRET_ENV = "RLASYNC_CLUSTER_SECRET"
CONFIG_ENV = "RLASYNC_RUNTIME_CONFIG"


class NodeInfo(msgspec.Struct, frozen=True):
    """One node of the cluster, as the head knows it."""

    node_id: str  # "node-<rank>"; node-0 is the head
    address: str  # where its ROUTER listens, e.g. ipc:///tmp/.../node-1.sock or tcp://10.0.0.2:5555
    incarnation: str  # changes when a node of that rank restarts
    pid: int = 0
    host: str = ""


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


class JoinReply(msgspec.Struct, frozen=True):
    head: NodeInfo
    epoch: int
    members: list[NodeInfo]


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
