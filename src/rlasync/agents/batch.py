"""Trajectories to padded tensors, ready for the trainer (verl's ``DataProto`` layout).

Prompts are left-padded to the longest prompt, responses right-padded to the longest
response, so ``input_ids = prompts ++ responses`` has every sequence's prompt ending at the
same column. ``position_ids`` count real tokens only, as the engines' did when sampling
(the logprobs a trainer recomputes must use the same positions, or they differ from the
engine's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from .trajectory import Trajectory


class RolloutBatch(msgspec.Struct, kw_only=True):
    prompts: Any  # [B, P] long, left-padded
    responses: Any  # [B, R] long, right-padded
    response_mask: Any  # [B, R] long: 1 = a model token to train on
    attention_mask: Any  # [B, P + R] long: 1 = a real token
    position_ids: Any  # [B, P + R] long
    logprobs: Any  # [B, R] float: behaviour logprobs, 0 where the mask is 0
    versions: Any  # [B, R] long: weight version of each model token, -1 elsewhere
    rewards: Any  # [B] float
    num_turns: Any  # [B] long
    trajectories: list[Trajectory]

    @property
    def input_ids(self) -> Any:
        return torch.cat([self.prompts, self.responses], dim=1)


def collate(trajectories: Sequence[Trajectory], pad_token_id: int) -> RolloutBatch:
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    prompt_len = max(len(t.prompt_ids) for t in trajectories)
    response_len = max(1, max(len(t.response_ids) for t in trajectories))

    # Padded Python rows, then one tensor per field (a tensor per row and field was most of the cost).
    def right(field: str, fill: Any, dtype: torch.dtype) -> torch.Tensor:
        rows = [getattr(t, field) for t in trajectories]
        return torch.tensor([row + [fill] * (response_len - len(row)) for row in rows], dtype=dtype)

    prompts = torch.tensor(
        [[pad_token_id] * (prompt_len - len(t.prompt_ids)) + t.prompt_ids for t in trajectories],
        dtype=torch.long,
    )
    responses = right("response_ids", pad_token_id, torch.long)
    response_mask = right("response_mask", 0, torch.long)
    logprobs = right("logprobs", 0.0, torch.float32)
    versions = right("versions", -1, torch.long)
    attention = torch.tensor(
        [
            [0] * (prompt_len - len(t.prompt_ids))
            + [1] * (len(t.prompt_ids) + len(t.response_ids))
            + [0] * (response_len - len(t.response_ids))
            for t in trajectories
        ],
        dtype=torch.long,
    )
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(
        prompts=prompts,
        responses=responses,
        response_mask=response_mask,
        attention_mask=attention,
        position_ids=position_ids,
        logprobs=logprobs,
        versions=versions,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
        trajectories=list(trajectories),
    )
