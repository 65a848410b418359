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
    """How often each node tells the head it is alive (and brings back the membership's news),
    and how often ZeroMQ PINGs every connection (libzmq's I/O threads, whatever Python does)."""

    node_dead_after_s: PositiveSeconds = 3.0
    """A node whose process or link is gone is declared dead within this long: its pending and
    later calls raise ``NodeLostError``; a node that loses the head this long stops. A node
    whose event loop is merely busy (a script loading a model) keeps its connections, which
    libzmq's heartbeats hold up, and is not declared dead however long it takes."""

    loop_stall_warn_s: PositiveSeconds = 2.0
    """A node's event loop blocked this long is reported once (a WARNING naming the code that
    holds it): calls, timers and heartbeat replies on that loop wait meanwhile."""

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

    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    """Prometheus ``/metrics`` of every node process (``rlasync_*``: calls, engines, router,
    agent loops, queue, trainer, weight sync): off (null), a port, or 0 for any free one. The
    port given is the node's own; processes a node starts on its machine (a local cluster's
    nodes, trainer ranks) take free ones. A run writes every node's address to
    ``<run_dir>/prometheus_targets.json`` (Prometheus ``file_sd``; ``launch/monitoring/``)."""

    metrics_host: str = "127.0.0.1"
    """Address ``/metrics`` binds. The endpoint is plain, unauthenticated HTTP: keep it on
    loopback, or on an address only the monitoring network reaches (``0.0.0.0`` for all);
    the targets file then names the node's own address."""

    # -- bounds: what one peer can make a node spend (every refusal is counted in NodeStats) --
    max_frame_bytes: PositiveInt = 256 * 2**20
    """Largest ZeroMQ frame a node accepts (``ZMQ_MAXMSGSIZE``): a larger one drops its
    connection. Also caps what a peer that has not authenticated can make a node allocate.
    Weights move through torch.distributed, not calls; a tensor argument is one frame."""

    max_body_bytes: PositiveInt = 16 * 2**20
    """Largest message body (the msgpack part, without tensors and large ``bytes``, which
    travel as frames of their own) a node decodes; it decodes on the event loop, so a larger
    one is refused (``oversized_bodies``). Send big data as tensors or ``bytes``."""

    max_calls_per_caller: PositiveInt = 4096
    """Calls one caller may have running on a node at once; past it calls are refused with
    a ``busy`` error (``calls_refused``). Callers keep ``max_inflight_per_peer`` in flight."""

    max_queued_calls: PositiveInt = 65536
    """Calls a node may queue for one peer behind ``max_inflight_per_peer``; past it a call
    fails at once with ``CallRefused`` naming this setting (``calls_refused``)."""

    max_outbox_bytes: PositiveInt = 512 * 2**20
    """Bytes a node may hold for peers that read too slowly; past it their oldest messages
    are dropped (``dropped_messages``) and the calls they answer time out."""

    max_connections: PositiveInt = 4096
    """TCP connections a node accepts at once (members, and strangers still in their
    handshake); past it new ones are closed (``connections_refused``)."""

    handshake_timeout_s: PositiveSeconds = 5.0
    """A TCP peer that has not authenticated (CURVE) within this long is disconnected."""

    rejoin_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    """A node the head fenced, or that lost the head past ``node_dead_after_s`` (a network
    partition), stops with exit code 75 (EX_TEMPFAIL). A node started on its own (``rlasync
    node``) then joins again as a new process of its rank as soon as the head answers, trying
    for this long (0: it exits, for a supervisor to restart). Nodes started by a parent (a
    local cluster's, a trainer rank) exit and leave the decision to it."""

    fork_children: bool = True
    """A node process forks the processes it supervises (trainer ranks, a local cluster's nodes)
    from a copy of itself made once its modules are loaded (``runtime.spawner``), so they start
    in a fraction of a second instead of importing torch again; false: each starts from nothing
    (``python -m rlasync.runtime.worker``)."""

    allocator: Literal["glibc", "auto", "tcmalloc", "jemalloc"] = "glibc"
    """The memory allocator of the processes a run starts and of its command (``rlasync train``,
    ``node``, ``launch``), which starts itself again under it (``rlasync.runtime.allocator``).
    glibc's malloc (the default) keeps freed blocks a trainer step leaves: a LoRA step on
    SmolLM2-135M held 2x the RSS it used; tcmalloc hands it back, and its steps were faster.
    ``auto``: tcmalloc, else jemalloc, where installed (Debian's ``libtcmalloc-minimal4``,
    ``libjemalloc2``; ``make setup`` installs tcmalloc as root), else glibc's; a named one that
    is not installed stops the run before it starts."""

    preload_modules: tuple[str, ...] = ()
    """Modules every node imports before joining the cluster, e.g. ``["rlasync.engines"]``.
    Loading a large C extension such as torch holds the GIL for up to seconds on a busy
    machine; done after joining, it can starve the node's heartbeats (actor modules are
    otherwise imported in a thread when an actor is first spawned)."""

    @property
    def link_timeout_s(self) -> float:
        """How long libzmq waits after a PING for any answer before dropping the connection:
        PINGs go every ``heartbeat_interval_s``, so a silent peer's link is gone at most
        ``node_dead_after_s`` after its last word."""
        return max(self.node_dead_after_s - self.heartbeat_interval_s, self.heartbeat_interval_s)
