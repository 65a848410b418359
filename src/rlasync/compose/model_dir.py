"""The model folder RL starts from: ``train.model_dir``, or the preset warm-started on the task."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from ..config import Config, ConfigError
from .warmstart import DEFAULT_SETTINGS, warm_start


def starting_model_dir(config: Config) -> Path:
    """The folder RL starts from: ``train.model_dir``, or the preset warm-started on the task
    (cached under ``train.run_dir``). Blocking: a warm-start not cached yet takes a minute or more
    of CPU (``model_dir_for`` runs it in a thread); ``rlasync serve CONFIG`` serves this folder."""
    cfg = config.train
    if cfg.model_dir:
        if not (Path(cfg.model_dir) / "config.json").is_file():
            raise ConfigError(
                f"train.model_dir={cfg.model_dir} is not a model folder (no config.json); leave it empty to warm-start train.preset"
            )
        return Path(cfg.model_dir)
    settings = msgspec.structs.replace(
        DEFAULT_SETTINGS[cfg.task],
        greedy_threshold=cfg.warmstart_greedy_threshold,
        threshold=cfg.warmstart_sampled_threshold,
    )
    return warm_start(cfg.task, run_dir=cfg.run_dir, preset=cfg.preset, seed=cfg.seed, settings=settings)


async def model_dir_for(config: Config) -> Path:
    """``starting_model_dir`` in a thread: the event loop goes on while a warm-start trains."""
    return await asyncio.to_thread(starting_model_dir, config)
