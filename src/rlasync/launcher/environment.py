"""Which node this process is, read from the environment torchrun or Slurm gives it.

    torchrun --nnodes=3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HEAD:29400 \\
        -m rlasync launch --from-env configs/quickstart_cluster.yaml
    srun --ntasks-per-node=1 python -m rlasync launch --from-env CONFIG      # launch/slurm.sbatch

One node process per machine, whatever the launcher: under torchrun a machine's node is its
local rank 0 and its rank is the machine's (``GROUP_RANK``). ``--nproc-per-node=G`` (one process
per GPU) is understood as "this machine has G devices": local rank 0 becomes the node and
starts the per-GPU processes the placement gives it (trainer ranks, engine workers) itself;
local ranks 1..G-1 exit at once with status 0. Slurm the same way: ``SLURM_NODEID`` is the node,
``SLURM_LOCALID`` > 0 exits. Node 0 (the head) runs the controller; the others join it at
``MASTER_ADDR``. torch.distributed groups meet at the same ``MASTER_ADDR:MASTER_PORT`` store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Literal

import msgspec

from ..config import ConfigError


class LaunchEnvError(ConfigError):
    """The environment does not say which node this is; the message names the variable."""


class Launched(msgspec.Struct, frozen=True, kw_only=True):
    """This process's place in a launch."""

    source: Literal["torchrun", "slurm"]
    rank: int
    """This node's rank (its machine's): 0 is the head."""
    nodes: int
    """Node processes in the run, one per machine."""
    local_rank: int = 0
    """This process's index on its machine: only local rank 0 is a node."""
    local_world_size: int = 1
    """Processes the launcher started on this machine (``--nproc-per-node``): its devices."""
    master_addr: str
    master_port: int
    agent_store: bool = False
    """torchrun's agent hosts the store at ``MASTER_ADDR:MASTER_PORT`` (else node 0 does)."""

    @property
    def is_node(self) -> bool:
        return self.local_rank == 0


def _int(env: Mapping[str, str], name: str, hint: str) -> int:
    value = env.get(name, "")
    try:
        number = int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} must be a whole number ({hint})") from None
    if number < 0:
        raise LaunchEnvError(f"{name}={value!r} must not be negative ({hint})")
    return number


def from_env(env: Mapping[str, str] | None = None) -> Launched:
    """This process's place from torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or Slurm's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_LOCALID``, ``SLURM_NNODES``,
    with ``MASTER_ADDR`` from ``scontrol show hostnames`` when the job script did not set it)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    raise LaunchEnvError(
        "launch --from-env: the environment names no node: run under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) "
        "or Slurm's srun (SLURM_PROCID, SLURM_NTASKS); or use `rlasync launch --nodes hosts.txt`"
    )


def _torchrun(env: Mapping[str, str]) -> Launched:
    hint = "set by torchrun"
    rank, world = _int(env, "RANK", hint), _int(env, "WORLD_SIZE", hint)
    local_world = _int(env, "LOCAL_WORLD_SIZE", hint) if "LOCAL_WORLD_SIZE" in env else 1
    local_rank = _int(env, "LOCAL_RANK", hint) if "LOCAL_RANK" in env else 0
    if local_world < 1 or world < 1 or world % local_world or rank >= world or local_rank >= local_world:
        raise LaunchEnvError(
            f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world} do not fit together"
        )
    node = _int(env, "GROUP_RANK", hint) if "GROUP_RANK" in env else rank // local_world
    nodes = _int(env, "GROUP_WORLD_SIZE", hint) if "GROUP_WORLD_SIZE" in env else world // local_world
    addr, port = _master(env)
    return Launched(
        source="torchrun",
        rank=node,
        nodes=nodes,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _slurm(env: Mapping[str, str]) -> Launched:
    hint = "set by srun"
    tasks = _int(env, "SLURM_NTASKS", hint) if "SLURM_NTASKS" in env else 1
    nodes = _int(env, "SLURM_NNODES", hint) if "SLURM_NNODES" in env else tasks
    node = _int(env, "SLURM_NODEID", hint) if "SLURM_NODEID" in env else _int(env, "SLURM_PROCID", hint)
    local_rank = _int(env, "SLURM_LOCALID", hint) if "SLURM_LOCALID" in env else 0
    if nodes < 1 or node >= nodes:
        raise LaunchEnvError(f"SLURM_NODEID={node} is not below SLURM_NNODES={nodes}")
    if "MASTER_ADDR" not in env:
        env = {**env, "MASTER_ADDR": _first_slurm_host(env)}
    addr, port = _master({"MASTER_PORT": "29500", **env})
    return Launched(
        source="slurm",
        rank=node,
        nodes=nodes,
        local_rank=local_rank,
        local_world_size=max(tasks // nodes, 1),
        master_addr=addr,
        master_port=port,
    )


def _master(env: Mapping[str, str]) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR", "").strip("[]")
    if not addr:
        raise LaunchEnvError(
            "MASTER_ADDR is empty: it must name the head's machine (node 0), as other machines reach it"
        )
    port = _int(env, "MASTER_PORT", "the port of the rendezvous store on MASTER_ADDR")
    if not 0 < port < 65536:
        raise LaunchEnvError(f"MASTER_PORT={port} is not a TCP port")
    return addr, port


def _first_slurm_host(env: Mapping[str, str]) -> str:
    """The job's first host (the head), as ``scontrol show hostnames $SLURM_JOB_NODELIST`` says."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    scontrol = shutil.which("scontrol")
    if not nodelist or scontrol is None:
        raise LaunchEnvError(
            "MASTER_ADDR is not set and the head cannot be found without SLURM_JOB_NODELIST and scontrol: "
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) (launch/slurm.sbatch does)'
        )
    try:
        out = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchEnvError(
            f"`scontrol show hostnames {nodelist}` failed ({exc}); export MASTER_ADDR yourself"
        ) from None
    hosts = out.split()
    if not hosts:
        raise LaunchEnvError(
            f"`scontrol show hostnames {nodelist}` named no host; export MASTER_ADDR yourself"
        )
    return hosts[0]
