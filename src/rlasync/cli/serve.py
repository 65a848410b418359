"""``rlasync serve``: an OpenAI-compatible endpoint in front of one engine, for a model folder or
the model a config's run starts from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from .errors import INTERRUPTED, Failure, exits

if TYPE_CHECKING:
    from pathlib import Path

WHO = "rlasync serve"


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

    from ..config import ConfigError, EndpointConfig
    from ..config.engine import engine_settings
    from ..engines import EngineError, build_engine
    from ..models.tiny import load_tokenizer
    from ..serving import Endpoint, EndpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopped = "stopped"
    # Ctrl-C here stops a warm-start (130); once serving, it is how the endpoint ends (0).
    with exits(WHO, Failure((ConfigError,), 2), Failure((KeyboardInterrupt,), INTERRUPTED, stopped)):
        model_dir = str(_model_to_serve(model, overrides or []))
    with exits(WHO, Failure((ConfigError, ValueError, TypeError), 2)):
        endpoint_config = EndpointConfig(
            host=host,
            port=port,
            served_model_name=served_model_name or Path(model_dir).resolve().name,
            api_key=api_key,
        )
        engine_config = engine_settings(
            {"backend": backend, "model": model_dir, "max_batch": max_batch, "cpu_threads": threads}
        )

    async def main() -> None:
        engine = await build_engine(engine_config)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
            async with Endpoint(engine, tokenizer, endpoint_config, tool_parser=tool_parser) as endpoint:
                typer.echo(f"serving {endpoint.model_name!r} at {endpoint.url}/v1 (Ctrl-C stops)", err=True)
                await asyncio.Event().wait()  # until Ctrl-C cancels it
        finally:
            await engine.close()

    with exits(
        WHO, Failure((EndpointError, EngineError, ConfigError), 1), Failure((KeyboardInterrupt,), 0, stopped)
    ):
        uvloop.run(main())


def _model_to_serve(model: str, overrides: list[str]) -> Path:
    """The folder ``rlasync serve MODEL`` serves: ``model`` itself, or the model the config
    ``model`` names starts its run from (a warm-start not cached yet is made now, in this
    thread: Ctrl-C stops it at once). A ``ConfigError`` names what to pass instead."""
    from pathlib import Path

    from ..config import ConfigError, load_config

    path = Path(model)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        from ..compose.model_dir import starting_model_dir  # torch and the warm-start: only for a config

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
