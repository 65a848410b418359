"""Padding-free micro-batches (``trainer.packing``): rows laid end to end in bins as wide as the
longest row, each attending only to itself, give the padded forward's logprobs and the padded
step's loss and gradients up to float32 rounding (``numerics``), alone and with activation
checkpointing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from numerics import forward_rtol, rounding_close, step_rtol

from rlasync.config import TrainerConfig
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.trainer import PolicyTrainer, TrainBatch
from rlasync.trainer.packing import pack


def long_tailed(size: int = 12, prompt: int = 6, response: int = 24, seed: int = 0) -> TrainBatch:
    """Left-padded prompts of 3 to 6 tokens; responses of 2 to 4 tokens, every fifth row 24 (the
    long tail), some positions not trained on (an environment's tokens: mask 0, attended)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 300, (size, prompt), generator=g)
    responses = torch.randint(3, 300, (size, response), generator=g)
    mask = torch.ones(size, response, dtype=torch.long)
    attention = torch.ones(size, prompt + response, dtype=torch.long)
    for row in range(size):
        pad, length = row % 4, response if row % 5 == 0 else 2 + row % 3
        prompts[row, :pad], attention[row, :pad] = 0, 0
        mask[row, length:], attention[row, prompt + length :], responses[row, length:] = 0, 0, 0
        mask[row, 1] = 0 if length > 2 else 1
    return TrainBatch(
        prompts=prompts,
        responses=responses,
        response_mask=mask,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        logprobs=-torch.rand(size, response, generator=g) * 4 * mask,
        advantages=torch.linspace(-1.0, 1.0, size),
    )


def test_rows_go_longest_first_into_bins_as_wide_as_the_longest_and_keep_their_own_positions() -> None:
    batch = long_tailed()
    packed = pack(batch)
    lengths = batch.attention_mask.sum(-1)
    assert packed.input_ids.shape == (packed.input_ids.shape[0], int(lengths.max()))
    assert packed.input_ids.shape[0] <= batch.size // 2  # 12 rows: the 3 long ones alone, 9 short in 3
    assert int(packed.input_ids.numel()) >= int(lengths.sum())
    # Every row's real tokens appear once, in order, with positions 0..len-1.
    found = 0
    for row in range(batch.size):
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        for b in range(packed.input_ids.shape[0]):
            ids, pos = packed.input_ids[b].tolist(), packed.position_ids[b].tolist()
            for start in (i for i, p in enumerate(pos) if p == 0):
                if ids[start : start + len(real)] == real and pos[start : start + len(real)] == list(
                    range(len(real))
                ):
                    found += 1
                    break
    assert found >= batch.size
    # Each response token is predicted from the token before it: the last prompt token, then its own.
    predicting = packed.input_ids[packed.bins, packed.keep[packed.kept]]
    before = torch.where(
        packed.cols == 0,
        batch.prompts[packed.rows, -1],
        batch.responses[packed.rows, (packed.cols - 1).clamp(min=0)],
    )
    assert torch.equal(predicting, before)
    assert len(packed.rows) == int(batch.attention_mask[:, batch.prompts.shape[1] :].sum())


def _pair(**packed: Any) -> tuple[PolicyTrainer, PolicyTrainer]:
    model, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=2))
    sgd = {"optimizer": "sgd", "lr": 1.0, "micro_batch_size": 5}
    return PolicyTrainer(model, TrainerConfig(**sgd)), PolicyTrainer(
        copy.deepcopy(model), TrainerConfig(**sgd, **packed)
    )


@pytest.mark.numerics
@pytest.mark.parametrize(
    "extra", [{}, {"gradient_checkpointing": True}], ids=["packed", "packed+checkpointed"]
)
def test_packed_and_padded_agree_to_rounding(extra: dict[str, Any]) -> None:
    """Only the order of sums differs (a bin's attention runs over other rows' keys, masked to
    exact zeros; other matrix shapes): the same logprobs to a forward's rounding over the bin's
    width, the same loss and gradients to a step's."""
    batch = long_tailed()
    padded, packed = _pair(packing=True, **extra)
    config = padded.model.config
    width = int(batch.attention_mask.sum(-1).max())
    mask = batch.response_mask.bool()
    a, b = padded.compute_logprobs(batch, temperature=0.8), packed.compute_logprobs(batch, temperature=0.8)
    assert rounding_close(b[mask], a[mask], forward_rtol(config, sequence=width))
    first, second = padded.step(batch, temperature=0.8), packed.step(batch, temperature=0.8)
    rtol = step_rtol(config, tokens=int(batch.attention_mask.sum()), sequence=width)
    assert first["loss"] == pytest.approx(second["loss"], rel=rtol, abs=rtol)
    grads = dict(padded.model.named_parameters())
    for name, p in packed.model.named_parameters():
        assert rounding_close(p.grad, grads[name].grad, rtol), name
