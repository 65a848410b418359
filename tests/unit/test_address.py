"""Node addresses: the host others dial, where a node's children listen, what a wildcard bind
advertises, and which interface holds an address."""

from __future__ import annotations

from rlasync.runtime.address import advertised, child_address, host_of, interface_of


def test_hosts_of_addresses() -> None:
    assert host_of("tcp://10.0.0.2:29600") == "10.0.0.2"
    assert host_of("tcp://[fd00::2]:29600") == "fd00::2"
    assert (
        host_of("tcp://0.0.0.0:29600") == "127.0.0.1" and host_of("ipc:///tmp/x/node-1.sock") == "127.0.0.1"
    )


def test_children_listen_beside_their_parent() -> None:
    assert child_address("ipc:///tmp/d/node-1.sock", "node-1.0") == "ipc:///tmp/d/node-1.0.sock"
    assert child_address("tcp://10.0.0.2:29601", "node-1.0") == "tcp://10.0.0.2:0"
    assert child_address("tcp://[fd00::2]:29601", "node-1.0") == "tcp://[fd00::2]:0"
    assert child_address("tcp://0.0.0.0:29601", "node-1.0") == "tcp://0.0.0.0:0"


def test_a_wildcard_bind_advertises_the_address_on_the_route_to_the_head() -> None:
    assert advertised("tcp://0.0.0.0:29601", "tcp://127.0.0.1:29600") == "tcp://127.0.0.1:29601"
    assert (
        advertised("tcp://10.0.0.2:29601", "tcp://10.0.0.1:29600") == "tcp://10.0.0.2:29601"
    )  # a real address stays
    assert advertised("ipc:///tmp/d/node-1.sock", None) == "ipc:///tmp/d/node-1.sock"


def test_the_interface_holding_an_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.250") is None  # TEST-NET-3: on no interface anywhere
