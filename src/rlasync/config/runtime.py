"""Settings of the actor runtime: deadlines, heartbeats, backpressure, transport.

Every wait in the runtime reads its deadline from here, and every timeout error names
the field to raise, as ``runtime.<field>``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class RuntimeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The actor runtime (``runtime.*`` in a YAML config)."""

    call_timeout_s: PositiveSeconds = 60.0
    """Default deadline of one actor call; for a streaming call, the longest wait for the
    next item. Override per call with ``ref.method.options(timeout=...)``."""

    max_inflight_per_peer: PositiveInt = 1024
    """Calls one node may have outstanding to another node. A caller past it waits for a
    reply instead of queueing without bound: a slow actor slows its callers."""

    stream_window: PositiveInt = 64
    """Items a streaming endpoint may send ahead of what its caller has consumed."""

    heartbeat_interval_s: PositiveSeconds = 0.5
    """How often each node tells the head it is alive."""

    node_dead_after_s: PositiveSeconds = 3.0
    """A node silent for this long is declared dead: its pending and later calls raise
    ``NodeLostError``. A node that loses the head for this long shuts itself down."""

    join_timeout_s: PositiveSeconds = 20.0
    """How long a node may take to join the head (the startup handshake), and how long a
    local cluster may take to start all its nodes."""

    shutdown_timeout_s: PositiveSeconds = 5.0
    """How long a node waits for its actors and peers to stop before closing anyway."""

    io_recheck_s: PositiveSeconds = 0.05
    """Safety net of the socket drain loop: ZeroMQ's file descriptor is edge-triggered, so
    every socket is re-checked this often in case a wake-up was lost (counted in stats)."""

    zero_copy_threshold: Annotated[int, msgspec.Meta(ge=0)] = 65536
    """Tensors and top-level ``bytes`` arguments at least this large travel as their own
    ZeroMQ frames instead of inside the message body."""

    transport: Literal["ipc", "tcp"] = "ipc"
    """How a local cluster's nodes talk: ``ipc`` (Unix sockets in a private directory) or
    ``tcp`` (loopback, authenticated with CURVE). Multi-host clusters always use tcp."""

    host: str = "127.0.0.1"
    """Address a tcp node binds and advertises."""

    preload_modules: tuple[str, ...] = ()
    """Modules every node imports before joining the cluster, e.g. ``["rlasync.engines"]``.
    Loading a large C extension such as torch holds the GIL for up to seconds on a busy
    machine; done after joining, it can starve the node's heartbeats (actor modules are
    otherwise imported in a thread when an actor is first spawned)."""
