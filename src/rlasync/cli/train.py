"""``rlasync train``, and ``run_train``, which runs a config to its end in this process (for it
and for the head ``rlasync launch`` starts): set up, run, its failures mapped to exit codes by
``errors.run_failures``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from .common import RESUME_HELP, parse_resume, with_plugins
from .errors import INTERRUPTED, Failure, exits, report, run_failures, said

if TYPE_CHECKING:
    from ..compose.checkpoints import Resume
    from ..config import Config
    from ..interrupts import Interrupts

WHO = "rlasync train"


def train(
    config: str = typer.Argument(..., help="YAML experiment config, e.g. configs/quickstart.yaml."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides: trainer.lr=3e-4 train.steps=100 ..."),
    resume: str = typer.Option("", "--resume", metavar="[=auto]", show_default=False, help=RESUME_HELP),
    plugin: list[str] = typer.Option(
        [],
        "--plugin",
        help="A module or .py file to import first (its loops, tools, rewards, samplers...); adds to `plugins`.",
    ),
) -> None:
    """Train with the schedule `train.mode` names (sync, one_step_off, fully_async); ends
    with one JSON line of the result."""
    from ..config import ConfigError, load_config
    from ..runtime.allocator import run_under_allocator

    wanted = parse_resume(resume, WHO)
    with exits(WHO, Failure((ConfigError,), 2)):
        cfg = with_plugins(load_config(config, overrides or []), plugin)
        run_under_allocator(cfg.runtime.allocator)  # before torch loads; the run's processes inherit it
    raise typer.Exit(run_train(cfg, resume=wanted))


def run_train(cfg: Config, *, resume: Resume = False, watch_stdin: bool = False) -> int:
    """Run ``cfg`` to its end in this process (the head); the exit code, after one JSON line of
    the result (0), a one-line reason (1: the run stopped, 2: it could not start) or an
    interruption (130). ``watch_stdin``: stop when stdin closes (a launched head)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from ..interrupts import Interrupts

    # Ctrl-C (SIGINT), SIGTERM (a scheduler, `kill`) or SIGUSR1 (a time limit ahead) stops the run
    # cleanly, within a deadline, its nodes' too (rlasync.interrupts); one during start-up stops
    # it before it starts anything.
    interrupts = Interrupts(cfg.train)
    interrupts.hold()
    code = set_up(cfg, watch_stdin=watch_stdin)
    if code is None and interrupts.count:
        code = said(WHO, "interrupted before the run started", INTERRUPTED)
    return _run(cfg, interrupts, resume=resume) if code is None else code


def set_up(cfg: Config, *, watch_stdin: bool) -> int | None:
    """Load the run's plugins and fork what this process will start; None, or the exit code of
    a run that cannot start."""
    from ..config.cluster import with_node_modules
    from ..modes import fully_async, one_step_off, sync, train  # noqa: F401  (the schedules, torch with them: loaded before the fork below)
    from ..plugins import PluginError, load_all
    from ..runtime.spawner import fork_children

    try:  # before the config's names are looked up: the plugins register them
        load_all(cfg.plugins)
    except PluginError as exc:
        return said(WHO, exc, 2)
    # The nodes and trainer ranks this process starts are forked, with what they host (and the
    # run's plugins) loaded.
    fork_children(with_node_modules(cfg.runtime, *cfg.plugins))
    if watch_stdin:
        from ..launcher.ticket import stop_when_stdin_closes

        stop_when_stdin_closes()
    return None


def _run(cfg: Config, interrupts: Interrupts, *, resume: Resume) -> int:
    """The set-up run, its progress shown; its exit code, a failure's from ``run_failures``."""
    import asyncio
    import json
    import logging

    import msgspec
    import uvloop

    from ..compose.warmstart import WARMSTART_PROGRESS
    from ..interrupts import exit_now
    from ..metrics.progress import RunProgress
    from ..modes import train as train_with_schedule

    failures = run_failures()
    progress = RunProgress(cfg.train.steps)  # live in a terminal, plain lines in a log
    logging.getLogger().handlers[:] = [progress.log_handler()]
    WARMSTART_PROGRESS.set(progress.warmstart)

    async def main() -> Any:
        interrupts.install(asyncio.current_task())  # type: ignore[arg-type]
        with progress:
            return await train_with_schedule(cfg, resume=resume, on_step=progress.step, stop=interrupts.stop)

    try:
        result = uvloop.run(main())
    except BaseException as exc:  # the table's rows, in order; any other goes on with its traceback
        code = report(WHO, exc, failures, run_dir=cfg.train.run_dir)
        if code is None:
            raise
        if code == INTERRUPTED:  # its parts are closed: leave without a thread the interrupt cut short
            exit_now(code)
        return code
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
