"""Checkpoints of a run: ``<run_dir>/checkpoints/step_000100/``.

A checkpoint folder holds

- ``model/``: a complete Hugging Face folder (config, ``model.safetensors``, tokenizer), so an
  engine or ``transformers`` can load it as it is;
- ``optimizer.pt``: AdamW and learning-rate scheduler state, the trainer's step count;
- ``rng_rank<r>.pt``: each trainer rank's torch/Python RNG state;
- ``state.json``: the controller's own state (step, weight version, data position, RNG, the
  accuracy so far), written last: a folder without it is incomplete and ignored.

It is written to ``step_N.partial`` and renamed when complete, so a crash mid-save never
leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .actor import TrainerActor

STATE = "state.json"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, incomplete, or for another run)."""


class Checkpoints:
    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.keep = keep

    async def save(self, step: int, trainer: TrainerActor, state: dict[str, Any], *, model_source: str | Path) -> Path:
        """Save the trainer and ``state`` as checkpoint ``step``; ``model_source`` (the folder
        the model was loaded from) provides the tokenizer files."""
        final = self.folder / f"step_{step:06d}"
        partial = final.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        await trainer.save(partial)
        for item in Path(model_source).iterdir():  # the tokenizer: the model folder is then complete
            if item.is_file() and item.name not in MODEL_FILES:
                shutil.copy2(item, partial / "model" / item.name)
        (partial / STATE).write_text(json.dumps({**state, "step": step}))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("step_*") if p.suffix != ".partial" and (p / STATE).is_file())

    def latest(self) -> Path:
        found = self.complete()
        if not found:
            raise CheckpointError(f"no complete checkpoint in {self.folder}: nothing to resume (set train.checkpoint_every, or drop --resume)")
        return found[-1]


def read_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / STATE
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {STATE})")
    state: dict[str, Any] = json.loads(path.read_text())
    return state
