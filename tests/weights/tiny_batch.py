"""A small random training batch (4 rows) for the weight-sync tests: one step changes every weight."""

from __future__ import annotations

import torch

from rlasync.trainer import TrainBatch


def tiny_batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = (
        torch.randint(3, 300, (4, 5), generator=g),
        torch.randint(3, 300, (4, 6), generator=g),
    )
    ones = torch.ones(4, 11, dtype=torch.long)
    return TrainBatch(
        prompts=prompts,
        responses=responses,
        response_mask=torch.ones(4, 6, dtype=torch.long),
        attention_mask=ones,
        position_ids=torch.arange(11).expand(4, -1).clone(),
        logprobs=-torch.rand(4, 6, generator=g),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
    )
