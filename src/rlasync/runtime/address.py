"""Node addresses: what host other processes reach a node at, and where a node's children listen.

    host_of("tcp://10.0.0.2:29600")        # "10.0.0.2"
    host_of("tcp://[fd00::2]:29600")       # "fd00::2"
    host_of("ipc:///tmp/rlasync-x/node-1.sock")  # "127.0.0.1": an ipc node is on this machine
    child_address("ipc:///tmp/d/node-1.sock", "node-1.0")   # "ipc:///tmp/d/node-1.0.sock"

torch.distributed groups (the trainer's, the weight broadcast) meet at a TCP store on some
node: its host is the one that node advertises to the cluster.
"""

from __future__ import annotations

import os

_WILDCARDS = {"*", "0.0.0.0", "::", ""}


def _host(address: str) -> str:
    """The host of a ``tcp://`` address as written (brackets of IPv6 taken off)."""
    hostport = address[len("tcp://") :]
    if hostport.startswith("["):  # tcp://[v6]:port
        return hostport[1 : hostport.index("]")]
    return hostport.rsplit(":", 1)[0]


def host_of(address: str) -> str:
    """The host part of a node address, as other processes would connect to it."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"  # ipc:// (or inproc): a process on this machine
    host = _host(address)
    return "127.0.0.1" if host in _WILDCARDS else host


def advertised(bound: str, towards: str | None) -> str:
    """The address a node tells the cluster: the one it bound, unless that is a wildcard
    (``tcp://0.0.0.0:P``), which no other machine can dial: then this machine's address on the
    route to ``towards`` (the head), or the one its hostname resolves to (the head itself)."""
    import socket

    if not bound.startswith("tcp://") or _host(bound) not in _WILDCARDS:
        return bound
    port = bound.rsplit(":", 1)[1]
    try:
        if towards and towards.startswith("tcp://"):
            host = source_address(host_of(towards), int(towards.rsplit(":", 1)[1]))
        else:
            host = socket.gethostbyname(socket.gethostname())
    except OSError:
        return bound
    return tcp_address(host, port)


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://host:port``, an IPv6 literal in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def source_address(host: str, port: int = 9) -> str:
    """This machine's address on the route to ``host``, of ``host``'s family (IPv4 or IPv6):
    where to listen for a peer that dials from there (a UDP connect sends no packet)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def child_address(parent: str, child_id: str) -> str:
    """Where a node's child process listens: a socket beside the parent's (ipc), or any port on
    the parent's host (tcp)."""
    if parent.startswith("ipc://"):
        return f"ipc://{os.path.join(os.path.dirname(parent[len('ipc://') :]), child_id)}.sock"
    host = _host(parent)
    return tcp_address(host, 0)  # the parent's interface, any free port


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that holds ``host``'s address (Linux), e.g.
    for ``GLOO_SOCKET_IFNAME``: gloo otherwise binds to what the machine's hostname resolves to,
    which another network namespace or machine may not reach. None if no interface has it."""
    import fcntl
    import ipaddress
    import socket
    import struct

    try:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError):
        return None
    if address.version == 6:
        try:
            lines = open("/proc/net/if_inet6").read().splitlines()  # noqa: SIM115 - a tiny proc file
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if ipaddress.ip_address(bytes.fromhex(fields[0])) == address:
                return fields[-1]
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if ipaddress.ip_address(raw[20:24]) == address:
                return name
    return None
