"""How a batch is split over trainer ranks, and how their metrics are combined."""

from __future__ import annotations

import pytest

from rlasync.trainer import TrainBatch, shard_rows
from rlasync.trainer.types import balanced_shards, reduce_metrics


def test_shards_and_metric_reduction() -> None:
    assert shard_rows(7, 2) == [slice(0, 4), slice(4, 7)]
    assert shard_rows(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]
    parts = [
        (3.0, {"pg_clipfrac": 0.0, "ratio_min": 0.5, "ratio_max": 1.5}),
        (1.0, {"pg_clipfrac": 1.0, "ratio_min": 0.9, "ratio_max": 3.0}),
    ]
    assert reduce_metrics(parts) == {"pg_clipfrac": 0.25, "ratio_min": 0.5, "ratio_max": 3.0}
    assert reduce_metrics([(0.0, {"ratio_min": 1.0}), (2.0, {"ratio_min": 2.0})]) == {
        "ratio_min": 2.0
    }  # empty parts don't vote


def test_balanced_shards_hold_every_row_once_and_nearly_equal_tokens() -> None:
    import random

    rng = random.Random(0)
    for world in (2, 3, 8):
        for _ in range(50):
            tokens = [int(rng.lognormvariate(4, 1)) + 1 for _ in range(rng.randint(world, 300))]
            shards = balanced_shards(tokens, world)
            rows = [int(r) for shard in shards for r in shard]
            assert sorted(rows) == list(range(len(tokens)))  # each row on exactly one rank
            assert all(shard.tolist() == sorted(shard.tolist()) for shard in shards)  # in batch order
            loads = [sum(tokens[r] for r in shard.tolist()) for shard in shards]
            # Longest first, each to the lightest rank: the heaviest ends within one row of the share.
            assert max(loads) <= sum(tokens) / world + max(tokens)
            assert all(len(shard) > 0 for shard in shards)  # FSDP2 needs a row per rank
    # The long rows of a group side by side (a GRPO batch's order) no longer land on one rank.
    tokens = [100] * 4 + [10] * 4
    assert [s.tolist() for s in balanced_shards(tokens, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Equal rows: equal counts (the rank with fewer rows breaks the tie).
    assert [len(s) for s in balanced_shards([5] * 7, 3)] == [3, 2, 2]


def _ragged_batch() -> TrainBatch:
    """Nine rows of ragged prompts (2-6 tokens) and responses (1-20), left/right padded."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, prompt_w, resp_w = 9, 6, 20
    prompt_len = torch.randint(2, prompt_w + 1, (rows,), generator=g)
    resp_len = torch.tensor([3, 4, 20, 2, 5, 3, 1, 4, 6])
    attention = torch.zeros(rows, prompt_w + resp_w, dtype=torch.long)
    mask = torch.zeros(rows, resp_w, dtype=torch.long)
    for i in range(rows):
        attention[i, prompt_w - prompt_len[i] : prompt_w + resp_len[i]] = 1
        mask[i, : resp_len[i]] = 1
    return TrainBatch(
        prompts=torch.randint(3, 300, (rows, prompt_w), generator=g) * attention[:, :prompt_w],
        responses=torch.randint(3, 300, (rows, resp_w), generator=g) * mask,
        response_mask=mask,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        logprobs=-torch.rand(rows, resp_w, generator=g) * mask,
        advantages=torch.randn(rows, generator=g),
    )


@pytest.mark.numerics
def test_dynamic_micro_batches_take_the_same_step_as_the_whole_padded_batch() -> None:
    """Rows sorted by length, cut to their own width: the same logprobs and the same update as
    the whole batch padded to its longest row, for much less compute when one row is long."""
    from numerics import assert_same_sgd_step, rounding_close, step_rtol

    from rlasync.config import TrainerConfig
    from rlasync.models import TinyLMConfig, build_tiny_lm
    from rlasync.trainer import PolicyTrainer
    from rlasync.trainer.types import micro_plan

    batch = _ragged_batch()
    rows, prompt_w, resp_w = 9, 6, 20
    attention, mask = batch.attention_mask, batch.response_mask
    plan = micro_plan(batch, 0, 40)
    assert sorted(int(i) for part in plan for i in part) == list(range(rows)) and len(plan) > 1
    assert max(int(attention[part].sum(-1).max()) * len(part) for part in plan) <= 40 or any(
        len(part) == 1 for part in plan
    )
    trainers = [
        PolicyTrainer(
            build_tiny_lm(TinyLMConfig.preset("nano", seed=4))[0],
            # Plain SGD of lr 1: the step writes the summed gradient into the weights, which are
            # then compared to rounding (AdamW's first step would move a weight whose gradient is
            # near zero by anything in +-lr when its last bits differ).
            TrainerConfig(optimizer="sgd", lr=1.0, micro_batch_tokens=tokens),
        )
        for tokens in (0, 40)
    ]
    start = {n: p.detach().clone() for n, p in trainers[0].model.named_parameters()}
    # Rows cut to their width run as other matmul shapes: the same sums in another order.
    width = prompt_w + resp_w
    rtol = step_rtol(trainers[0].model.config, tokens=rows * width, sequence=width)
    whole, dynamic = (t.compute_logprobs(batch) for t in trainers)
    assert rounding_close(whole * mask, dynamic * mask, rtol)
    metrics = [t.step(batch) for t in trainers]
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=rtol)
    assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=rtol)
    after = [{n: p.detach() for n, p in t.model.named_parameters()} for t in trainers]
    assert_same_sgd_step(start, *after, lr=1.0, rtol=rtol)


def test_sgd_steps_by_minus_lr_times_the_clipped_gradient_plus_decay() -> None:
    """``trainer.optimizer: sgd`` is plain SGD (no momentum): the step the tests read gradients off."""
    import torch

    from rlasync.config import TrainerConfig
    from rlasync.models import TinyLMConfig, build_tiny_lm
    from rlasync.trainer import PolicyTrainer

    config = TrainerConfig(optimizer="sgd", lr=0.5, weight_decay=0.1, grad_clip=0.01)
    trainer = PolicyTrainer(build_tiny_lm(TinyLMConfig.preset("nano", seed=4))[0], config)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(_ragged_batch())
    assert metrics["grad_norm"] > 0.01  # so the clip acted: the gradients left are the clipped ones
    clipped = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped.values()]))) <= 0.01 * (
        1 + 1e-5
    )
    for name, param in trainer.model.named_parameters():
        expected = start[name] - 0.5 * (clipped[name] + 0.1 * start[name])
        # Three rounded operations on values of the weights' size: within a few of their ulps.
        spacing = torch.finfo(torch.float32).eps * start[name].abs().max()
        assert float((param.detach() - expected).abs().max()) <= 4 * float(spacing), name
