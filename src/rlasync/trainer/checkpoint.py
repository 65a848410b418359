"""Checkpoints of a run: ``<run_dir>/checkpoints/step_000100/``.

A checkpoint folder holds

- ``model/``: a complete Hugging Face folder (config, ``model.safetensors``, tokenizer), so an
  engine or ``transformers`` can load it as it is;
- ``optimizer.pt``: AdamW and learning-rate scheduler state, the trainer's step count;
- ``rng_rank<r>.pt``: each trainer rank's torch/Python RNG state;
- ``state.json``: the controller's own state (mode, step, weight version, data position, RNG,
  the accuracy so far), and the schedule's own files (one_step_off: ``in_flight.msgpack``, the
  batch that was in flight);
- ``manifest.json``, written last: every other file's size and SHA-256.

It is written to ``step_N.partial``, every file and the folder fsynced, then renamed into place
(and the parent fsynced): a crash mid-save never leaves a checkpoint that looks whole, and one
renamed survives a power cut. Resuming takes the newest checkpoint whose files match their
manifest; a torn or corrupt one (a file missing, cut short or changed) is skipped with a
warning naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import shutil
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .actor import TrainerActor
from .background import in_background

log = logging.getLogger(__name__)

STATE = "state.json"
MANIFEST = "manifest.json"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json"}
WEIGHT_SUFFIXES = {
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
}  # the source's weights (shards too): never copied


@dataclass(frozen=True)
class _Save:
    """One save in progress: written to ``partial``, renamed to ``final`` once sealed."""

    partial: Path
    final: Path
    step: int
    state: dict[str, Any]  # the controller's, ``step`` included: state.json
    source: Path  # the folder the model was loaded from: its tokenizer files are copied


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, incomplete, or for another run)."""


class Checkpoints:
    def __init__(self, run_dir: str | Path, *, keep: int = 2) -> None:
        self.folder = Path(run_dir) / "checkpoints"
        self.keep = keep
        self._sealing: asyncio.Future[Path] | None = None  # a save finishing in the background

    async def save(
        self,
        step: int,
        trainer: TrainerActor,
        state: dict[str, Any],
        *,
        model_source: str | Path,
        files: dict[str, bytes | Awaitable[bytes]] | None = None,
        background: bool = False,
    ) -> Path:
        """Save the trainer and ``state`` as checkpoint ``step``; ``model_source`` (the folder
        the model was loaded from) provides the tokenizer files; ``files``: more of the
        schedule's own (name -> contents, or an awaitable of them: a snapshot finishing in the
        background), sealed with the rest. ``background``: return once the
        trainer's state is taken; the files are written and sealed while training goes on
        (``wait`` for it; the next save does). Its folder (whole once sealed)."""
        await self.wait()
        final = self.folder / f"step_{step:06d}"
        partial = final.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        await trainer.save(partial, background=True)  # the ranks took their state: training may go on
        save = _Save(partial, final, step, {**state, "step": step}, Path(model_source))
        self._sealing = asyncio.ensure_future(self._finish(trainer, save, dict(files or {})))
        if not background:
            await self.wait()
        return final

    async def wait(self) -> None:
        """Until the save in progress is sealed (its error, if it failed)."""
        sealing, self._sealing = self._sealing, None
        if sealing is not None:
            await sealing

    async def _finish(self, trainer: TrainerActor, save: _Save, files: dict[str, Any]) -> Path:
        contents = {name: await data if inspect.isawaitable(data) else data for name, data in files.items()}
        await trainer.saved()
        # Writing, checksums and fsyncs read and flush every byte: in a thread, the loop serves meanwhile.
        await in_background(self._write_and_seal, save, contents)
        return save.final

    def _write_and_seal(self, save: _Save, files: dict[str, bytes]) -> None:
        partial = save.partial
        for item in save.source.iterdir():  # the tokenizer: the model folder is then complete
            if item.is_file() and item.name not in MODEL_FILES and item.suffix not in WEIGHT_SUFFIXES:
                shutil.copy2(item, partial / "model" / item.name)
        for name, data in files.items():
            (partial / name).write_bytes(data)
        (partial / STATE).write_text(json.dumps(save.state))
        self._seal(partial, save.final, save.step)

    def _seal(self, partial: Path, final: Path, step: int) -> None:
        """The manifest, every file and folder on disk, then the rename into place."""
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        manifest = {
            str(p.relative_to(partial)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files
        }
        (partial / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
        for path in [*files, partial / MANIFEST]:
            _fsync(path)
        for folder in {p.parent for p in files} | {partial}:
            _fsync(folder)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _fsync(self.folder)  # the rename itself, on disk
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Checkpoints whose save finished (a manifest, or a ``state.json`` from before manifests),
        oldest first; ``latest`` also checks their files."""
        if not self.folder.is_dir():
            return []
        return sorted(
            p
            for p in self.folder.glob("step_*")
            if p.suffix != ".partial" and ((p / MANIFEST).is_file() or (p / STATE).is_file())
        )

    def latest(self) -> Path:
        """The newest checkpoint whose files match its manifest; torn or corrupt ones are skipped,
        each with a warning naming it."""
        found = self.complete()
        for folder in reversed(found):
            problem = verify(folder)
            if not problem:
                return folder
            log.warning(
                "checkpoint %s is torn or corrupt (%s): skipped, resuming from an older one if any",
                folder,
                problem,
            )
        if found:
            raise CheckpointError(
                f"every checkpoint in {self.folder} is torn or corrupt (see the warnings): nothing to resume from"
            )
        raise CheckpointError(
            f"no complete checkpoint in {self.folder}: nothing to resume (set train.checkpoint_every, or drop --resume)"
        )


def verify(folder: str | Path) -> str:
    """What is wrong with checkpoint ``folder`` against its manifest ("" if nothing): a file
    missing, of another size or other contents. A folder from before manifests passes if it
    has its ``state.json``."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return "" if (folder / STATE).is_file() else f"no {MANIFEST}"
    try:
        files: dict[str, dict[str, Any]] = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    for name, expected in files.items():
        item = folder / name
        if not item.is_file():
            return f"{name} is missing"
        if item.stat().st_size != expected["size"]:
            return f"{name} has {item.stat().st_size} bytes, the manifest says {expected['size']}"
        if _sha256(item) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return ""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / STATE
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {STATE})")
    state: dict[str, Any] = json.loads(path.read_text())
    return state
