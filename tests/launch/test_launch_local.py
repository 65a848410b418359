"""``rlasync launch`` on this machine (``--via`` a local shell or ssh), for what needs no root:
hosts that cannot start are named with their last lines and nothing is left running; the
version checks; ``rlasync status`` of a local cluster. The multinode tier runs whole launches."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from waiting import wait_until_sync

from rlasync import LocalCluster, Node, new_secret
from rlasync.config import RuntimeConfig
from rlasync.launcher.status import cluster_status
from rlasync.launcher.ticket import Ticket, TicketError, read_ticket
from rlasync.runtime import JoinError
from rlasync.runtime.spawner import COMMANDS_ENV
from rlasync.runtime.types import VERSION

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag``: everything this launch started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _launch(tmp_path: Path, model: Path, hosts: str, via: str) -> tuple[int, str, float, str]:
    (tmp_path / "hosts.txt").write_text(hosts)
    tag = f"RLASYNC_TEST_TAG={uuid.uuid4().hex}"
    env = dict(os.environ, RLASYNC_TEST_TAG=tag.split("=")[1])
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlasync",
            "launch",
            "--nodes",
            str(tmp_path / "hosts.txt"),
            "--via",
            via,
            str(CLUSTER),
            f"train.model_dir={model}",
            f"train.run_dir={tmp_path / 'run'}",
            "launch.start_timeout_s=60",
            "cluster.engines=[1]",
            "cluster.trainer=[0]",
            "trainer.world_size=1",
        ],  # two hosts: the head and an engine node
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started, tag


@pytest.mark.timeout(180)
@pytest.mark.parametrize("failure", ["ssh_refused", "port_in_use", "other_version", "no_such_python"])
def test_a_host_that_cannot_start_is_named_with_its_last_lines_and_nothing_is_left(
    tmp_path: Path, nano_model_dir: Path, failure: str
) -> None:
    head, one = _free_ports(2)
    lines = [f"127.0.0.1 port={head}", f"127.0.0.1 port={one}"]
    via, expected, holder = "sh -c {command}", "", None
    if failure == "ssh_refused":
        via, expected = "ssh -p 1 {host}", "Connection refused"  # nothing listens on port 1
        lines = [line.replace("127.0.0.1", "localhost") for line in lines]
    elif failure == "port_in_use":
        holder = socket.socket()
        holder.bind(("127.0.0.1", one))
        holder.listen()
        expected = f"node-1 cannot listen on tcp://127.0.0.1:{one}"
    elif failure == "other_version":
        other = tmp_path / "other-python"
        other.write_text(
            "#!/bin/sh\n# this interpreter's rlasync claims another version (another install: no spawner of this one's)\n"
            f'exec env -u {COMMANDS_ENV} {sys.executable} -c "import importlib.metadata as m, runpy, sys; real = m.version; '
            "m.version = lambda name: '0.0.0-other' if name == 'rlasync' else real(name); sys.argv = ['rlasync', *sys.argv[3:]]; "
            "runpy.run_module('rlasync', run_name='__main__', alter_sys=True)\" \"$@\"\n"
        )
        other.chmod(0o755)
        lines[1] += f" python={other}"
        expected = f"runs rlasync 0.0.0-other and the launcher (with it the head) runs {VERSION}"
    else:
        lines[1] += " python=/nonexistent/bin/python3"
        expected = "/nonexistent/bin/python3"
    try:
        code, out, took, tag = _launch(tmp_path, nano_model_dir, "\n".join(lines) + "\n", via)
    finally:
        if holder is not None:
            holder.close()
    host = {
        "ssh_refused": "localhost/",
        "port_in_use": f"127.0.0.1/{one} (node-1)",
        "other_version": f"127.0.0.1/{one} (node-1)",
        "no_such_python": f"127.0.0.1/{one} (node-1)",
    }[failure]
    assert code == 2, out[-3000:]
    assert f"rlasync launch: {host}" in out and "stopped with exit code" in out and expected in out, out[
        -3000:
    ]
    assert took < 60, took
    wait_until_sync(lambda: not _tagged(tag), interval_s=0.2, what="no process of the launch is left")


def test_the_ticket_is_checked_before_anything_starts() -> None:
    ticket = Ticket(
        host="h",
        rank=1,
        nodes=2,
        head="tcp://127.0.0.1:1",
        listen="tcp://127.0.0.1:2",
        secret="s",
        version="9.9",
        config={},
    )
    with pytest.raises(TicketError, match="h runs rlasync .* and the launcher .* runs 9.9"):
        read_ticket(io.BytesIO(msgspec.json.encode(ticket) + b"\n"), version=VERSION)
    with pytest.raises(TicketError, match="stdin closed before the launcher's ticket came"):
        read_ticket(io.BytesIO(b""), version=VERSION)
    with pytest.raises(TicketError, match="not a launch ticket"):
        read_ticket(io.BytesIO(b'{"rank": "x"}\n'), version=VERSION)
    assert (
        read_ticket(
            io.BytesIO(msgspec.json.encode(msgspec.structs.replace(ticket, version=VERSION))), version=VERSION
        ).rank
        == 1
    )


async def test_the_head_refuses_a_node_of_another_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = new_secret()
    config = RuntimeConfig(join_timeout_s=5)
    async with Node(0, "tcp://127.0.0.1:0", config=config, secret=secret) as head:
        import rlasync.runtime.node as node_module

        monkeypatch.setattr(node_module, "VERSION", "0.0.0-other")
        with pytest.raises(
            JoinError,
            match=f"node-1 .* runs rlasync 0.0.0-other and the head runs {VERSION}: install the same version",
        ):
            await Node(1, "tcp://127.0.0.1:0", head=head.address, config=config, secret=secret).start()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_status_lists_the_live_nodes_with_heartbeat_age(transport: str) -> None:
    async with LocalCluster(
        nodes=3, config=RuntimeConfig(transport=transport, heartbeat_interval_s=0.1)
    ) as cluster:
        rows = await cluster_status(cluster.head.address, cluster.secret, timeout=5)
        assert [r.node for r in rows] == ["node-0", "node-1", "node-2"]
        assert rows[0].roles == ["head"] and all(r.heartbeat_age_s < 2 for r in rows)
        assert [m.node_id for m in await cluster.members()] == [
            "node-0",
            "node-1",
            "node-2",
        ]  # the client did not join


@pytest.mark.timeout(240)
def test_torchrun_with_two_processes_per_machine_makes_one_node_with_two_ranks(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    """``--nproc-per-node=2``: local rank 0 is the node (the head: one machine) and starts both
    trainer ranks itself; local rank 1 exits at once. The ranks meet at torchrun's store."""
    secret_env = dict(os.environ, RLASYNC_CLUSTER_SECRET=new_secret())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "-m",
        "rlasync",
        "launch",
        "--from-env",
        str(CLUSTER),
        f"train.model_dir={nano_model_dir}",
        f"train.run_dir={tmp_path / 'run'}",
        "cluster.engines=[0]",
        "cluster.trainer=[0, 0]",
        "trainer.world_size=2",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.max_new_tokens=8",
        "train.val_size=4",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, env=secret_env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "local rank 1 of 2: node 0's process is local rank 0" in out
    assert "trainer: 2 rank(s) on node-0.0, node-0.1" in out and '"steps": 2' in out, out[-3000:]
