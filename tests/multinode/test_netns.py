"""Two hosts in network namespaces joined by a veth pair: TCP + CURVE between real hosts.

The head runs embedded in a script (``netns_driver.py``), the other node through the
``rlasync node`` command line, as on a real cluster. Needs root (``ip netns``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlasync import new_secret
from rlasync.runtime.types import SECRET_ENV

pytestmark = pytest.mark.multinode
HERE = Path(__file__).parent
SUBNET = "10.231.7"  # only inside the namespaces this test makes


@pytest.fixture
def two_hosts():  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:6]
    head, node = f"rla-{tag}", f"rlb-{tag}"
    veth_a, veth_b = f"va{tag}", f"vb{tag}"
    setup = [
        ["ip", "netns", "add", head],
        ["ip", "netns", "add", node],
        ["ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b],
        ["ip", "link", "set", veth_a, "netns", head],
        ["ip", "link", "set", veth_b, "netns", node],
        ["ip", "-n", head, "addr", "add", f"{SUBNET}.1/24", "dev", veth_a],
        ["ip", "-n", node, "addr", "add", f"{SUBNET}.2/24", "dev", veth_b],
        ["ip", "-n", head, "link", "set", veth_a, "up"],
        ["ip", "-n", node, "link", "set", veth_b, "up"],
        ["ip", "-n", head, "link", "set", "lo", "up"],
        ["ip", "-n", node, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        yield head, node
    finally:
        for ns in (head, node):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_two_hosts_call_stream_and_detect_a_dead_host(two_hosts: tuple[str, str]) -> None:
    head_ns, node_ns = two_hosts
    env = dict(os.environ, **{SECRET_ENV: new_secret(), "PYTHONPATH": os.pathsep.join([str(HERE.parent / "runtime"), *sys.path])})
    head_address = f"tcp://{SUBNET}.1:29600"
    driver = subprocess.Popen(
        ["ip", "netns", "exec", head_ns, sys.executable, str(HERE / "netns_driver.py"), head_address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    node = subprocess.Popen(
        ["ip", "netns", "exec", node_ns, sys.executable, "-m", "rlasync", "node", "--rank", "1",
         "--listen", f"tcp://{SUBNET}.2:29600", "--head", head_address, "--log-level", "WARNING",
         "--set", "runtime.heartbeat_interval_s=0.2", "--set", "runtime.node_dead_after_s=1.5"],
        env=env,
    )  # fmt: skip
    try:
        assert driver.stdout is not None and driver.stdin is not None
        calls = json.loads(driver.stdout.readline())
        assert calls["phase"] == "calls", calls
        assert calls["add"] == 42 and calls["stream"] == list(range(100))
        assert calls["hosts"] == [head_address, f"tcp://{SUBNET}.2:29600"]  # really two addresses
        assert json.loads(driver.stdout.readline())["phase"] == "waiting"
        node.send_signal(signal.SIGKILL)
        driver.stdin.write("kill\n")
        driver.stdin.flush()
        lost = json.loads(driver.stdout.readline())
        assert lost["error"] == "NodeLostError", lost
        assert lost["seconds"] < 1.5 + 0.2 + 1.0 and lost["members"] == ["node-0"]
        assert driver.wait(timeout=30) == 0
    finally:
        for proc in (driver, node):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
