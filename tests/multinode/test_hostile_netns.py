"""A member on another host takes a node's routing identity (issue 16, defect 1), across
network namespaces: TCP + CURVE between real hosts, as the report found it. Needs root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hosts import Hosts

from rlasync import new_secret
from rlasync.runtime.types import SECRET_ENV

pytestmark = pytest.mark.multinode
HERE = Path(__file__).parent

ATTACKER = """
import sys
from hostile import RawPeer
head, secret, identity = sys.argv[1], sys.argv[2], sys.argv[3].encode()
got = []
for _ in range(5):
    with RawPeer(head, secret=secret, identity=identity) as peer:
        peer.call("_membership", "members_list")
        got += peer.replies(0.5)
print(sum(getattr(m, "id", 0) <= 1000 for m in got), len(got))
"""


def test_a_member_on_another_host_taking_a_nodes_identity_gets_nothing(two_hosts: Hosts) -> None:
    secret = new_secret()
    env = dict(
        os.environ,
        **{SECRET_ENV: secret, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "runtime"), *sys.path])},
    )
    head_address = f"tcp://{two_hosts.ip(two_hosts.a)}:29650"
    driver = subprocess.Popen(
        ["ip", "netns", "exec", two_hosts.a, sys.executable, str(HERE / "takeover_driver.py"), head_address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    node = subprocess.Popen(
        two_hosts.node_command(
            two_hosts.b,
            1,
            29650,
            head_address,
            "runtime.heartbeat_interval_s=0.2",
            "runtime.node_dead_after_s=1.5",
        ),
        env=env,
    )
    try:
        assert driver.stdout is not None and driver.stdin is not None
        ready = json.loads(driver.stdout.readline())
        assert ready["phase"] == "ready", ready
        attack = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                two_hosts.b,
                sys.executable,
                "-c",
                ATTACKER,
                head_address,
                secret,
                ready["identity"],
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        stolen, answers = map(int, attack.stdout.split())
        assert attack.returncode == 0 and answers >= 1 and stolen == 0, (
            attack
        )  # only answers to its own calls
        driver.stdin.write("done\n")
        driver.stdin.flush()
        after = json.loads(driver.stdout.readline())
        assert after == {
            "phase": "after",
            "first": 5000,
            "again": 10,
            "members": ["node-0", "node-1"],
            "incarnation": True,
        }
        assert driver.wait(timeout=30) == 0  # the head never aborted
    finally:
        for proc in (driver, node):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
