"""Entry point of a node process: ``python -m rlasync.runtime.worker --rank R --head ADDR``.

Used by ``LocalCluster``, by nodes for the child processes they supervise (``--node-id
node-1.0``), and by ``rlasync node``. Runs one node on uvloop until it is told to shut down,
loses the head, is released by its head after a SIGTERM, SIGINT or SIGUSR1 (``runtime.signals``),
gets a second one, or (a child) loses its parent process. The cluster secret comes from the
environment (``RLASYNC_CLUSTER_SECRET``), never from the command line, where ``ps`` shows it;
the runtime config comes as JSON in ``RLASYNC_RUNTIME_CONFIG``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

import msgspec

from ..config import RuntimeConfig, convert
from .errors import JoinError
from .events import emit
from .joining import EX_TEMPFAIL
from .lifeline import die_with_parent, parent_from_env, watch_parent
from .node import Node, rank_of
from .signals import Deferral
from .types import CONFIG_ENV, SECRET_ENV

log = logging.getLogger(__name__)


async def serve(
    rank: int,
    listen: str,
    head: str | None,
    config: RuntimeConfig,
    secret: str | None,
    *,
    node_id: str | None = None,
) -> int:
    """Run a node until it stops; return the process's exit code.

    A node the head fenced, or that lost the head past ``runtime.node_dead_after_s``, stops with
    ``EX_TEMPFAIL`` (75). Started by a parent (a supervised child, a local cluster's node), it
    exits with that code: the parent decides. Started on its own (``rlasync node``), it joins
    again as a new process of the same rank (a new incarnation) as soon as the head answers,
    for up to ``runtime.rejoin_timeout_s``; the head then places roles on it again.
    """
    loop = asyncio.get_running_loop()
    parent = parent_from_env()
    watch: asyncio.Task[None] | None = None
    signalled = False
    node: Node | None = None

    def stop() -> None:
        nonlocal signalled
        signalled = True
        if node is not None:
            node.request_stop()

    # A signal defers to the head, which stops the run (with its checkpoint) and then this node
    # (runtime.signals); a second one, or the parent gone, stops it at once.
    deferral = Deferral(lambda: node, stop, parent)
    deferral.install(loop)
    if parent is not None:
        if not die_with_parent(parent):
            print(
                f"{node_id or f'node-{rank}'}: the process that started it (pid {parent}) is gone",
                file=sys.stderr,
            )
            return 1
        watch = asyncio.create_task(watch_parent(parent, stop), name="rlasync-parent-watch")
    rejoin_until: float | None = None
    try:
        while True:
            if rejoin_until is not None and head is not None:
                reach = await asyncio.to_thread(head_listens, head)
                if reach is False:  # its host answers and nothing listens: the head is gone, not cut off
                    log.error(
                        "%s: nothing listens at the head's address %s any more; not rejoining",
                        node_id or f"node-{rank}",
                        head,
                    )
                    return EX_TEMPFAIL
                if reach is None:  # still cut off
                    if signalled or loop.time() > rejoin_until:
                        return EX_TEMPFAIL
                    await asyncio.sleep(1.0)
                    continue
            node = Node(rank, listen, head=head, config=config, secret=secret, node_id=node_id)
            try:
                await node.start()
            except JoinError as exc:
                if rejoin_until is None or signalled or loop.time() > rejoin_until:
                    raise
                log.info("%s: cannot rejoin yet (%s); trying again", node.node_id, exc)
                await asyncio.sleep(1.0)
                continue
            emit("joined", node=node.node_id, address=node.address)
            if signalled:
                await node.stop()
            await node.stopped.wait()
            rejoin = (
                node.exit_code == EX_TEMPFAIL
                and parent is None
                and not signalled
                and not deferral.count  # signalled: a node stops, with or without its head
                and config.rejoin_timeout_s > 0
            )
            if not rejoin:
                return node.exit_code
            log.warning(
                "%s was cut off from the cluster; rejoining as a new process for up to runtime.rejoin_timeout_s=%gs",
                node.node_id,
                config.rejoin_timeout_s,
            )
            rejoin_until = loop.time() + config.rejoin_timeout_s
    finally:
        deferral.close()
        if watch is not None:
            watch.cancel()


def head_listens(address: str, timeout: float = 1.0) -> bool | None:
    """Whether something listens at the head's address: True, False (refused: its host is up and
    the head is not), or None (no answer: cut off)."""
    try:
        if address.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(address.removeprefix("ipc://"))
        else:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return None
    return True


def config_from_env() -> RuntimeConfig:
    raw = os.environ.get(CONFIG_ENV)
    return convert(msgspec.json.decode(raw), RuntimeConfig) if raw else RuntimeConfig()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlasync.runtime.worker", description=__doc__)
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int, help="this node's rank (0: the head)")
    who.add_argument(
        "--node-id", help="a supervised child's id, e.g. node-1.0 (its parent's rank, then its index)"
    )
    parser.add_argument("--listen", required=True, help="ipc:///path or tcp://host:port (port 0: any)")
    parser.add_argument("--head", default=None, help="the head's address (omit on rank 0)")
    parser.add_argument("--log-level", default=os.environ.get("RLASYNC_LOG_LEVEL", "WARNING"))
    args = parser.parse_args(argv)
    name = args.node_id or f"node-{args.rank}"
    rank = args.rank if args.node_id is None else rank_of(args.node_id)
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s"
    )
    import uvloop

    from .spawner import fork_children

    config = config_from_env()
    fork_children(config)  # before the event loop: its children are forked from a copy of this process
    try:
        return uvloop.run(
            serve(rank, args.listen, args.head, config, os.environ.get(SECRET_ENV), node_id=args.node_id)
        )
    except Exception as exc:  # a clean, one-line reason instead of a traceback for known failures
        from .errors import RuntimeErrorBase

        if isinstance(exc, RuntimeErrorBase):
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    from .process import exit_process

    exit_process(main())
