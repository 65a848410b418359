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


def host_of(address: str) -> str:
    """The host part of a node address, as other processes would connect to it."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"  # ipc:// (or inproc): a process on this machine
    hostport = address[len("tcp://") :]
    if hostport.startswith("["):  # tcp://[v6]:port
        host = hostport[1 : hostport.index("]")]
    else:
        host = hostport.rsplit(":", 1)[0]
    return "127.0.0.1" if host in _WILDCARDS else host


def child_address(parent: str, child_id: str) -> str:
    """Where a node's child process listens: a socket beside the parent's (ipc), or any port on
    the parent's host (tcp)."""
    if parent.startswith("ipc://"):
        return f"ipc://{os.path.join(os.path.dirname(parent[len('ipc://'):]), child_id)}.sock"
    hostport = parent[len("tcp://") :]
    host = hostport[: hostport.index("]") + 1] if hostport.startswith("[") else hostport.rsplit(":", 1)[0]
    return f"tcp://{host}:0"  # the parent's interface (a wildcard stays one), any free port


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
