"""Settings of the weight sync from the trainer to the engines (``weights.*``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class WeightsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How new parameters reach the engines after each step (``weights.*``)."""

    bucket_mb: Annotated[float, msgspec.Meta(gt=0)] = 64.0
    """Small tensors are packed into buckets of this size; one collective moves each bucket."""
    alone_mb: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Tensors at least this big travel alone, straight from their memory (no packing copy);
    0: those of a whole bucket or more. Fewer, bigger collectives won on CPU/gloo (measured);
    with NCCL, where a collective costs little, 1-4 MB may be faster."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The weight group's backend: ``auto`` is NCCL when trainer and engines are on GPUs, else gloo."""
    host: str = "127.0.0.1"
    """Address of the trainer's rank 0, where the weight group meets (its rendezvous store)."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    """Deadline of every collective of a sync: a peer that died fails it at once, one that
    stalls fails it when this passes. Raise it if a sync of your model is just slow."""
    retries: Annotated[int, msgspec.Meta(ge=0)] = 1
    """After a failed sync, make a new group (a new generation) and sync again this many times
    before stopping the run; engines keep serving the last complete version meanwhile."""
