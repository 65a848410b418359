"""A run's checkpoints: when one is due, saving it (the trainer's state taken now, its files
written and sealed in the background), and the one a resume starts from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..config import Config

if TYPE_CHECKING:  # torch, with the trainer
    from ..trainer import TrainerActor

log = logging.getLogger(__name__)


Resume = bool | Literal["auto"]
"""Whether a run continues from the newest checkpoint in ``train.run_dir``: True (there must be
one), False (start afresh), or ``"auto"``: when there is one, else start afresh (a requeued or
restarted job's same command continues it)."""


def resuming(config: Config, resume: Resume) -> bool:
    """Whether the run continues from a checkpoint (``resume``, ``"auto"`` looked up now)."""
    if resume != "auto":
        return bool(resume)
    from ..trainer.checkpoint import Checkpoints

    found = Checkpoints(config.train.run_dir, keep=config.train.keep_checkpoints).complete()
    if not found:
        log.info("--resume=auto: no checkpoint in %s/checkpoints yet: starting afresh", config.train.run_dir)
    return bool(found)  # torn ones among them: the resume names them, or an older sound one is taken


def checkpoint_to_resume(config: Config) -> tuple[Path, dict[str, Any]]:
    """The newest sound checkpoint in ``train.run_dir`` and its state; it must be this mode's
    (another mode's work in flight would be silently dropped)."""
    from ..trainer.checkpoint import CheckpointError, Checkpoints, read_state

    folder = Checkpoints(config.train.run_dir, keep=config.train.keep_checkpoints).latest()
    state = read_state(folder)
    if state.get("mode", "sync") != config.train.mode:
        raise CheckpointError(
            f"{folder} was written by train.mode={state.get('mode', 'sync')}: resume it with that mode"
        )
    return folder, state


def checkpoint_due(config: Config, step: int, *, stopping: bool = False) -> bool:
    """Whether step ``step`` ends with a checkpoint: every ``train.checkpoint_every`` steps,
    after the last (every mode ends with its model on disk), and when ``stopping`` (the run was
    asked to stop at a step's end: an interrupt under ``train.checkpoint_on_interrupt``, SIGUSR1,
    a node's signal, or a script's ``stop``)."""
    cfg = config.train
    return bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or stopping


class Saver:
    """Saves a run's checkpoints into ``train.run_dir`` (``Checkpoints``, opened at the first
    save; ``closers``: where the run registers what it closes, the last save's seal among them)."""

    def __init__(self, config: Config, closers: list[Callable[[], Any]]) -> None:
        self.config, self._closers = config, closers
        self.checkpoints: Any = None  # the run's Checkpoints, from the first save

    async def save(
        self,
        step: int,
        trainer: TrainerActor,
        state: dict[str, Any],
        *,
        model_source: Path,
        files: dict[str, Any] | None = None,
    ) -> str:
        """Checkpoint ``step``: ``trainer``'s state, ``state`` (``state.json``), the model's
        files from ``model_source``, and ``files`` (name -> bytes, or an awaitable of them); its
        folder."""
        from ..trainer.checkpoint import Checkpoints

        cfg = self.config.train
        if self.checkpoints is None:
            self.checkpoints = Checkpoints(cfg.run_dir, keep=cfg.keep_checkpoints)
            self._closers.append(
                self.checkpoints.wait
            )  # closed first: the last save is sealed before the ranks stop
        # The trainer's state is taken now; its files are written and sealed while the next steps
        # run, on any core. A crash before the seal leaves a `.partial` folder that
        # resuming skips.
        folder = await self.checkpoints.save(
            step, trainer, state, model_source=model_source, files=files, background=True
        )
        return str(folder)
