"""How the nodes of a torchrun or Slurm start find the head: through the launcher's own store.

Node 0 picks a free port on its ``MASTER_ADDR`` address, listens there, and writes its address
into the store at ``MASTER_ADDR:MASTER_PORT`` (``runtime.rendezvous``: torchrun's agent's, or
one node 0 hosts), under a generation each head bumps; the other nodes read the newest from
there. No second port to agree on in advance, and a restarted group never joins a stale head.
"""

from __future__ import annotations

import socket
import time

from ..runtime.address import tcp_address
from ..runtime.rendezvous import master_store
from ..runtime.worker import head_listens
from .environment import Launched, LaunchEnvError

GENERATION = "rlasync/head/generation"
"""Bumped by each head that publishes: torchrun's agent store outlives a restart of its workers,
and its agents count restarts each their own (a worker's failure counts, a group's membership
change does not), so no per-round variable is the same on every machine."""


def _address_key(generation: int) -> str:
    return f"rlasync/head/{generation}"


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
        store = master_store(timeout_s)
        store.set(_address_key(int(store.add(GENERATION, 1))), address)
    except RuntimeError as exc:
        raise LaunchEnvError(
            f"node 0 cannot reach the rendezvous store at {me.master_addr}:{me.master_port}: {exc}"
        ) from None
    return address


def find_head(me: Launched, timeout_s: float) -> str:
    """Another node: the head's address, as node 0 published it (waits up to ``timeout_s``).

    The newest generation's, once it listens or cannot be reached (the join then waits for it);
    one refused is either a head of an earlier round, gone (a newer generation will come), or
    this round's, not listening yet (it will): both are waited for."""
    deadline = time.monotonic() + timeout_s
    try:
        store = master_store(timeout_s, host=False)
        while True:
            generation = int(store.add(GENERATION, 0))
            if generation:
                address = bytes(store.get(_address_key(generation))).decode()
                if head_listens(address) is not False:
                    return address
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"generation {generation}: nothing listens at {address}"
                    if generation
                    else "none published"
                )
            time.sleep(0.2)
    except (RuntimeError, TimeoutError) as exc:  # torch's DistStoreError and friends
        raise LaunchEnvError(
            f"node {me.rank}: node 0 did not publish the head's address in the store at {me.master_addr}:{me.master_port} "
            f"within {timeout_s:g}s (launch.start_timeout_s): is node 0 running, and is MASTER_ADDR its address? ({exc})"
        ) from None
