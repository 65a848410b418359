"""``rlasync launch``: a run on many machines, from a hosts file (this process launches a node on
every host), or as one node of a torchrun or Slurm start; and the process a launched host runs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

from .common import RESUME_HELP, parse_resume, with_plugins
from .errors import Failure, exits, said
from .node import serve_node
from .train import run_train

if TYPE_CHECKING:
    from ..compose.checkpoints import Resume
    from ..config import Config

WHO = "rlasync launch"


def launch(
    config: str | None = typer.Argument(
        None, help="YAML experiment config, e.g. configs/quickstart_cluster.yaml."
    ),
    overrides: list[str] = typer.Argument(
        None, help="Dotted overrides: train.steps=100 launch.start_timeout_s=600 ..."
    ),
    nodes: str | None = typer.Option(
        None, "--nodes", help="Hosts file: one machine per line, the head first (launch/hosts.example.txt)."
    ),
    via: str | None = typer.Option(
        None,
        "--via",
        help="Command template that runs a command on {host} (launch.via; default 'ssh {host}').",
    ),
    from_env: bool = typer.Option(
        False,
        "--from-env",
        help="Be the node torchrun's or Slurm's environment names (RANK/MASTER_ADDR, SLURM_PROCID).",
    ),
    from_stdin: bool = typer.Option(
        False, "--from-stdin", hidden=True, help="Be the node the launcher's ticket on stdin names."
    ),
    plugin: list[str] = typer.Option(
        [], "--plugin", help="A module or .py file every node imports first; adds to `plugins`."
    ),
    resume: str = typer.Option("", "--resume", metavar="[=auto]", show_default=False, help=RESUME_HELP),
) -> None:
    """Start a run on many machines: `--nodes hosts.txt` starts a node on every host (the first
    one is the head, which runs the controller) and relays their output; `--from-env` is one
    node of a torchrun or Slurm start. The cluster secret comes from RLASYNC_CLUSTER_SECRET (a
    fresh one when unset) and reaches the hosts on stdin, never on a command line.

    A SIGTERM to every node at once (scancel, a time limit, torchrun) stops the run as one
    interrupt, with a checkpoint under train.checkpoint_on_interrupt; `--resume=auto` continues it."""
    from ..config import ConfigError, load_config
    from ..runtime.allocator import run_under_allocator

    if from_stdin:
        raise typer.Exit(_launched_from_stdin())
    if (nodes is None) == (not from_env) or config is None:
        usage = "give a CONFIG and one of --nodes hosts.txt or --from-env (under torchrun or srun)"
        raise typer.Exit(said(WHO, usage, 2))
    wanted = parse_resume(resume, WHO)
    with exits(WHO, Failure((ConfigError,), 2)):
        if nodes is not None:
            code = _launch_hosts(config, overrides or [], nodes, via, plugin, wanted)
        else:
            cfg = with_plugins(load_config(config, overrides or []), plugin)
            run_under_allocator(cfg.runtime.allocator)  # before torch loads; the node's processes inherit it
            code = _launched_from_env(cfg, wanted)
    raise typer.Exit(code)


def _launch_hosts(
    path: str, overrides: list[str], hosts_file: str, via: str | None, plugin: list[str], resume: Resume
) -> int:
    import uvloop

    from ..compose.placement import Placement
    from ..config import load_config
    from ..launcher import Launch, read_hosts
    from ..launcher.hosts import host_roles, listen_addresses
    from ..runtime.types import SECRET_ENV
    from ..transport.auth import new_secret

    hosts = read_hosts(hosts_file)
    head = listen_addresses(hosts, load_config(path, overrides).launch.port)[0]
    roles = host_roles(hosts)
    extra = [f"cluster.nodes={len(hosts)}", "cluster.start=external", f"cluster.listen={head}"]
    cfg = load_config(path, [*overrides, *extra, *([f"launch.via={via}"] if via else [])])
    cfg = with_plugins(roles.apply(cfg) if roles is not None else cfg, plugin)
    Placement.of(cfg)  # a placement that does not fit the hosts fails here, before anything starts
    secret = os.environ.get(SECRET_ENV) or new_secret()
    return int(uvloop.run(Launch(hosts, cfg, secret=secret, resume=resume).run()))


def _launched_from_stdin() -> int:
    """One host's process of `rlasync launch --nodes`: its ticket on stdin says which node."""
    import msgspec

    from ..config import Config, ConfigError, convert
    from ..launcher.ticket import TICKET_ENV, read_ticket
    from ..runtime.allocator import run_under_allocator
    from ..runtime.events import print_events
    from ..runtime.types import SECRET_ENV, VERSION

    try:
        ticket = read_ticket(version=VERSION)
        cfg = convert(ticket.config, Config)
        # Started again under the run's allocator, the ticket (read from stdin, which the
        # launcher writes once) goes along in the environment, as the secret does to children.
        run_under_allocator(cfg.runtime.allocator, {TICKET_ENV: msgspec.json.encode(ticket).decode()})
    except ConfigError as exc:  # an allocator not installed too
        return said(WHO, exc, 2)
    os.environ[SECRET_ENV] = ticket.secret  # for the processes this one starts, never their command lines
    print_events()
    if ticket.rank == 0:
        return run_train(cfg, resume=ticket.resume, watch_stdin=True)
    import logging

    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s node-{ticket.rank} %(name)s %(levelname)s %(message)s"
    )
    return serve_node(ticket.rank, ticket.listen, ticket.head, cfg, ticket.secret, watch_stdin=True)


def _launched_from_env(cfg: Config, resume: Resume) -> int:
    """One node of a torchrun or Slurm start (``launcher.environment``)."""
    import logging

    import msgspec

    from ..launcher.environment import from_env
    from ..launcher.rendezvous import find_head, publish_head
    from ..runtime.types import SECRET_ENV

    me = from_env()
    if not me.is_node:
        typer.echo(
            f"rlasync launch: local rank {me.local_rank} of {me.local_world_size}: node {me.rank}'s process is local rank 0, "
            "which starts this machine's per-device processes itself; nothing to do here"
        )
        return 0
    secret = os.environ.get(SECRET_ENV)
    if me.nodes > 1 and not secret:
        return said(
            WHO,
            f"the nodes authenticate with a shared secret: export {SECRET_ENV} on every machine (make one with `rlasync secret`)",
            2,
        )
    # torch.distributed groups meet where the launcher's rendezvous is (runtime.rendezvous).
    os.environ.setdefault("MASTER_ADDR", me.master_addr)
    os.environ.setdefault("MASTER_PORT", str(me.master_port))
    os.environ.setdefault("RANK", "0" if me.rank == 0 else str(me.rank))
    timeout = max(cfg.launch.start_timeout_s, cfg.runtime.join_timeout_s)
    if me.rank == 0:
        head = publish_head(me, timeout)
        cluster = msgspec.structs.replace(cfg.cluster, start="external", listen=head, nodes=me.nodes)
        return run_train(msgspec.structs.replace(cfg, cluster=cluster), resume=resume)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s node-{me.rank} %(name)s %(levelname)s %(message)s"
    )
    head = find_head(me, timeout)
    runtime = msgspec.structs.replace(cfg.runtime, join_timeout_s=timeout)
    return serve_node(me.rank, "tcp://[::]:0", head, msgspec.structs.replace(cfg, runtime=runtime), secret)
