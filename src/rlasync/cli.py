"""The ``rlasync`` command line. Heavy imports happen inside commands, so ``--help`` is instant."""

from __future__ import annotations

import os
from typing import Optional

import typer

app = typer.Typer(help="rlasync: asynchronous RL post-training without Ray.", no_args_is_help=True, add_completion=False)


@app.command()
def node(
    rank: int = typer.Option(..., help="This node's rank; 0 is the head."),
    listen: str = typer.Option("tcp://0.0.0.0:29600", help="Address to listen on: tcp://host:port or ipc:///path."),
    head: Optional[str] = typer.Option(None, help="The head's address, e.g. tcp://10.0.0.1:29600 (omit on rank 0)."),
    config: Optional[str] = typer.Option(None, help="YAML experiment config; its runtime section is used."),
    override: list[str] = typer.Option([], "--set", help="Dotted override, e.g. --set runtime.node_dead_after_s=5."),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Run one node process until it is shut down or loses the head. The cluster secret comes from
    RLASYNC_CLUSTER_SECRET. It loads the engines and agent loops before joining; the head places
    roles on it (the cluster section of the run's config)."""
    import logging

    import uvloop

    from .config import ConfigError, load_config
    from .runtime.errors import RuntimeErrorBase
    from .runtime.types import SECRET_ENV
    from .runtime.worker import serve

    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s node-{rank} %(name)s %(levelname)s %(message)s")
    import msgspec

    try:
        cfg = load_config(config, override)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    # A node of a training run hosts engines and agent loops: torch and the engines load before it
    # joins, while no heartbeat waits on it (loaded later, they hold the GIL for seconds).
    from .config.cluster import NODE_MODULES

    runtime = msgspec.structs.replace(cfg.runtime, preload_modules=tuple(dict.fromkeys((*NODE_MODULES, *cfg.runtime.preload_modules))))
    secret = os.environ.get(SECRET_ENV)
    if listen.startswith("tcp://") and not secret:
        raise typer.BadParameter(f"TCP nodes authenticate with a shared secret: export {SECRET_ENV} (make one with `rlasync secret`)")
    try:
        raise typer.Exit(uvloop.run(serve(rank, listen, head, runtime, secret)))
    except RuntimeErrorBase as exc:
        typer.echo(f"node-{rank}: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def train(
    config: str = typer.Argument(..., help="YAML experiment config, e.g. configs/quickstart.yaml."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides: trainer.lr=3e-4 train.steps=100 ..."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in train.run_dir."),
) -> None:
    """Train with the schedule ``train.mode`` names (sync, one_step_off, fully_async); ends
    with one JSON line of the result."""
    import json
    import logging

    import msgspec
    import uvloop

    from .config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"rlasync train: {exc}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import signal

    # Ctrl-C (SIGINT) stops a run cleanly, also when the shell that started it ignores SIGINT
    # (a background job without job control inherits "ignore"; then uvloop.run would not
    # install its handler, and `kill -INT` would do nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM (a scheduler, `kill`) stops it the same way: the nodes are told, not left to find out.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    from .modes import train

    import time

    steps = cfg.train.steps
    clock: dict[str, float] = {}  # when and at which step this process's first RL step began

    def progress(record: dict[str, object]) -> None:
        step, now = int(record["step"]), time.perf_counter()  # type: ignore[call-overload]
        took = float(record["rollout_s"]) + float(record["train_s"])  # type: ignore[arg-type]
        clock.setdefault("since", now - took)
        clock.setdefault("first", step - 1)
        if step % 10 and "val_accuracy" not in record:
            return
        eta = (now - clock["since"]) / (step - clock["first"]) * (steps - step)
        tokens = float(record["response_tokens"]) / took  # type: ignore[arg-type]
        val = f"  val accuracy {record['val_accuracy']:.3f}" if "val_accuracy" in record else ""
        typer.echo(f"step {step:4d}/{steps}  reward {record['reward']:.3f}  {tokens:7.0f} tokens/s  ETA {eta:4.0f} s{val}")

    from .agents import NoWorkerError
    from .data import DatasetError
    from .engines import EngineError
    from .runtime import RuntimeErrorBase
    from .trainer.checkpoint import CheckpointError
    from .weights import SyncError

    try:
        result = uvloop.run(train(cfg, resume=resume, on_step=progress))
    except (CheckpointError, ConfigError, DatasetError) as exc:
        typer.echo(f"rlasync train: {exc}", err=True)
        raise typer.Exit(2) from None
    except (RuntimeErrorBase, EngineError, SyncError, NoWorkerError) as exc:  # a lost node, a dead rank, no engine left
        typer.echo(f"rlasync train: the run stopped: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # the run's tasks were cancelled and its parts closed on the way out
        typer.echo(f"rlasync train: interrupted; metrics so far in {cfg.train.run_dir}/metrics.jsonl", err=True)
        raise typer.Exit(130) from None
    typer.echo(f"validation accuracy (greedy, held-out): {result.initial_accuracy:.3f} after the warm-start -> {result.final_accuracy:.3f} after RL")
    typer.echo(json.dumps(msgspec.to_builtins(result)))


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
