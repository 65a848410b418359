"""Where a node listens: its ROUTER socket, who may connect, and its ``/metrics``.

``Listener`` owns a node's ZeroMQ context and the sockets that guard its ROUTER: the socket
options (no routing id handed over, frames and handshakes bounded, TCP keepalives), CURVE
security with a ZAP handler over TCP, where a cluster secret is required, and a monitor that
counts connections, closes those past ``runtime.max_connections``, and tells the server when
one closes. An ``ipc://`` socket lives in a folder only this user can enter, since there is
no handshake on ipc. ``export_metrics`` serves ``/metrics`` (``runtime.metrics_port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import zmq

from ..config import RuntimeConfig
from ..transport.auth import ZAP_ENDPOINT, AuthCounters, CurveKeys, monitor_events
from ..transport.zmq_io import SocketPump, keep_alive
from .address import advertised
from .errors import JoinError, missing_secret
from .server import Server

if TYPE_CHECKING:  # prometheus-client is imported only where metrics are on (~75 ms)
    from ..metrics.exporter import Exporter

log = logging.getLogger(__name__)


class Listener:
    """The listening side of a node, at ``listen``. ``auth`` counts its handshakes,
    ``loop`` is the loop its pumps run on."""

    def __init__(
        self, listen: str, config: RuntimeConfig, loop: asyncio.AbstractEventLoop, auth: AuthCounters
    ) -> None:
        self.listen = listen
        self.config = config
        self.loop = loop
        self.auth = auth
        self.sockets: zmq.Context[Any] = zmq.Context()  # this process's ZeroMQ context
        self.pumps: list[SocketPump] = []  # the ZAP handler's, the monitor's and the server's

    def router(self, keys: CurveKeys | None) -> zmq.Socket[Any]:
        """The ROUTER socket, its options set and, over TCP, secured with ``keys`` (required)."""
        config = self.config
        router = self.sockets.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        # No ROUTER_HANDOVER: a connection's routing id is never handed to another connection
        # (with it, a peer reusing a member's id took that member's replies, and libzmq aborted).
        router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(config.handshake_timeout_s * 1000))
        if self.listen.startswith("tcp://["):  # IPv6 (and "[::]", both families); not for IPv4, whose
            router.setsockopt(zmq.IPV6, 1)  # endpoint would then read back as [::ffff:a.b.c.d]
        keep_alive(router, config.heartbeat_interval_s, config.link_timeout_s)
        if self.listen.startswith("tcp://"):
            if keys is None:
                raise missing_secret()
            self._secure(router, keys)
            _raise_descriptor_limit(config.max_connections)
        elif self.listen.startswith("ipc://"):
            _private_ipc_folder(self.listen)
        return router

    def bind(self, router: zmq.Socket[Any], node_id: str, head: str | None) -> str:
        """Bind ``router``, node ``node_id``'s; the address other nodes reach it at (as seen from
        ``head``). A bind that fails closes every socket here, then raises ``JoinError``."""
        try:
            router.bind(self.listen)
        except zmq.ZMQError as exc:
            # The pumps first (the ZAP socket's is on the loop): a context destroyed under a
            # socket a pump still polls makes libzmq abort the process.
            for pump in self.pumps:
                pump.close()
            self.pumps.clear()
            router.close(linger=0)
            self.sockets.destroy(linger=0)
            raise JoinError(f"{node_id} cannot listen on {self.listen}: {exc}") from None
        if self.listen.startswith("ipc://"):
            os.chmod(self.listen.removeprefix("ipc://"), 0o600)
        return advertised(router.getsockopt_string(zmq.LAST_ENDPOINT), head)

    def _secure(self, router: zmq.Socket[Any], keys: CurveKeys) -> None:
        zap = self.sockets.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)

        def on_zap(frames: list[Any]) -> None:
            zap_pump.send(self.auth.on_zap_request(frames))

        zap_pump = SocketPump(zap, on_zap, recheck_s=self.config.io_recheck_s, loop=self.loop, batch=False)
        self.pumps.append(zap_pump)
        keys.make_server(router)

    def serve(self, router: zmq.Socket[Any], server: Server) -> None:
        """``server`` serves ``router``: its pump is closed with the others, and it hears of each
        connection that closes. Count connections, close those past ``runtime.max_connections``,
        and count failed handshakes (in the node's counters, the server's ``stats``)."""
        self.pumps.append(server.pump)
        monitor = router.get_monitor_socket(monitor_events() | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        stats = server.stats
        limit = self.config.max_connections
        open_fds: set[int] = set()

        def on_event(frames: list[Any]) -> None:
            event, fd = self.auth.on_monitor_event(frames)
            if event == zmq.EVENT_ACCEPTED:
                if len(open_fds) >= limit:
                    stats.connections_refused += 1
                    _shut_down(fd)  # libzmq sees the connection end and closes it itself
                    return
                open_fds.add(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                open_fds.discard(fd)
                server.disconnected(fd)
            stats.connections = len(open_fds)

        self.pumps.append(
            SocketPump(monitor, on_event, recheck_s=self.config.io_recheck_s, loop=self.loop, batch=False)
        )

    def close(self) -> None:
        """Close every socket, the pumps first (see ``bind``)."""
        for pump in self.pumps:
            pump.close()
        self.sockets.destroy(linger=0)


def export_metrics(
    loop: asyncio.AbstractEventLoop, config: RuntimeConfig, node_id: str, role: str
) -> Exporter | None:
    """Serve ``/metrics`` (``runtime.metrics_port``; None: off) for the node ``node_id``, whose
    ``role`` is head, node or child; ``JoinError`` if it cannot."""
    port = config.metrics_port
    if port is None:
        return None
    from ..metrics.exporter import Exporter

    exporter = Exporter(loop, labels={"node": node_id, "role": role})
    try:
        exporter.start(port, config.metrics_host)
    except OSError as exc:
        raise JoinError(
            f"{node_id} cannot serve /metrics on {config.metrics_host}:{port}: {exc}; "
            "choose another runtime.metrics_port (0: any free one)"
        ) from None
    return exporter


def _private_ipc_folder(address: str) -> None:
    """An ``ipc://`` socket lives in a folder only this user can enter: anyone who can connect
    to it is a member (there is no handshake on ipc). Creates the folder if missing."""
    folder = os.path.dirname(os.path.abspath(address.removeprefix("ipc://")))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise JoinError(
            f"ipc socket folder {folder} can be entered by other users (mode {st.st_mode & 0o777:o}, owner uid "
            f"{st.st_uid}): whoever connects to the socket can call every actor. Use a folder only you can enter "
            f"(chmod 700 {folder}), or tcp:// with a cluster secret"
        )


def _raise_descriptor_limit(connections: int) -> None:
    """Let this process hold ``runtime.max_connections`` connections plus its own files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning(
                "open-file limit %d is below runtime.max_connections=%d + 1024: raise `ulimit -n`",
                new,
                connections,
            )


def _shut_down(fd: int) -> None:
    """End the TCP connection on ``fd`` without closing libzmq's descriptor (it closes it itself)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
