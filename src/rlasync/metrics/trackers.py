"""Experiment trackers (``train.trackers``): where a run's step records, its config and its final
summary go, behind one small interface.

- ``jsonl``: ``<run_dir>/metrics.jsonl``, one flat step record per line, with the config in
  ``config.json`` and the summary in ``summary.json``. Always on: it is the run's own record
  (``--resume`` trims it, ``rlasync plot`` reads it).
- ``tensorboard``: event files in ``<run_dir>/tensorboard`` (every numeric field a scalar under
  its own name; the config and the summary as text). ``pip install rlasync[tensorboard]``.
- ``wandb``: Weights & Biases, project ``train.wandb_project``, its files in ``<run_dir>/wandb``.
  ``WANDB_MODE=offline`` works without a network (``wandb sync`` uploads later).
  ``pip install rlasync[wandb]``.

Another one is a class with ``log``, ``finish`` and ``close``, registered by name:

    @register_tracker("mine")
    class Mine:
        def __init__(self, run_dir: Path, config: dict, *, project: str, resumed_at: int | None) -> None: ...
        def log(self, record: dict) -> None: ...  # one flat step record (``step`` in it)
        def finish(self, summary: dict) -> None: ...  # the run's result, once, at its end
        def close(self) -> None: ...  # always, also after a failure
"""

from __future__ import annotations

import json
import numbers
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..registry import Registry


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


TrackerFactory = Callable[..., Tracker]
_TRACKERS = Registry[TrackerFactory]("tracker")


def register_tracker(name: str) -> Callable[[TrackerFactory], TrackerFactory]:
    """Class decorator: make a tracker available as ``train.trackers: [<name>]``."""
    return _TRACKERS.decorator(name)


def tracker_names() -> list[str]:
    return _TRACKERS.names()


class TrackerUnavailable(RuntimeError):
    """A tracker whose package is not installed (the message says which extra to install)."""


def open_trackers(
    names: list[str], run_dir: Path, config: Mapping[str, Any], *, project: str, resumed_at: int | None
) -> list[Tracker]:
    """The trackers ``names`` (``jsonl`` aside: the run writes ``metrics.jsonl`` itself), each
    given the run's folder and its whole config. Unknown names raise ``KeyError``."""
    trackers: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            if name == "jsonl":
                continue
            if name not in _TRACKERS:  # here, not the registry's message: ``jsonl`` is known too
                raise KeyError(f"unknown tracker {name!r}; known: {', '.join(['jsonl', *tracker_names()])}")
            trackers.append(
                _TRACKERS.get(name)(run_dir, dict(config), project=project, resumed_at=resumed_at)
            )
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields of a flat record that are numbers (booleans and lists left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


@register_tracker("tensorboard")
class TensorBoardTracker:
    """TensorBoard event files in ``<run_dir>/tensorboard``."""

    def __init__(
        self, run_dir: Path, config: dict[str, Any], *, project: str, resumed_at: int | None
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", exc) from None
        # Resumed: what the earlier process logged past the checkpoint is dropped (purge_step), as
        # metrics.jsonl drops it, so the steps done again are not shown twice.
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if resumed_at is None:
            self.writer.add_text("config", _markdown_json(config), 0)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in numeric(record).items():
            if key != "step":
                self.writer.add_scalar(key, value, step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", _markdown_json(summary), int(summary.get("steps", 0)))
        for key, value in numeric(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, int(summary.get("steps", 0)))

    def close(self) -> None:
        self.writer.close()


@register_tracker("wandb")
class WandbTracker:
    """A Weights & Biases run named after ``run_dir``; ``WANDB_MODE=offline`` needs no network.
    Steps a resumed run does again (after its checkpoint) W&B keeps only once: it ignores a step
    lower than one it has."""

    def __init__(
        self, run_dir: Path, config: dict[str, Any], *, project: str, resumed_at: int | None
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from None
        # One W&B run per run folder: a resumed run goes on logging to it (its id is kept here).
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed_at is not None and id_file.is_file() else ""
        run_id = run_id or uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project,
            id=run_id,
            name=run_dir.resolve().name,
            dir=str(run_dir),
            config=config,
            resume="allow",
            reinit="create_new",
        )

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in numeric(record).items() if k != "step"}, step=int(record["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


def _missing(tracker: str, exc: ImportError) -> TrackerUnavailable:
    return TrackerUnavailable(
        f"train.trackers: {tracker} needs the {tracker} package ({exc}): pip install 'rlasync[{tracker}]'"
    )


def _markdown_json(value: Any) -> str:
    """JSON as a Markdown code block (TensorBoard renders text as Markdown)."""
    return "```\n" + json.dumps(value, indent=1, default=str) + "\n```"


__all__ = [
    "Tracker",
    "TrackerUnavailable",
    "numeric",
    "open_trackers",
    "register_tracker",
    "tracker_names",
]
