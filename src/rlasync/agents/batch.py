"""Trajectories to padded tensors, ready for the trainer (verl's ``DataProto`` layout).

Prompts are left-padded to the longest prompt, responses right-padded to the longest
response, so ``input_ids = prompts ++ responses`` has every sequence's prompt ending at the
same column. ``position_ids`` count real tokens only, as the engines' did when sampling
(the logprobs a trainer recomputes must use the same positions; feasibility note gotcha 5).
"""

from __future__ import annotations

from typing import Any, Sequence

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
    batch = len(trajectories)
    prompt_len = max(len(t.prompt_ids) for t in trajectories)
    response_len = max(1, max(len(t.response_ids) for t in trajectories))
    prompts = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)
    responses = torch.full((batch, response_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(batch, response_len, dtype=torch.long)
    attention = torch.zeros(batch, prompt_len + response_len, dtype=torch.long)
    logprobs = torch.zeros(batch, response_len)
    versions = torch.full((batch, response_len), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        prompts[i, prompt_len - p :] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention[i, prompt_len - p : prompt_len + r] = 1
        if r:
            responses[i, :r] = torch.tensor(t.response_ids, dtype=torch.long)
            response_mask[i, :r] = torch.tensor(t.response_mask, dtype=torch.long)
            logprobs[i, :r] = torch.tensor(t.logprobs)
            versions[i, :r] = torch.tensor(t.versions, dtype=torch.long)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(
        prompts=prompts, responses=responses, response_mask=response_mask, attention_mask=attention,
        position_ids=position_ids, logprobs=logprobs, versions=versions,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
        trajectories=list(trajectories),
    )  # fmt: skip
