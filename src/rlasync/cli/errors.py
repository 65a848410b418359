"""How a command's failures end it: each exception type mapped to an exit code and the one line
that says why on stderr, declared as a table of ``Failure`` rows (``RUN``'s for a training run,
a command's own rows where it catches something) and applied by ``report`` or ``exits``.

The exit codes: 0 done, 1 a run (or a service) stopped, 2 it could not start (a config, a
checkpoint, a plugin, a usage mistake), 130 interrupted (Ctrl-C, SIGTERM)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import typer


class Failure(NamedTuple):
    """A row: an exception of one of ``types`` ends the command with ``code``, after ``says``
    formatted with ``exc``, ``kind`` (its type's name) and what the command gives (``run_dir``)."""

    types: tuple[type[BaseException], ...]
    code: int
    says: str = "{exc}"


def said(who: str, message: object, code: int) -> int:
    """``code``, after the line ``who: message`` on stderr."""
    typer.echo(f"{who}: {message}", err=True)
    return code


def report(who: str, exc: BaseException, failures: Iterable[Failure], **context: object) -> int | None:
    """The code of the first row ``exc`` is one of, its line said; None where no row has it
    (the caller re-raises it: a bug keeps its traceback)."""
    for failure in failures:
        if isinstance(exc, failure.types):
            return said(who, failure.says.format(exc=exc, kind=type(exc).__name__, **context), failure.code)
    return None


@contextmanager
def exits(who: str, *failures: Failure) -> Iterator[None]:
    """A command's block whose failures of ``failures`` end the command (``typer.Exit``)."""
    try:
        yield
    except BaseException as exc:  # KeyboardInterrupt has rows too; one without a row goes on
        code = report(who, exc, failures)
        if code is None:
            raise
        raise typer.Exit(code) from None


def run_failures() -> tuple[Failure, ...]:
    """A training run's table (``rlasync train``, a launched head), rows tried in order. Its
    types live with torch: imported once the run is set up, never by ``--help``."""
    import asyncio

    from ..agents import NoWorkerError
    from ..config import ConfigError
    from ..data import DatasetError
    from ..engines import EngineError
    from ..modes import RunInterrupted
    from ..rewards import RewardError
    from ..runtime import RuntimeErrorBase
    from ..trainer.checkpoint import CheckpointError
    from ..weights import SyncError

    metrics = "metrics so far in {run_dir}/metrics.jsonl"
    return (
        Failure((CheckpointError, ConfigError, DatasetError), 2),
        # a lost node, a dead rank, no engine left, a broken reward
        Failure(
            (RuntimeErrorBase, EngineError, SyncError, NoWorkerError, RewardError),
            1,
            "the run stopped: {kind}: {exc}",
        ),
        # it stopped at a step's end (train.checkpoint_on_interrupt)
        Failure((RunInterrupted,), INTERRUPTED, "interrupted; {exc}; " + metrics),
        # the run's tasks were cancelled and its parts closed on the way out
        Failure((KeyboardInterrupt, asyncio.CancelledError), INTERRUPTED, "interrupted; " + metrics),
    )


INTERRUPTED = 130
"""The exit code of a command Ctrl-C or SIGTERM stopped (128 + SIGINT, as a shell's)."""
