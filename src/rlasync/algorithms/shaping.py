"""Reward shaping applied before advantages (the trained reward; the reported one stays raw)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, limit: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 for a response of at most ``limit - buffer`` tokens,
    then falling linearly to ``-penalty`` at ``limit``: ``min(0, -(L - (limit - buffer)) / buffer
    * penalty)`` per response length ``L`` (float, shaped like ``lengths``).

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20]), limit=20, buffer=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000])
    """
    if not 0 < buffer <= limit:
        raise ValueError(f"need 0 < buffer <= limit, got buffer={buffer}, limit={limit}")
    exceed = lengths.to(torch.float32) - (limit - buffer)
    return torch.clamp(-exceed / buffer * penalty, max=0.0)
