"""The commands that look at a run rather than run one: ``status`` (a live cluster), ``show``
(a step's rollout traces), ``plot`` (runs' metrics as a PNG); and the two small ones, ``secret``
and ``version``."""

from __future__ import annotations

import os

import typer

from .errors import Failure, exits, said


def status(
    head: str | None = typer.Option(None, "--head", help="The head's address, e.g. tcp://10.0.0.1:29600."),
    config: str | None = typer.Option(None, "--config", help="Or the run's config: its cluster.listen."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the head and each engine."),
) -> None:
    """The live nodes of a running cluster: roles, the weight version each engine serves,
    heartbeat age. Needs the cluster secret (RLASYNC_CLUSTER_SECRET)."""
    import uvloop

    from ..config import ConfigError, load_config
    from ..launcher.status import StatusError, cluster_status, render
    from ..runtime.types import SECRET_ENV

    who = "rlasync status"
    if head is None and config is not None:
        with exits(who, Failure((ConfigError,), 2)):
            head = load_config(config, []).cluster.listen or None
    if not head:
        raise typer.Exit(said(who, "give --head tcp://HOST:PORT (or --config with cluster.listen)", 2))
    secret = os.environ.get(SECRET_ENV)
    if head.startswith("tcp://") and not secret:
        raise typer.Exit(said(who, f"export {SECRET_ENV} (the cluster's secret) to ask its head", 2))
    with exits(who, Failure((StatusError,), 1)):
        nodes = uvloop.run(cluster_status(head, secret, timeout=timeout))
    render(nodes)


def secret() -> None:
    """Print a fresh cluster secret for RLASYNC_CLUSTER_SECRET."""
    from ..transport.auth import new_secret

    typer.echo(new_secret())


def version() -> None:
    """Print the rlasync version."""
    from .. import __version__

    typer.echo(__version__)


def show(
    run_dir: str = typer.Argument(..., help="A run's folder (train.run_dir)."),
    step: int = typer.Option(None, "--step", help="The traced step to show (default: the last traced)."),
) -> None:
    """Print the rollout traces of a step: each traced trajectory's turns, tool calls and
    results, reward, and the weight versions of its tokens (train.trace_every)."""
    from ..compose.traces import read_traces, render

    with exits("rlasync show", Failure((FileNotFoundError, KeyError), 2, "{exc.args[0]}")):
        lines = read_traces(run_dir, step)
    typer.echo(render(lines))


def plot(
    run_dirs: list[str] = typer.Argument(..., help="Run folders (train.run_dir) to draw side by side."),
    out: str = typer.Option(
        "", "--out", help="The PNG to write (default: plot.png in the first run's folder)."
    ),
) -> None:
    """One PNG of reward, held-out accuracy, staleness and throughput, against steps and wall
    time, of each run (needs matplotlib: pip install 'rlasync[plot]')."""
    from pathlib import Path

    from ..metrics.plot import PlotUnavailable, plot_runs

    with exits("rlasync plot", Failure((PlotUnavailable, FileNotFoundError), 2)):
        png = plot_runs(run_dirs, out or Path(run_dirs[0]) / "plot.png")
    typer.echo(str(png))
