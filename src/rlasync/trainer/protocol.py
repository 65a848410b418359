"""The trainer as a schedule drives it: one optimiser step on a batch, and logprobs under the
current parameters (for the off-policy corrections).

``TrainerActor`` (N data-parallel ranks driven as one) is the trainer; the simulator's
``SimTrainer`` stands in for it with modelled durations. Checkpoints and resuming need the
``TrainerActor`` itself (its ranks write and read the files).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from .types import TrainBatch


class Trainer(Protocol):
    async def step(self, batch: TrainBatch, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimiser step on ``batch``; its metrics (``tokens``, ``loss``, ``grad_norm``,
        ``lr``, ...), reduced over the ranks."""
        ...

    async def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, reference: bool = False
    ) -> torch.Tensor:
        """``[B, R]`` logprobs of ``batch``'s responses under the current parameters, or under the
        frozen reference policy (``reference``)."""
        ...
