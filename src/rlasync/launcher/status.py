"""``rlasync status``: the live nodes of a running cluster, asked of its head.

    $ RLASYNC_CLUSTER_SECRET=... rlasync status --head tcp://10.0.0.1:29600
    node    host    address              heartbeat  roles
    node-0  gpu-1   tcp://10.0.0.1:29600 -          head, trainer rank 0
    node-1  gpu-2   tcp://10.0.0.2:29600 0.2 s      engine-0 (weights v12), agent loops, trainer rank 1

It runs a node that does not join (a client: no rank, no heartbeats), asks the head's
membership for every live node and its named actors, and each engine for the weight version
it serves; every call has ``--timeout``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import uuid

import msgspec

from ..runtime import Node, RuntimeErrorBase
from ..runtime.ref import ActorRef
from ..runtime.types import ActorInfo, MemberStatus

_RANK = re.compile(r"-rank(\d+)$")


class StatusError(Exception):
    """The head could not be asked; the message says what to check."""


class NodeRow(msgspec.Struct, frozen=True):
    node: str
    host: str
    address: str
    pid: int
    heartbeat_age_s: float
    roles: list[str]
    engine_versions: dict[str, int]  # engine actor -> the weight version it serves (-1: no answer)


def _role(actor: ActorInfo, versions: dict[str, int]) -> str:
    kind = actor.cls.rsplit(":", 1)[-1]
    if kind == "EngineActor":
        version = versions.get(actor.name, -1)
        return f"{actor.name} (weights v{version})" if version >= 0 else f"{actor.name} (no answer)"
    if kind == "AgentLoopWorker":
        return "agent loops"
    if kind == "TrainerRank":
        rank = _RANK.search(actor.name)
        return f"trainer rank {rank.group(1)}" if rank else "trainer rank"
    return actor.name


async def cluster_status(head: str, secret: str | None, *, timeout: float = 5.0) -> list[NodeRow]:
    """Every live node of the cluster whose head listens at ``head``."""
    folder = tempfile.mkdtemp(prefix="rlasync-status-") if head.startswith("ipc://") else ""
    listen = f"ipc://{folder}/client.sock" if folder else "tcp://127.0.0.1:0"
    client = Node(0, listen, head=head, secret=secret, node_id=f"status-{uuid.uuid4().hex[:8]}", member=False)
    try:
        await client.start()
        try:
            members: list[MemberStatus] = await client.membership.status.options(timeout=timeout)()
        except RuntimeErrorBase as exc:
            raise StatusError(
                f"the head at {head} did not answer within {timeout:g}s ({exc}): is the run up, and is RLASYNC_CLUSTER_SECRET its secret?"
            ) from None
        engines = [a for m in members for a in m.actors if a.cls.endswith(":EngineActor")]
        answers = await asyncio.gather(
            *[ActorRef(client, a).weight_version.options(timeout=timeout)() for a in engines],
            return_exceptions=True,
        )
        versions = {a.name: int(v) if isinstance(v, int) else -1 for a, v in zip(engines, answers)}
    finally:
        await client.stop()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for m in members:
        roles = (["head"] if m.info.node_id == "node-0" else []) + [
            _role(a, versions) for a in m.actors if not a.name.startswith("_")
        ]
        mine = {a.name: versions[a.name] for a in m.actors if a.name in versions}
        rows.append(
            NodeRow(m.info.node_id, m.info.host, m.info.address, m.info.pid, m.heartbeat_age_s, roles, mine)
        )
    return rows


def render(rows: list[NodeRow]) -> None:
    """The rows as one table on stdout."""
    from rich.console import Console
    from rich.markup import escape  # "[fd00::2]" is an address, not a style
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("node", "host", "address", "pid", "heartbeat", "roles"):
        table.add_column(column)
    for row in rows:
        beat = "-" if row.node == "node-0" else f"{row.heartbeat_age_s:.1f} s"
        table.add_row(
            *[
                escape(cell)
                for cell in (row.node, row.host, row.address, str(row.pid), beat, ", ".join(row.roles) or "-")
            ]
        )
    Console(width=200).print(table)
