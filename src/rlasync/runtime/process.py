"""Node processes: starting one (``LocalCluster``, a node's supervised children), and ending one.

    proc = await start_node_process("node-1.0", "ipc:///tmp/d/node-1.0.sock", head_address,
                                    config=config, secret=secret, parent=os.getpid())

A node process gets what must not be on its command line (``ps`` shows that to every user)
through its environment: the cluster secret and the runtime config. A *child* (``parent``
given) dies with the process that started it (``runtime.lifeline``). It runs
``WORKER_ENTRY``, forked from this process's spawner where there is one (``runtime.spawner``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import msgspec

from ..config import RuntimeConfig
from .allocator import allocator_env
from .lifeline import PARENT_ENV
from .spawner import current_spawner
from .types import CONFIG_ENV, SECRET_ENV

log = logging.getLogger(__name__)

WORKER = "rlasync.runtime.worker"
WORKER_ENTRY = f"{WORKER}:main"
"""A node process's entry: ``python -m rlasync.runtime.worker ARGV``, or forked, ``main(ARGV)``."""


async def start_node_process(
    node_id: str,
    listen: str,
    head: str,
    *,
    config: RuntimeConfig,
    secret: str | None,
    parent: int | None = None,
    env: dict[str, str] | None = None,
) -> asyncio.subprocess.Process:
    """Start ``python -m rlasync.runtime.worker`` as ``node_id``, joining the head at ``head``."""
    # Preloaded for a child exec'd below; a forked one already runs under this process's.
    full_env = allocator_env(config.allocator)
    full_env.update(env or {})
    if secret:
        full_env[SECRET_ENV] = secret
    if config.metrics_port:  # the port asked for is the starting node's: this one takes a free one
        config = msgspec.structs.replace(config, metrics_port=0)
    full_env[CONFIG_ENV] = msgspec.json.encode(config).decode()
    # Actor classes are imported by module name: give the child this process's path.
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    argv = ["--node-id", node_id, "--listen", listen, "--head", head]
    full_env.pop(PARENT_ENV, None)
    spawner = current_spawner() if config.fork_children else None
    if spawner is not None:  # forked with this process's modules loaded (runtime.spawner)
        if parent is not None:  # its parent process is the spawner, which dies with this one
            full_env[PARENT_ENV] = str(spawner.pid)
        try:
            return await spawner.spawn(WORKER_ENTRY, argv, full_env)  # type: ignore[return-value]
        except OSError as exc:
            log.warning("forking %s failed (%s); starting it from nothing", node_id, exc)
    if parent is not None:
        full_env[PARENT_ENV] = str(parent)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", WORKER, *argv, env=full_env, stdin=subprocess.DEVNULL
    )


def exit_process(code: object) -> None:
    """End this process with ``code`` (``sys.exit``'s argument) once its work is done, as the
    interpreter would, but without tearing down every module and object one by one.

    The non-daemon threads are waited for, the ``atexit`` handlers run (trackers; logging's own
    shutdown is one) and the standard streams are flushed; then ``os._exit``. The interpreter's own shutdown of a
    process that has torch and transformers loaded spends ~3.5 s of CPU deallocating them,
    measured on `rlasync train` (8.4 s for a one-step run, 4.7 s with this): at the end of every
    run, node and launch, on each machine. Call it only from a process's entry point.
    """
    import atexit
    import threading

    if code is not None and not isinstance(code, int):  # sys.exit("message"): said, then 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass
    os._exit(code or 0)
