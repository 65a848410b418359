"""``rlasync plan``: which split of the GPUs and which asynchronous knobs to train a config with,
found on the simulator (``rlasync.modes.plan``)."""

from __future__ import annotations

import typer

from .errors import Failure, exits, said


def plan(
    config: str = typer.Argument(..., help="The run's YAML config (its task, batch and async_training.*)."),
    gpus: int = typer.Option(..., "--gpus", help="GPUs to split between generation and training."),
    profile: str = typer.Option(
        "generic-8b-h100",
        "--profile",
        help="The cluster's physics: a model shape, a GPU, answer lengths (rlasync.modes.profiles).",
    ),
    overrides: list[str] = typer.Argument(
        None, help="Config overrides, as for `rlasync train`: key=value ..."
    ),
    versions: int = typer.Option(
        8, help="Weight versions each simulated run lasts (a third left out as the pipeline fills)."
    ),
    workers: int = typer.Option(2, help="Simulated runs at once (processes)."),
) -> None:
    """The best split of --gpus GPUs and the best async knobs for CONFIG, found on the simulator.

    Simulates CONFIG's fully async schedule on --gpus GPUs of --profile over the split between
    generation and training, `staleness_threshold`, `trigger_parameter_sync_step` and
    `require_batches`; print every point run (samples and steps an hour, the fraction of the
    pooled ideal, token staleness p50/p99, GPU idle), the best marked, and the overrides
    that give it. About 40 s for a 32-GPU plan on two cores (each run on a virtual clock)."""
    from ..config import ConfigError, load_config
    from ..modes.plan import plan as search
    from ..modes.plan import render
    from ..modes.profiles import PROFILES

    who = "rlasync plan"
    with exits(who, Failure((ConfigError,), 2)):
        cfg = load_config(config, overrides or [])
    if profile not in PROFILES:
        raise typer.Exit(
            said(who, f"--profile {profile!r} is not known; choose one of: {', '.join(sorted(PROFILES))}", 2)
        )
    with exits(who, Failure((ValueError,), 2)):
        result = search(cfg, gpus=gpus, profile=PROFILES[profile], versions=versions, workers=workers)
    typer.echo(render(result, PROFILES[profile]))
