"""Training schedules: ``sync`` (on-policy GRPO, the baseline), ``one_step_off`` and
``fully_async``; ``train`` runs the one ``train.mode`` names.

    result = await train(load_config("configs/quickstart_async.yaml"))
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import Config

if TYPE_CHECKING:
    from ..compose.checkpoints import Resume
    from ..compose.result import RunInterrupted, TrainResult
    from ..compose.warmstart import warm_start
    from .fully_async import train_fully_async
    from .one_step_off import train_one_step_off
    from .queue import QueueClosed, SampleQueue, StalenessError
    from .sync import train_sync

# Loaded when first named (PEP 562): importing ``rlasync.modes`` loads none of the schedules'
# torch and engines (``rlasync train`` loads them itself, before it forks).
_LAZY = {
    "train_fully_async": ".fully_async",
    "train_one_step_off": ".one_step_off",
    "TrainResult": "..compose.result",
    "RunInterrupted": "..compose.result",
    "QueueClosed": ".queue",
    "SampleQueue": ".queue",
    "StalenessError": ".queue",
    "train_sync": ".sync",
    "warm_start": "..compose.warmstart",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def train(
    config: Config,
    *,
    resume: Resume = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> TrainResult:
    """Run ``config``'s schedule (``train.mode``); ``resume`` continues from the newest checkpoint
    in ``train.run_dir`` (every mode; the asynchronous ones with their samples in flight;
    ``"auto"``: if there is one, else the run starts afresh). ``on_step(record)`` gets each training step's line of ``metrics.jsonl``
    as it is written (``step``, ``reward``, ``val_accuracy`` when validated, ``train/*``, ...).
    ``stop``: set it to end the run at the end of the step in progress, with a checkpoint;
    ``train`` then raises ``RunInterrupted``.

        result = rlasync.run(train(load_config("configs/quickstart.yaml"), on_step=print))
    """
    from .fully_async import train_fully_async
    from .one_step_off import train_one_step_off
    from .sync import train_sync

    mode = config.train.mode
    if mode == "sync":
        return await train_sync(config, resume=resume, on_step=on_step, stop=stop)
    if mode == "one_step_off":
        return await train_one_step_off(config, resume=resume, on_step=on_step, stop=stop)
    return await train_fully_async(config, resume=resume, on_step=on_step, stop=stop)


__all__ = [
    "QueueClosed",
    "RunInterrupted",
    "SampleQueue",
    "StalenessError",
    "TrainResult",
    "train",
    "train_fully_async",
    "train_one_step_off",
    "train_sync",
    "warm_start",
]
