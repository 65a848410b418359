"""How the nodes of a torchrun or Slurm start find the head: through the launcher's own store.

Node 0 picks a free port on its ``MASTER_ADDR`` address, listens there, and writes its address
into the store at ``MASTER_ADDR:MASTER_PORT`` (``runtime.rendezvous``: torchrun's agent's, or
one node 0 hosts); the other nodes read it from there. No second port to agree on in advance.
"""

from __future__ import annotations

import os
import socket

from ..runtime.address import tcp_address
from ..runtime.rendezvous import master_store
from .environment import Launched, LaunchEnvError


def _key() -> str:
    # torchrun's agent store outlives a restart of its workers: each round has its own key.
    return f"rlasync/head/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def local_address(host: str) -> str:
    """``host`` as a numeric address (ZeroMQ binds numbers, not names)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise LaunchEnvError(f"MASTER_ADDR={host} does not resolve here: {exc}") from None


def publish_head(me: Launched, timeout_s: float) -> str:
    """Node 0: the address it will listen at, written into the store for the others."""
    addr = local_address(me.master_addr)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
            port = probe.getsockname()[1]
    except OSError as exc:
        raise LaunchEnvError(
            f"node 0 cannot listen on MASTER_ADDR={me.master_addr} ({addr}): {exc.strerror}; "
            "MASTER_ADDR must be an address of node 0's machine (torchrun: --local-addr)"
        ) from None
    address = tcp_address(addr, port)
    try:
        master_store(timeout_s).set(_key(), address)
    except RuntimeError as exc:
        raise LaunchEnvError(
            f"node 0 cannot reach the rendezvous store at {me.master_addr}:{me.master_port}: {exc}"
        ) from None
    return address


def find_head(me: Launched, timeout_s: float) -> str:
    """Another node: the head's address, as node 0 published it (waits up to ``timeout_s``)."""
    try:
        return bytes(master_store(timeout_s, host=False).get(_key())).decode()
    except RuntimeError as exc:  # torch's DistStoreError and friends
        raise LaunchEnvError(
            f"node {me.rank}: node 0 did not publish the head's address in the store at {me.master_addr}:{me.master_port} "
            f"within {timeout_s:g}s (launch.start_timeout_s): is node 0 running, and is MASTER_ADDR its address? ({exc})"
        ) from None
