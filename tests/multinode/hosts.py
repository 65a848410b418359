"""Hosts for the multinode tier: network namespaces joined by a veth pair (root only; the tier
is skipped without it). Test traffic stays inside the namespaces a test makes."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import msgspec


class Hosts(msgspec.Struct, frozen=True):
    """Two namespaces, ``a`` at ``subnet.1`` and ``b`` at ``subnet.2``, and their veth ends."""

    a: str
    b: str
    veth_a: str
    veth_b: str
    subnet: str

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{1 if host == self.a else 2}"

    def node_command(self, host: str, rank: int, port: int, head: str, *settings: str) -> list[str]:
        """``rlasync node`` of ``rank`` run on ``host`` (its namespace), listening on ``port``;
        ``settings``: ``runtime.x=y`` overrides."""
        import sys

        return [
            "ip",
            "netns",
            "exec",
            host,
            sys.executable,
            "-m",
            "rlasync",
            "node",
            "--rank",
            str(rank),
            "--listen",
            f"tcp://{self.ip(host)}:{port}",
            "--head",
            head,
            "--log-level",
            "WARNING",
            *[f"--set={s}" for s in settings],
        ]

    def link(self, up: bool) -> None:
        """Cut (or restore) the only link between the two hosts."""
        subprocess.run(
            ["ip", "-n", self.a, "link", "set", self.veth_a, "up" if up else "down"],
            check=True,
            capture_output=True,
            timeout=30,
        )


def make_hosts(subnet: str) -> Iterator[Hosts]:
    tag = uuid.uuid4().hex[:6]
    hosts = Hosts(f"rla-{tag}", f"rlb-{tag}", f"va{tag}", f"vb{tag}", subnet)
    setup = [
        ["ip", "netns", "add", hosts.a],
        ["ip", "netns", "add", hosts.b],
        ["ip", "link", "add", hosts.veth_a, "type", "veth", "peer", "name", hosts.veth_b],
        ["ip", "link", "set", hosts.veth_a, "netns", hosts.a],
        ["ip", "link", "set", hosts.veth_b, "netns", hosts.b],
        ["ip", "-n", hosts.a, "addr", "add", f"{subnet}.1/24", "dev", hosts.veth_a],
        ["ip", "-n", hosts.b, "addr", "add", f"{subnet}.2/24", "dev", hosts.veth_b],
        ["ip", "-n", hosts.a, "link", "set", hosts.veth_a, "up"],
        ["ip", "-n", hosts.b, "link", "set", hosts.veth_b, "up"],
        ["ip", "-n", hosts.a, "link", "set", "lo", "up"],
        ["ip", "-n", hosts.b, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        yield hosts
    finally:
        for ns in (hosts.a, hosts.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Lan(msgspec.Struct, frozen=True):
    """``n`` host namespaces, each joined by a veth pair to a bridge in a switch namespace:
    host ``i`` is ``subnet.(i+1)`` and ``v6prefix::(i+1)`` (IPv6 without duplicate-address
    detection, so it works at once)."""

    names: list[str]
    switch: str
    subnet: str
    v6prefix: str

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def ip6(self, i: int) -> str:
        return f"{self.v6prefix}::{i + 1}"

    def pids(self) -> list[int]:
        """Every process in any host namespace (this test's only)."""
        found = []
        for name in self.names:
            out = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30
            ).stdout
            found += [int(p) for p in out.split()]
        return found


def make_lan(n: int, subnet: str, v6prefix: str) -> Iterator[Lan]:
    tag = uuid.uuid4().hex[:6]
    lan = Lan([f"rl{i}-{tag}" for i in range(n)], f"rls-{tag}", subnet, v6prefix)
    setup = [
        ["ip", "netns", "add", lan.switch],
        ["ip", "-n", lan.switch, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", lan.switch, "link", "set", "br0", "up"],
    ]
    for i, name in enumerate(lan.names):
        here, there = f"h{i}{tag}", f"s{i}{tag}"
        setup += [
            ["ip", "netns", "add", name],
            ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
            ["ip", "link", "set", here, "netns", name],
            ["ip", "link", "set", there, "netns", lan.switch],
            ["ip", "-n", lan.switch, "link", "set", there, "master", "br0"],
            ["ip", "-n", lan.switch, "link", "set", there, "up"],
            ["ip", "-n", name, "addr", "add", f"{lan.ip(i)}/24", "dev", here],
            ["ip", "-n", name, "addr", "add", f"{lan.ip6(i)}/64", "dev", here, "nodad"],
            ["ip", "-n", name, "link", "set", here, "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
        ]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        yield lan
    finally:
        for pid in lan.pids():  # a test that failed half-way must not leave processes behind
            subprocess.run(["kill", "-9", str(pid)], capture_output=True, timeout=30)
        for ns in (*lan.names, lan.switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
