"""Entry point of a node process: ``python -m rlasync.runtime.worker --rank R --head ADDR``.

Used by ``LocalCluster`` and ``rlasync node``. Runs one node on uvloop until it is told to
shut down, loses the head, or gets SIGTERM/SIGINT. The cluster secret comes from the
environment (``RLASYNC_CLUSTER_SECRET``), never from the command line, where ``ps`` shows it;
the runtime config comes as JSON in ``RLASYNC_RUNTIME_CONFIG``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import msgspec

from ..config import RuntimeConfig, convert
from .node import Node
from .types import CONFIG_ENV, SECRET_ENV


async def serve(rank: int, listen: str, head: str | None, config: RuntimeConfig, secret: str | None) -> int:
    node = Node(rank, listen, head=head, config=config, secret=secret)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.request_stop)
    await node.start()
    await node.stopped.wait()
    return 0


def config_from_env() -> RuntimeConfig:
    raw = os.environ.get(CONFIG_ENV)
    return convert(msgspec.json.decode(raw), RuntimeConfig) if raw else RuntimeConfig()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlasync.runtime.worker", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--listen", required=True, help="ipc:///path or tcp://host:port (port 0: any)")
    parser.add_argument("--head", default=None, help="the head's address (omit on rank 0)")
    parser.add_argument("--log-level", default=os.environ.get("RLASYNC_LOG_LEVEL", "WARNING"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s node-{args.rank} %(name)s %(levelname)s %(message)s")
    import uvloop

    try:
        return uvloop.run(serve(args.rank, args.listen, args.head, config_from_env(), os.environ.get(SECRET_ENV)))
    except Exception as exc:  # a clean, one-line reason instead of a traceback for known failures
        from .errors import RuntimeErrorBase

        if isinstance(exc, RuntimeErrorBase):
            print(f"node-{args.rank}: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
