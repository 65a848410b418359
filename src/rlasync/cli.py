"""The ``rlasync`` command line. Heavy imports happen inside commands, so ``--help`` is instant."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from pathlib import Path

    from .config import Config

app = typer.Typer(
    help="rlasync: asynchronous RL post-training without Ray.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # help text is Markdown: `code`, paragraphs rewrapped
)


@app.command()
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

    from .config import ConfigError, load_config
    from .runtime.types import SECRET_ENV

    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s node-{rank} %(name)s %(levelname)s %(message)s"
    )
    try:
        cfg = load_config(config, override)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    secret = os.environ.get(SECRET_ENV)
    if listen.startswith("tcp://") and not secret:
        raise typer.BadParameter(
            f"TCP nodes authenticate with a shared secret: export {SECRET_ENV} (make one with `rlasync secret`)"
        )
    raise typer.Exit(_serve_node(rank, listen, head, _with_plugins(cfg, []), secret))


def _with_plugins(cfg: Config, extra: list[str]) -> Config:
    """``cfg`` with the ``--plugin`` ones added to its ``plugins``, file paths made absolute: the
    processes it reaches (nodes, launched hosts) may run elsewhere."""
    import msgspec

    from .plugins import resolved

    return msgspec.structs.replace(cfg, plugins=list(resolved([*cfg.plugins, *extra])))


def _serve_node(
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

    from .config.cluster import with_node_modules
    from .plugins import PluginError, load_all
    from .runtime.errors import RuntimeErrorBase
    from .runtime.spawner import fork_children
    from .runtime.worker import serve

    # A node of a training run hosts engines and agent loops (the run's plugins' among them): torch
    # and the engines load before it joins, while no heartbeat waits on it (loaded later, they hold
    # the GIL for seconds).
    runtime = with_node_modules(cfg.runtime, *cfg.plugins)
    try:
        load_all(cfg.plugins)
    except PluginError as exc:
        typer.echo(f"node-{rank}: {exc}", err=True)
        return 2
    fork_children(runtime)  # before any thread or event loop: the processes it supervises are forked
    if watch_stdin:
        from .launcher.ticket import stop_when_stdin_closes

        stop_when_stdin_closes()
    try:
        return int(uvloop.run(serve(rank, listen, head, runtime, secret)))
    except RuntimeErrorBase as exc:
        typer.echo(f"node-{rank}: {exc}", err=True)
        return 2


@app.command()
def train(
    config: str = typer.Argument(..., help="YAML experiment config, e.g. configs/quickstart.yaml."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides: trainer.lr=3e-4 train.steps=100 ..."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the newest checkpoint in train.run_dir."
    ),
    plugin: list[str] = typer.Option(
        [],
        "--plugin",
        help="A module or .py file to import first (its loops, tools, rewards, samplers...); adds to `plugins`.",
    ),
) -> None:
    """Train with the schedule `train.mode` names (sync, one_step_off, fully_async); ends
    with one JSON line of the result."""
    from .config import ConfigError, load_config

    try:
        cfg = _with_plugins(load_config(config, overrides or []), plugin)
    except ConfigError as exc:
        typer.echo(f"rlasync train: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(_train(cfg, resume=resume))


def _train(cfg: Config, *, resume: bool = False, watch_stdin: bool = False) -> int:
    """Run ``cfg`` to its end in this process (the head); the exit code, after one JSON line of
    the result (0), a one-line reason (1: the run stopped, 2: it could not start) or an
    interruption (130). ``watch_stdin``: stop when stdin closes (a launched head)."""
    import asyncio
    import json
    import logging

    import msgspec
    import uvloop

    from .config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .interrupts import Interrupts, exit_now

    # Ctrl-C (SIGINT) or SIGTERM (a scheduler, `kill`) stops the run cleanly, within a deadline
    # (rlasync.interrupts); one during start-up stops it before it starts anything.
    interrupts = Interrupts(cfg.train)
    interrupts.hold()
    from .config.cluster import with_node_modules
    from .modes import fully_async, one_step_off, sync, train  # noqa: F401  (the schedules, torch with them: loaded before the fork below)
    from .plugins import PluginError, load_all
    from .runtime.spawner import fork_children

    try:  # before the config's names are looked up: the plugins register them
        load_all(cfg.plugins)
    except PluginError as exc:
        typer.echo(f"rlasync train: {exc}", err=True)
        return 2
    # The nodes and trainer ranks this process starts are forked, with what they host (and the
    # run's plugins) loaded.
    fork_children(with_node_modules(cfg.runtime, *cfg.plugins))
    if watch_stdin:
        from .launcher.ticket import stop_when_stdin_closes

        stop_when_stdin_closes()
    if interrupts.count:
        typer.echo("rlasync train: interrupted before the run started", err=True)
        return 130
    from .agents import NoWorkerError
    from .data import DatasetError
    from .engines import EngineError
    from .metrics.progress import RunProgress
    from .modes import RunInterrupted
    from .modes.warmstart import WARMSTART_PROGRESS
    from .rewards import RewardError
    from .runtime import RuntimeErrorBase
    from .trainer.checkpoint import CheckpointError
    from .weights import SyncError

    progress = RunProgress(cfg.train.steps)  # live in a terminal, plain lines in a log
    logging.getLogger().handlers[:] = [progress.log_handler()]
    WARMSTART_PROGRESS.set(progress.warmstart)

    async def main() -> Any:
        interrupts.install(asyncio.current_task())  # type: ignore[arg-type]
        with progress:
            return await train(cfg, resume=resume, on_step=progress.step, stop=interrupts.stop)

    try:
        result = uvloop.run(main())
    except (CheckpointError, ConfigError, DatasetError) as exc:
        typer.echo(f"rlasync train: {exc}", err=True)
        return 2
    except (
        RuntimeErrorBase,
        EngineError,
        SyncError,
        NoWorkerError,
        RewardError,
    ) as exc:  # a lost node, a dead rank, no engine left, a broken reward
        typer.echo(f"rlasync train: the run stopped: {type(exc).__name__}: {exc}", err=True)
        return 1
    except RunInterrupted as exc:  # it stopped at a step's end (train.checkpoint_on_interrupt)
        typer.echo(
            f"rlasync train: interrupted; {exc}; metrics so far in {cfg.train.run_dir}/metrics.jsonl",
            err=True,
        )
        exit_now(130)
        return 130
    except (
        KeyboardInterrupt,
        asyncio.CancelledError,
    ):  # the run's tasks were cancelled and its parts closed on the way out
        typer.echo(
            f"rlasync train: interrupted; metrics so far in {cfg.train.run_dir}/metrics.jsonl", err=True
        )
        exit_now(130)
        return 130
    finally:
        interrupts.disarm()
    start = "at the start" if cfg.train.model_dir else "after the warm-start"  # model_dir: none was made
    how = (
        f"{cfg.train.val_samples} sampled at temperature {cfg.train.val_temperature:g}"
        if cfg.train.val_temperature
        else "greedy"
    )
    typer.echo(
        f"validation accuracy ({how}, held-out): {result.initial_accuracy:.3f} {start} -> {result.final_accuracy:.3f} after RL"
    )
    typer.echo(json.dumps(msgspec.to_builtins(result)))
    return 0


@app.command()
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
) -> None:
    """Start a run on many machines: `--nodes hosts.txt` starts a node on every host (the first
    one is the head, which runs the controller) and relays their output; `--from-env` is one
    node of a torchrun or Slurm start. The cluster secret comes from RLASYNC_CLUSTER_SECRET (a
    fresh one when unset) and reaches the hosts on stdin, never on a command line."""
    from .config import ConfigError, load_config

    if from_stdin:
        raise typer.Exit(_launched_from_stdin())
    if (nodes is None) == (not from_env) or config is None:
        typer.echo(
            "rlasync launch: give a CONFIG and one of --nodes hosts.txt or --from-env (under torchrun or srun)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        if nodes is not None:
            code = _launch_hosts(config, overrides or [], nodes, via, plugin)
        else:
            code = _launched_from_env(_with_plugins(load_config(config, overrides or []), plugin))
    except ConfigError as exc:
        typer.echo(f"rlasync launch: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _launch_hosts(
    path: str, overrides: list[str], hosts_file: str, via: str | None, plugin: list[str]
) -> int:
    import uvloop

    from .config import load_config
    from .launcher import Launch, read_hosts
    from .launcher.hosts import listen_addresses, placement_overrides
    from .modes.placement import Placement
    from .runtime.types import SECRET_ENV
    from .transport.auth import new_secret

    hosts = read_hosts(hosts_file)
    head = listen_addresses(hosts, load_config(path, overrides).launch.port)[0]
    extra = [
        *placement_overrides(hosts),
        f"cluster.nodes={len(hosts)}",
        "cluster.start=external",
        f"cluster.listen={head}",
    ]
    cfg = _with_plugins(
        load_config(path, [*overrides, *extra, *([f"launch.via={via}"] if via else [])]), plugin
    )
    Placement.of(cfg)  # a placement that does not fit the hosts fails here, before anything starts
    secret = os.environ.get(SECRET_ENV) or new_secret()
    return int(uvloop.run(Launch(hosts, cfg, secret=secret).run()))


def _launched_from_stdin() -> int:
    """One host's process of `rlasync launch --nodes`: its ticket on stdin says which node."""
    from .config import Config, ConfigError, convert
    from .launcher.ticket import read_ticket
    from .runtime.events import print_events
    from .runtime.types import SECRET_ENV, VERSION

    try:
        ticket = read_ticket(version=VERSION)
        cfg = convert(ticket.config, Config)
    except ConfigError as exc:
        typer.echo(f"rlasync launch: {exc}", err=True)
        return 2
    os.environ[SECRET_ENV] = ticket.secret  # for the processes this one starts, never their command lines
    print_events()
    if ticket.rank == 0:
        return _train(cfg, watch_stdin=True)
    import logging

    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s node-{ticket.rank} %(name)s %(levelname)s %(message)s"
    )
    return _serve_node(ticket.rank, ticket.listen, ticket.head, cfg, ticket.secret, watch_stdin=True)


def _launched_from_env(cfg: Config) -> int:
    """One node of a torchrun or Slurm start (``launcher.environment``)."""
    import logging

    import msgspec

    from .launcher.environment import from_env
    from .launcher.rendezvous import find_head, publish_head
    from .runtime.types import SECRET_ENV

    me = from_env()
    if not me.is_node:
        typer.echo(
            f"rlasync launch: local rank {me.local_rank} of {me.local_world_size}: node {me.rank}'s process is local rank 0, "
            "which starts this machine's per-device processes itself; nothing to do here"
        )
        return 0
    secret = os.environ.get(SECRET_ENV)
    if me.nodes > 1 and not secret:
        typer.echo(
            f"rlasync launch: the nodes authenticate with a shared secret: export {SECRET_ENV} on every machine (make one with `rlasync secret`)",
            err=True,
        )
        return 2
    # torch.distributed groups meet where the launcher's rendezvous is (runtime.rendezvous).
    os.environ.setdefault("MASTER_ADDR", me.master_addr)
    os.environ.setdefault("MASTER_PORT", str(me.master_port))
    os.environ.setdefault("RANK", "0" if me.rank == 0 else str(me.rank))
    timeout = max(cfg.launch.start_timeout_s, cfg.runtime.join_timeout_s)
    if me.rank == 0:
        head = publish_head(me, timeout)
        cluster = msgspec.structs.replace(cfg.cluster, start="external", listen=head, nodes=me.nodes)
        return _train(msgspec.structs.replace(cfg, cluster=cluster))
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s node-{me.rank} %(name)s %(levelname)s %(message)s"
    )
    head = find_head(me, timeout)
    runtime = msgspec.structs.replace(cfg.runtime, join_timeout_s=timeout)
    return _serve_node(me.rank, "tcp://[::]:0", head, msgspec.structs.replace(cfg, runtime=runtime), secret)


@app.command()
def status(
    head: str | None = typer.Option(None, "--head", help="The head's address, e.g. tcp://10.0.0.1:29600."),
    config: str | None = typer.Option(None, "--config", help="Or the run's config: its cluster.listen."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the head and each engine."),
) -> None:
    """The live nodes of a running cluster: roles, the weight version each engine serves,
    heartbeat age. Needs the cluster secret (RLASYNC_CLUSTER_SECRET)."""
    import uvloop

    from .config import ConfigError, load_config
    from .launcher.status import StatusError, cluster_status, render
    from .runtime.types import SECRET_ENV

    if head is None and config is not None:
        try:
            head = load_config(config, []).cluster.listen or None
        except ConfigError as exc:
            typer.echo(f"rlasync status: {exc}", err=True)
            raise typer.Exit(2) from None
    if not head:
        typer.echo("rlasync status: give --head tcp://HOST:PORT (or --config with cluster.listen)", err=True)
        raise typer.Exit(2)
    secret = os.environ.get(SECRET_ENV)
    if head.startswith("tcp://") and not secret:
        typer.echo(f"rlasync status: export {SECRET_ENV} (the cluster's secret) to ask its head", err=True)
        raise typer.Exit(2)
    try:
        nodes = uvloop.run(cluster_status(head, secret, timeout=timeout))
    except StatusError as exc:
        typer.echo(f"rlasync status: {exc}", err=True)
        raise typer.Exit(1) from None
    render(nodes)


@app.command()
def serve(
    model: str = typer.Argument(
        ...,
        help="A model folder (config.json, weights, tokenizer), or a YAML experiment config: the model "
        "its run starts from, e.g. configs/quickstart.yaml.",
    ),
    overrides: list[str] = typer.Argument(
        None, help="With a config: dotted overrides, e.g. train.seed=4 train.run_dir=runs/other."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, help="Port to listen on (0: a free one, printed)."),
    served_model_name: str = typer.Option(
        "", help="The model name clients use (default: the folder's name)."
    ),
    api_key: str = typer.Option("", envvar="RLASYNC_API_KEY", help="Require this key (Bearer)."),
    backend: str = typer.Option("torch", help="The engine: torch, or vllm / sglang where installed."),
    tool_parser: str = typer.Option(
        "hermes", help="How tool calls are read from replies: hermes or gpt-oss."
    ),
    max_batch: int = typer.Option(64, help="Sequences the engine decodes at once."),
    threads: int = typer.Option(
        1, help="CPU threads of the torch engine (0: torch's default, one per core)."
    ),
) -> None:
    """An OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, /v1/models) for
    chat or evaluation, no training; Ctrl-C stops it.

    Given a config, it serves the model that config's run starts from: `train.model_dir`, or `train.preset` warm-started on `train.task`,
    found in the cache under `train.run_dir` or warm-started there now, as `rlasync train` does
    (the serving options are this command's; the config only names the model)."""
    import asyncio
    import logging
    from pathlib import Path

    import uvloop

    from .config import ConfigError, EndpointConfig, EngineConfig
    from .engines import EngineError, build_engine
    from .models.tiny import load_tokenizer
    from .serving import Endpoint, EndpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        model_dir = str(_model_to_serve(model, overrides or []))
    except ConfigError as exc:
        typer.echo(f"rlasync serve: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # during a warm-start
        typer.echo("rlasync serve: stopped", err=True)
        raise typer.Exit(130) from None
    try:
        endpoint_config = EndpointConfig(
            host=host,
            port=port,
            served_model_name=served_model_name or Path(model_dir).resolve().name,
            api_key=api_key,
        )
        engine_config = EngineConfig(
            model=model_dir, backend=backend, max_batch=max_batch, cpu_threads=threads
        )
    except (ConfigError, ValueError, TypeError) as exc:
        typer.echo(f"rlasync serve: {exc}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        engine = await build_engine(engine_config)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
            async with Endpoint(engine, tokenizer, endpoint_config, tool_parser=tool_parser) as endpoint:
                typer.echo(f"serving {endpoint.model_name!r} at {endpoint.url}/v1 (Ctrl-C stops)", err=True)
                await asyncio.Event().wait()  # until Ctrl-C cancels it
        finally:
            await engine.close()

    try:
        uvloop.run(main())
    except (EndpointError, EngineError, ConfigError) as exc:
        typer.echo(f"rlasync serve: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("rlasync serve: stopped", err=True)


def _model_to_serve(model: str, overrides: list[str]) -> Path:
    """The folder ``rlasync serve MODEL`` serves: ``model`` itself, or the model the config
    ``model`` names starts its run from (a warm-start not cached yet is made now, in this
    thread: Ctrl-C stops it at once). A ``ConfigError`` names what to pass instead."""
    from pathlib import Path

    from .config import ConfigError, load_config

    path = Path(model)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        from .modes.parts import starting_model_dir  # torch and the modes: only for a config

        return starting_model_dir(load_config(path, overrides))
    if overrides:
        raise ConfigError(f"overrides ({' '.join(overrides)}) apply to a YAML config, and {model} is not one")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{model} is not a model folder (no config.json) nor a YAML config: pass a folder with "
            "config.json, weights and tokenizer, or a config such as configs/quickstart.yaml (the "
            "model its run starts from, warm-started if not cached yet)"
        )
    return path


@app.command()
def secret() -> None:
    """Print a fresh cluster secret for RLASYNC_CLUSTER_SECRET."""
    from .transport.auth import new_secret

    typer.echo(new_secret())


@app.command()
def version() -> None:
    """Print the rlasync version."""
    from . import __version__

    typer.echo(__version__)


@app.command()
def show(
    run_dir: str = typer.Argument(..., help="A run's folder (train.run_dir)."),
    step: int = typer.Option(None, "--step", help="The traced step to show (default: the last traced)."),
) -> None:
    """Print the rollout traces of a step: each traced trajectory's turns, tool calls and
    results, reward, and the weight versions of its tokens (train.trace_every)."""
    from .modes.traces import read_traces, render

    try:
        lines = read_traces(run_dir, step)
    except (FileNotFoundError, KeyError) as exc:
        typer.echo(f"rlasync show: {exc.args[0]}", err=True)
        raise typer.Exit(2) from None
    typer.echo(render(lines))


@app.command()
def plot(
    run_dirs: list[str] = typer.Argument(..., help="Run folders (train.run_dir) to draw side by side."),
    out: str = typer.Option(
        "", "--out", help="The PNG to write (default: plot.png in the first run's folder)."
    ),
) -> None:
    """One PNG of reward, held-out accuracy, staleness and throughput, against steps and wall
    time, of each run (needs matplotlib: pip install 'rlasync[plot]')."""
    from pathlib import Path

    from .metrics.plot import PlotUnavailable, plot_runs

    try:
        png = plot_runs(run_dirs, out or Path(run_dirs[0]) / "plot.png")
    except (PlotUnavailable, FileNotFoundError) as exc:
        typer.echo(f"rlasync plot: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(png))
