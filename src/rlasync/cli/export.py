"""``rlasync export``: a checkpoint as a folder other tools load (``rlasync.compose.export``)."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import with_plugins
from .errors import Failure, exits

WHO = "rlasync export"


def export(
    config: str = typer.Argument(
        ..., help="The run's YAML config: its run_dir and the model it started from."
    ),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, as for `rlasync train`."),
    checkpoint: str = typer.Option(
        "newest",
        "--checkpoint",
        help="A checkpoint folder (runs/<run>/checkpoints/step_N), or `newest` in train.run_dir.",
    ),
    out: Path = typer.Option(..., "--out", help="The folder to write (it must not exist)."),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="A LoRA checkpoint: the base model with the adapter merged in, one Hugging Face folder.",
    ),
    plugin: list[str] = typer.Option(None, "--plugin", help="A module or .py file to import first."),
) -> None:
    """Write a checkpoint of CONFIG's run as a folder other tools load.

    A LoRA run's checkpoint (`trainer.lora`) exports as its adapter in PEFT's format, pointing at the model the run
    started from (`PeftModel.from_pretrained`, vLLM's `--lora-modules`), or with `--merge` as one Hugging Face folder
    (the adapter merged into the base by peft). A full fine-tuning checkpoint exports as its model folder."""
    from ..compose.export import export_checkpoint
    from ..config import ConfigError, load_config

    with exits(WHO, Failure((ConfigError,), 2)):
        cfg = with_plugins(load_config(config, overrides or []), plugin or [])
        written = export_checkpoint(cfg, checkpoint, out, merge=merge)
    typer.echo(f"{'merged model' if merge else 'exported'}: {written}")
