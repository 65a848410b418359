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
from pathlib import Path

import pytest
from hosts import Hosts

from rlasync import new_secret
from rlasync.runtime.types import SECRET_ENV

pytestmark = pytest.mark.multinode
HERE = Path(__file__).parent


def test_two_hosts_call_stream_and_detect_a_dead_host(two_hosts: Hosts) -> None:
    head_ns, node_ns = two_hosts.a, two_hosts.b
    SUBNET = two_hosts.subnet
    env = dict(
        os.environ,
        **{
            SECRET_ENV: new_secret(),
            "PYTHONPATH": os.pathsep.join([str(HERE.parent / "runtime"), *sys.path]),
        },
    )
    head_address = f"tcp://{SUBNET}.1:29600"
    driver = subprocess.Popen(
        ["ip", "netns", "exec", head_ns, sys.executable, str(HERE / "netns_driver.py"), head_address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    node = subprocess.Popen(
        two_hosts.node_command(
            node_ns,
            1,
            29600,
            head_address,
            "runtime.heartbeat_interval_s=0.2",
            "runtime.node_dead_after_s=1.5",
        ),
        env=env,
    )
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
