"""``rlasync eval``: pass@1, pass@k, avg@k and maj@k of a checkpoint (or the model a config's run
starts from) on its held-out rows, with the engines and placement the config trains with
(``rlasync.compose.evaluate``)."""

from __future__ import annotations

import typer

from .common import with_plugins
from .errors import INTERRUPTED, Failure, exits

WHO = "rlasync eval"


def evaluate(
    config: str = typer.Argument(..., help="The run's YAML config: its rows, engines and placement."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, as for `rlasync train`."),
    checkpoint: str = typer.Option(
        "",
        "--checkpoint",
        help="A checkpoint folder (runs/<run>/checkpoints/step_N), or `newest` in train.run_dir; "
        "default: the model the run starts from.",
    ),
    samples: int = typer.Option(
        4, "--samples", "-k", help="Answers sampled per held-out row (the k of pass@k)."
    ),
    temperature: float = typer.Option(-1.0, help="Sampling temperature (default: train.temperature)."),
    correct: float = typer.Option(1.0, help="A reward at least this counts as a right answer."),
    plugin: list[str] = typer.Option(None, "--plugin", help="A module or .py file to import first."),
) -> None:
    """pass@1, pass@k, avg@k and maj@k of a model on CONFIG's held-out rows, as a table and a JSON line.

    Each held-out row (`data.val_files`, `data.source`'s held-out split, or the synthetic task's; `train.val_size` of
    them) is answered `--samples` times on the engines and placement CONFIG trains with, and scored by the run's reward.
    pass@j is the unbiased estimate from those samples, avg@k the mean reward, maj@k the rightness of each row's most
    frequent answer. The parts open in `train.run_dir`/eval and close again."""
    import json
    import logging

    import msgspec
    import uvloop

    from ..compose.evaluate import evaluate as run_eval
    from ..config import ConfigError, load_config
    from .train import set_up

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with exits(WHO, Failure((ConfigError,), 2)):
        cfg = with_plugins(load_config(config, overrides or []), plugin or [])
    code = set_up(cfg, watch_stdin=False)
    if code is not None:
        raise typer.Exit(code)
    from ..trainer.checkpoint import CheckpointError

    with exits(
        WHO,
        Failure((ConfigError, CheckpointError), 2),
        Failure((KeyboardInterrupt,), INTERRUPTED, "interrupted"),
    ):
        result = uvloop.run(
            run_eval(
                cfg,
                checkpoint=checkpoint,
                samples=samples,
                temperature=None if temperature < 0 else temperature,
                correct=correct,
            )
        )
    typer.echo(
        f"{result.model}: {result.rows} held-out rows x {result.samples} samples at temperature {result.temperature:g}"
    )
    for name, value in result.scores.items():
        typer.echo(f"  {name:<8} {value:.3f}")
    typer.echo(json.dumps(msgspec.to_builtins(result)))
