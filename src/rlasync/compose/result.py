"""How a run ends: ``TrainResult`` after its last step, ``RunInterrupted`` when it was asked to
stop at the end of a step."""

from __future__ import annotations

import msgspec


class TrainResult(msgspec.Struct, kw_only=True):
    initial_accuracy: float
    final_accuracy: float
    steps: int
    wall_s: float


class RunInterrupted(Exception):
    """The run stopped at the end of a step because it was asked to (``train(stop=...)``: Ctrl-C
    or SIGTERM under ``rlasync train``); ``checkpoint``: the one it saved then, if any."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        saved = f"; resume from its checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped on request after step {step}{saved}")
        self.step, self.checkpoint = step, checkpoint
