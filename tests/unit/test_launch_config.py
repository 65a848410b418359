"""The hosts file parser and the environment mapping of torchrun and Slurm starts."""

from __future__ import annotations

import pytest

from rlasync.config import ClusterConfig, Config
from rlasync.launcher import HostsFileError, LaunchEnvError, from_env, parse_hosts, remote_command
from rlasync.launcher.hosts import HostRoles, host_roles, listen_addresses


def test_hosts_file_lines_comments_keys_and_ipv6() -> None:
    hosts = parse_hosts(
        """
        # the head first
        10.0.0.1 roles=trainer gpus=8     # a comment after keys
        gpu-2   roles=engine engines=2 addr=10.0.0.2 port=29700 python=/opt/venv/bin/python

        [fd00::3] roles=engine,trainer
        """
    )
    assert [h.host for h in hosts] == ["10.0.0.1", "gpu-2", "fd00::3"]
    assert hosts[0].trainer_count == 8 and hosts[0].engine_count == 0
    assert (
        hosts[1].addr == "10.0.0.2"
        and hosts[1].engine_count == 2
        and hosts[1].python == "/opt/venv/bin/python"
    )
    assert hosts[2].roles == ("engine", "trainer") and hosts[2].line == 6
    assert listen_addresses(hosts, 29600) == [
        "tcp://10.0.0.1:29600",
        "tcp://10.0.0.2:29700",
        "tcp://[fd00::3]:29600",
    ]
    roles = host_roles(hosts)
    assert roles == HostRoles(engines=[1, 1, 2], trainer=[0, 0, 0, 0, 0, 0, 0, 0, 2])
    placed = roles.apply(Config(cluster=ClusterConfig(engines_per_node=2)))  # the roles replace it
    assert (
        placed.cluster.engines,
        placed.cluster.engines_per_node,
        placed.cluster.trainer,
        placed.trainer.world_size,
    ) == ([1, 1, 2], 0, [0, 0, 0, 0, 0, 0, 0, 0, 2], 9)


def test_nodes_sharing_an_address_take_the_next_ports_and_no_roles_leave_the_config_to_place() -> None:
    hosts = parse_hosts("127.0.0.1\n127.0.0.1\n127.0.0.1 port=29650\n")
    assert listen_addresses(hosts, 29600) == [
        "tcp://127.0.0.1:29600",
        "tcp://127.0.0.1:29601",
        "tcp://127.0.0.1:29650",
    ]
    assert host_roles(hosts) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "no hosts"),
        ("# only a comment\n", "no hosts"),
        ("a\nb gpus=two\n", "hosts.txt:2: gpus='two' must be a whole number"),
        ("a colour=red\n", "hosts.txt:1: unknown key 'colour'"),
        ("a roles=engine,critic\n", "hosts.txt:1: unknown role 'critic'"),
        ("a gpus\n", "hosts.txt:1: 'gpus' is not key=value"),
        ("roles=engine\n", "hosts.txt:1: a line starts with the host"),
        ("a port=70000\n", "hosts.txt:1: port='70000' must be a whole number from 1 to 65535"),
        ("a gpus=1 gpus=2\n", "hosts.txt:1: gpus is given twice"),
        ("a port=1\n\nb addr=a port=1\n", "hosts.txt:3: a port 1 is also on line 1"),
        ("a;rm -rf /\n", "hosts.txt:1: host 'a;rm' is neither an IP address nor a host name"),
        ("a roles=engine\nb\n", "no host has the trainer role"),
    ],
)
def test_hosts_file_mistakes_name_the_line(text: str, expected: str) -> None:
    with pytest.raises(HostsFileError, match=None) as info:
        host_roles(parse_hosts(text, "hosts.txt"))
    assert expected in str(info.value)


def test_via_templates() -> None:
    argv = ["/venv/bin/python", "-m", "rlasync", "launch", "--from-stdin"]
    assert remote_command("ip netns exec {host}", "ns1", argv) == ["ip", "netns", "exec", "ns1", *argv]
    assert remote_command("ssh {host}", "fd00::2", argv) == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "fd00::2",
        "/venv/bin/python -m rlasync launch --from-stdin",
    ]
    assert remote_command("ssh -o BatchMode=no -p 2222 {host}", "h", argv)[:4] == [
        "ssh",
        "-o",
        "BatchMode=no",
        "-p",
    ]
    assert remote_command("docker exec -i {host} sh -c {command}", "c1", argv) == [
        "docker",
        "exec",
        "-i",
        "c1",
        "sh",
        "-c",
        "/venv/bin/python -m rlasync launch --from-stdin",
    ]


TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "6",
    "LOCAL_RANK": "2",
    "LOCAL_WORLD_SIZE": "3",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_torchrun_one_node_per_machine_its_local_rank_zero() -> None:
    me = from_env(TORCHRUN)
    assert (me.source, me.rank, me.nodes, me.local_rank, me.local_world_size) == ("torchrun", 1, 2, 2, 3)
    assert not me.is_node and me.agent_store and (me.master_addr, me.master_port) == ("10.0.0.1", 29400)
    plain = from_env(
        {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "[fd00::1]", "MASTER_PORT": "29500"}
    )  # --nproc-per-node=1
    assert (plain.rank, plain.nodes, plain.is_node, plain.master_addr, plain.agent_store) == (
        2,
        3,
        True,
        "fd00::1",
        False,
    )


def test_slurm_node_ids_and_the_head_from_master_addr() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_LOCALID": "0",
        "MASTER_ADDR": "n01",
    }
    me = from_env(env)
    assert (me.source, me.rank, me.nodes, me.is_node, me.master_addr, me.master_port) == (
        "slurm",
        3,
        4,
        True,
        "n01",
        29500,
    )
    assert not from_env({**env, "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}).is_node


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "the environment names no node"),
        (
            {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "RANK='x' must be a whole number",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is empty"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "0"},
            "MASTER_PORT=0 is not a TCP port",
        ),
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "do not fit together"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "PATH": "/nonexistent"},
            "export MASTER_ADDR=$(scontrol show hostnames",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NODEID": "2", "SLURM_NNODES": "2", "MASTER_ADDR": "a"},
            "SLURM_NODEID=2 is not below SLURM_NNODES=2",
        ),
    ],
)
def test_environment_mistakes_name_the_variable(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", env.get("PATH", "/nonexistent"))  # no scontrol here
    with pytest.raises(LaunchEnvError) as info:
        from_env(env)
    assert expected in str(info.value)
