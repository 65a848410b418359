"""A training run across two hosts (network namespaces joined by a veth pair, TCP + CURVE), as
on a real cluster: ``rlasync train ... cluster.start=external`` on host A (the head, and node 2
beside it), ``rlasync node`` on host B (node 1 and, as needed, node 3).

- Engine nodes on host B die (kill -9 of one, then the link cut for longer than
  ``runtime.node_dead_after_s`` for the other): the run trains every step on the engines left,
  within the staleness bound, nothing dropped; the cut-off node rejoins once the link is back
  and its engine serves again (the late-join path); the head tells it when the run ends.
- A node on host B holds trainer rank 1: killed, or cut off, the run stops with
  ``RankLostError`` within ``trainer.operation_timeout_s``, and nothing is left running on
  either host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import Hosts
from waiting import wait_until_sync

from rlasync import new_secret
from rlasync.runtime.types import SECRET_ENV

pytestmark = pytest.mark.multinode
ROOT = Path(__file__).parents[2]
DEAD_AFTER_S = 2.0
RUNTIME = [
    "runtime.heartbeat_interval_s=0.2",
    f"runtime.node_dead_after_s={DEAD_AFTER_S}",
    "runtime.join_timeout_s=90",
]


class Cluster:
    """The head's ``rlasync train`` and the ``rlasync node`` processes, each in its host's namespace."""

    def __init__(
        self, hosts: Hosts, tmp_path: Path, model_dir: Path, overrides: list[str], nodes: dict[int, str]
    ) -> None:
        self.hosts, self.run_dir = hosts, tmp_path / "run"
        self.head = f"tcp://{hosts.ip(hosts.a)}:29700"
        self.env = dict(
            os.environ, **{SECRET_ENV: new_secret()}
        )  # the secret by environment, never by command line
        command = [
            sys.executable,
            "-m",
            "rlasync",
            "train",
            str(ROOT / "configs" / "quickstart_cluster.yaml"),
            "cluster.start=external",
            f"cluster.listen={self.head}",
            f"cluster.nodes={1 + len(nodes)}",
            f"train.run_dir={self.run_dir}",
            f"train.model_dir={model_dir}",
            "train.prompts_per_step=4",
            "train.group_size=4",
            "train.max_new_tokens=16",
            "train.val_size=8",
            "train.validate_every=1000",
            "weights.transport=broadcast",
            "weights.timeout_s=10",
            *RUNTIME,
            *overrides,
        ]
        self.processes: dict[int, subprocess.Popen[str]] = {
            0: self._start(["ip", "netns", "exec", hosts.a, *command], tmp_path / "head.log")
        }
        for rank, host in nodes.items():
            self.processes[rank] = self._start(
                hosts.node_command(host, rank, 29700 + rank, self.head, *RUNTIME),
                tmp_path / f"node-{rank}.log",
            )

    def _start(self, command: list[str], log: Path) -> subprocess.Popen[str]:
        # `ip netns exec` execs the command: the process is the node itself.
        return subprocess.Popen(
            command, env=self.env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True
        )

    def records(self) -> list[dict[str, object]]:
        path = self.run_dir / "metrics.jsonl"
        return (
            # Read while the run appends: a last line without its newline is still being written.
            [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]
            if path.is_file()
            else []
        )

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        def stepped() -> bool:
            if any(r["step"] >= step for r in self.records()):
                return True
            assert self.processes[0].poll() is None, "the head exited"
            return False

        try:
            wait_until_sync(
                stepped, timeout_s=timeout, interval_s=0.2, what=f"step {step} is in metrics.jsonl"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log(0)}") from None

    def log(self, rank: int, *, whole: bool = False) -> str:
        text = (self.run_dir.parent / ("head.log" if rank == 0 else f"node-{rank}.log")).read_text()
        return text if whole else text[-4000:]

    def wait_for_log(self, rank: int, line: str, timeout: float = 60) -> None:
        """Until ``line`` is in the log of node ``rank`` (the head's: 0)."""
        wait_until_sync(
            lambda: line in self.log(rank, whole=True),
            timeout_s=timeout,
            interval_s=0.1,
            what=f"{line!r} is in node-{rank}'s log",
        )

    def everything(self) -> list[int]:
        """Every live process of the cluster: the nodes and the processes they supervise."""
        found = [p.pid for p in self.processes.values()]
        return [pid for pid in found + [c for pid in found for c in _descendants(pid)] if _alive(pid)]

    def close(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []
                ).append(int(entry.name))
            except OSError:
                continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found += [child]
            todo.append(child)
    return found


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` still alive after waiting up to ``timeout`` s for all to end."""
    with contextlib.suppress(AssertionError):  # the caller names what is left
        wait_until_sync(
            lambda: not any(_alive(p) for p in pids), timeout_s=timeout, interval_s=0.2, what="all ended"
        )
    return [p for p in pids if _alive(p)]


@pytest.mark.timeout(400)
def test_engine_nodes_on_the_other_host_killed_then_cut_off_the_run_trains_on(
    two_hosts: Hosts, tmp_path: Path, nano_model_dir: Path
) -> None:
    hosts = two_hosts
    steps = 60  # enough for the cut-off node to rejoin while the run goes on (no step waits for it)
    cluster = Cluster(
        hosts,
        tmp_path,
        nano_model_dir,
        [
            "train.mode=fully_async",
            f"train.steps={steps}",
            # Two engines on nodes 1 and 3: each node's first engine takes the trainer's send
            # and keeps it in the node's relay, the other copies it from there.
            "cluster.engines=[1, 1, 2, 3, 3]",
            "cluster.trainer=[0]",
            "trainer.world_size=1",
            "async_training.staleness_threshold=1",
            # The default deadline: a lost engine fails only its own pair group's transfer, so
            # the others' syncs never wait it out (it once stalled the run for all of it).
            "weights.timeout_s=120",
        ],
        nodes={1: hosts.b, 2: hosts.a, 3: hosts.b},
    )
    try:
        cluster.wait_for_step(3)
        for copier in ("engine-1", "engine-4"):  # from their node's relay, not the trainer
            assert f"{copier} by node" in cluster.log(0), cluster.log(0)
        cluster.processes[1].send_signal(signal.SIGKILL)  # node 1 (host B): its relay and both engines
        cluster.wait_for_step(8)
        hosts.link(up=False)  # node 3 (host B), a relay and two engines, is cut off from the head
        # Cut for longer than node_dead_after_s on both sides: the head declared node-3 dead, and
        # node-3 gave the head up (a fixed sleep of 2 * DEAD_AFTER_S + 1 waited this out in full).
        cluster.wait_for_log(0, "node-3 declared dead")
        cluster.wait_for_log(3, "node-3 lost the head")
        hosts.link(up=True)  # it rejoins as a new process; engines 3 and 4 start there again
        wait_until_sync(
            lambda: (
                any(r.get("cluster/rejoins") == 1 for r in cluster.records())
                or cluster.processes[0].poll() is not None
            ),
            timeout_s=120,
            what="node-3 rejoined",
        )
        assert cluster.processes[0].wait(timeout=300) == 0, cluster.log(0)
        assert cluster.processes[3].wait(timeout=30) == 0  # told by the head that the run ended
        records = [r for r in cluster.records() if r["step"] > 0]
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        # Steps kept coming through both losses: the longest took at most what noticing a dead
        # node takes beside a couple of normal steps (issue 48's bound), never the deadline.
        step_s = sorted(float(r["step_s"]) for r in records)  # type: ignore[arg-type]
        print(f"steps: median {step_s[len(step_s) // 2]:.2f} s, longest {step_s[-1]:.2f} s")
        assert step_s[-1] <= 2 * step_s[len(step_s) // 2] + 2 * DEAD_AFTER_S + 5, step_s[-5:]
        assert min(r["cluster/engines"] for r in records[:2]) == 5
        assert records[-1]["cluster/engines"] == 3 and records[-1]["cluster/rejoins"] == 1, records[
            -1
        ]  # engines 3 and 4 serve again, one of them from the rejoined node's new relay
        assert "(joining) by node" in cluster.log(0), cluster.log(0)
        assert max(r["async/staleness_max"] for r in records) <= 1  # the bound held through both losses
        last = records[-1]
        assert last["async/consumed"] == steps * 4 and last["async/version"] == steps
        assert (
            last["async/admitted"]
            == last["async/consumed"] + last["async/queue_ready"] + last["async/in_flight"]
        )
        assert not _gone(cluster.everything(), 30)
    finally:
        hosts.link(up=True)
        cluster.close()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loss", ["killed", "cut_off"])
def test_a_node_holding_a_trainer_rank_lost_stops_the_run_with_rank_lost(
    two_hosts: Hosts, tmp_path: Path, nano_model_dir: Path, loss: str
) -> None:
    hosts = two_hosts
    call_timeout = 60
    cluster = Cluster(
        hosts,
        tmp_path,
        nano_model_dir,
        [
            "train.steps=500",
            "cluster.engines=[1, 2]",
            "cluster.trainer=[0, 1]",
            f"trainer.operation_timeout_s={call_timeout}",
        ],
        nodes={1: hosts.b, 2: hosts.a},
    )
    try:
        cluster.wait_for_step(3)
        everything = cluster.everything()
        lost = time.monotonic()
        if loss == "killed":
            cluster.processes[1].send_signal(signal.SIGKILL)  # node-1 and, with it, trainer rank 1's process
        else:
            hosts.link(up=False)
        code = cluster.processes[0].wait(timeout=call_timeout + 30)
        took = time.monotonic() - lost
        head = cluster.log(0)
        assert code == 1 and "RankLostError" in head and "trainer rank 1" in head, head
        assert took < call_timeout, took
        hosts.link(up=True)
        assert not _gone(everything, 60), [
            Path(f"/proc/{p}/cmdline").read_bytes() for p in everything if _alive(p)
        ]
    finally:
        hosts.link(up=True)
        cluster.close()
