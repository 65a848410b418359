"""``rlasync node``: one node process of a cluster, and ``serve_node``, which runs a node of a
training run for it and for ``rlasync launch``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

from .common import with_plugins
from .errors import said

if TYPE_CHECKING:
    from ..config import Config


def node(
    rank: int = typer.Option(..., help="This node's rank; 0 is the head."),
    listen: str = typer.Option(
        "tcp://0.0.0.0:29600", help="Address to listen on: tcp://host:port or ipc:///path."
    ),
    head: str | None = typer.Option(
        None, help="The head's address, e.g. tcp://10.0.0.1:29600 (omit on rank 0)."
    ),
    config: str | None = typer.Option(None, help="YAML experiment config; its runtime section is used."),
    override: list[str] = typer.Option(
        [], "--set", help="Dotted override, e.g. --set runtime.node_dead_after_s=5."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Run one node process until it is shut down or loses the head. The cluster secret comes from
    RLASYNC_CLUSTER_SECRET. It loads the engines and agent loops before joining; the head places
    roles on it (the cluster section of the run's config)."""
    import logging

    from ..config import ConfigError, load_config
    from ..runtime.types import SECRET_ENV

    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s node-{rank} %(name)s %(levelname)s %(message)s"
    )
    from ..runtime.allocator import run_under_allocator

    try:
        cfg = load_config(config, override)
        run_under_allocator(cfg.runtime.allocator)  # before torch loads; its children inherit it
    except ConfigError as exc:  # an allocator not installed too
        raise typer.BadParameter(str(exc)) from None
    secret = os.environ.get(SECRET_ENV)
    if listen.startswith("tcp://") and not secret:
        raise typer.BadParameter(
            f"TCP nodes authenticate with a shared secret: export {SECRET_ENV} (make one with `rlasync secret`)"
        )
    raise typer.Exit(serve_node(rank, listen, head, with_plugins(cfg, []), secret))


def serve_node(
    rank: int,
    listen: str,
    head: str | None,
    cfg: Config,
    secret: str | None,
    *,
    watch_stdin: bool = False,
) -> int:
    """Run a node of a training run until it stops; its exit code (2: it could not start).
    ``watch_stdin``: stop when stdin closes (a launched node: its launcher is gone)."""
    import uvloop

    from ..config.cluster import with_node_modules
    from ..plugins import PluginError, load_all
    from ..runtime.errors import RuntimeErrorBase
    from ..runtime.spawner import fork_children
    from ..runtime.worker import serve

    # A node of a training run hosts engines and agent loops (the run's plugins' among them): torch
    # and the engines load before it joins, while no heartbeat waits on it (loaded later, they hold
    # the GIL for seconds).
    runtime = with_node_modules(cfg.runtime, *cfg.plugins)
    try:
        load_all(cfg.plugins)
    except PluginError as exc:
        return said(f"node-{rank}", exc, 2)
    fork_children(runtime)  # before any thread or event loop: the processes it supervises are forked
    if watch_stdin:
        from ..launcher.ticket import stop_when_stdin_closes

        stop_when_stdin_closes()
    try:
        return int(uvloop.run(serve(rank, listen, head, runtime, secret)))
    except RuntimeErrorBase as exc:
        return said(f"node-{rank}", exc, 2)
