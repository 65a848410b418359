"""What crosses the boundary between the controller and the trainer's ranks."""

from __future__ import annotations

import heapq
from typing import Any

import msgspec
import torch

from ..metrics.reduce import reduce_metrics as reduce_metrics  # declared per metric: rlasync.metrics

TENSOR_FIELDS = (
    "prompts",
    "responses",
    "response_mask",
    "attention_mask",
    "position_ids",
    "logprobs",
    "advantages",
)
OPTIONAL_FIELDS = ("proximal_logprobs", "is_weights")  # off-policy correction, when the schedule asks for it


class TrainBatch(msgspec.Struct, kw_only=True):
    """The tensors a training step needs, and nothing else (it is sent to every rank)."""

    prompts: Any  # [B, P] long, left-padded
    responses: Any  # [B, R] long, right-padded
    response_mask: Any  # [B, R] long: 1 = a model token to train on
    attention_mask: Any  # [B, P + R] long
    position_ids: Any  # [B, P + R] long: the engine's positions (real tokens only)
    logprobs: Any  # [B, R] float: behaviour logprobs
    advantages: Any  # [B] or [B, R] float
    proximal_logprobs: Any = (
        None  # [B, R] float: decoupled PPO's proximal policy (the trainer's before the step)
    )
    is_weights: Any = (
        None  # [B, R] float: importance weights (e.g. truncated IS) multiplying each token's loss
    )

    @classmethod
    def from_rollout(cls, batch: Any, advantages: torch.Tensor | None = None) -> TrainBatch:
        """From the agents' ``RolloutBatch`` (any object with its tensor fields: the trainer
        does not import the agents)."""
        size = batch.responses.shape[0]
        return cls(
            prompts=batch.prompts,
            responses=batch.responses,
            response_mask=batch.response_mask,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logprobs=batch.logprobs,
            advantages=advantages if advantages is not None else torch.zeros(size),
        )

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any]) -> TrainBatch:
        missing = [name for name in TENSOR_FIELDS if name not in tensors]
        if missing:
            raise ValueError(f"a training batch needs {', '.join(missing)}")
        return cls(
            **{name: tensors[name] for name in TENSOR_FIELDS},
            **{name: tensors[name] for name in OPTIONAL_FIELDS if name in tensors},
        )

    def _present(self) -> tuple[str, ...]:
        return TENSOR_FIELDS + tuple(name for name in OPTIONAL_FIELDS if getattr(self, name) is not None)

    def tensors(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._present()}

    @property
    def size(self) -> int:
        return int(self.responses.shape[0])

    @property
    def input_ids(self) -> Any:
        return torch.cat([self.prompts, self.responses], dim=1)

    def rows(self, rows: slice | Any) -> TrainBatch:
        """Some of the sequences (a slice, or a tensor of row indices); the padded widths stay,
        so every part lines up."""
        return TrainBatch(**{name: getattr(self, name)[rows] for name in self._present()})

    def trim(self) -> TrainBatch:
        """The same rows without the columns that are padding in all of them: prompt columns on
        the left, response columns on the right (positions are explicit, so nothing moves)."""
        prompt_len = self.prompts.shape[1]
        real = self.attention_mask.bool().any(0)
        first = int(real[:prompt_len].float().argmax()) if bool(real[:prompt_len].any()) else prompt_len - 1
        width = max(1, int(real[prompt_len:].nonzero().max()) + 1) if bool(real[prompt_len:].any()) else 1
        keep = torch.cat([torch.arange(first, prompt_len), torch.arange(prompt_len, prompt_len + width)])
        fields: dict[str, Any] = {
            "prompts": self.prompts[:, first:],
            "attention_mask": self.attention_mask[:, keep],
            "position_ids": self.position_ids[:, keep],
        }
        for name in ("responses", "response_mask", "logprobs", *OPTIONAL_FIELDS):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value[:, :width]
        fields["advantages"] = self.advantages[:, :width] if self.advantages.dim() == 2 else self.advantages
        return TrainBatch(**fields)

    def to(self, device: Any) -> TrainBatch:
        return TrainBatch(**{name: getattr(self, name).to(device) for name in self._present()})

    def loss_denominator(self, agg: str) -> float:
        """What the batch's loss is normalised by: its model tokens (``token-mean``) or its
        non-empty sequences (the ``seq-mean`` modes). Computed once for the whole batch, so
        micro-batches and ranks each add their share and the sum is the batch's loss."""
        mask = self.response_mask
        count = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()
        return float(max(int(count), 1))


def micro_plan(batch: TrainBatch, micro_batch_size: int, micro_batch_tokens: int) -> list[Any]:
    """The micro-batches of ``batch``: row slices of ``micro_batch_size`` (0: the whole batch),
    or with ``micro_batch_tokens`` row-index tensors of similar lengths, sorted, each holding at
    most that many tokens once cut to its longest row (verl's dynamic batch size)."""
    size = batch.size
    if not micro_batch_tokens:
        micro = micro_batch_size or max(size, 1)
        return [slice(start, min(size, start + micro)) for start in range(0, size, micro)]
    lengths = batch.attention_mask.sum(-1).tolist()
    groups: list[list[int]] = []
    longest = 0
    for row in sorted(range(size), key=lambda i: lengths[i]):
        longest = max(longest, lengths[row])
        if (
            groups
            and groups[-1]
            and (longest * (len(groups[-1]) + 1) <= micro_batch_tokens)
            and (not micro_batch_size or len(groups[-1]) < micro_batch_size)
        ):
            groups[-1].append(row)
        else:
            groups.append([row])
            longest = lengths[row]
    return [torch.tensor(group, dtype=torch.long) for group in groups]


def balanced_shards(tokens: list[int], world_size: int) -> list[torch.Tensor]:
    """Row indices, one tensor per rank, whose token counts are nearly equal (verl's
    ``balance_batch``): the longest row first, each to the rank holding the fewest tokens (then
    the fewest rows), so the slowest rank, which every collective waits for, carries little more
    than its share (at most the even share plus one row's tokens). Each rank's rows stay in
    batch order."""
    loads = [(0, 0, rank) for rank in range(world_size)]  # (tokens, rows, rank): a min-heap
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for row in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        held, count, rank = heapq.heappop(loads)
        shards[rank].append(row)
        heapq.heappush(loads, (held + tokens[row], count + 1, rank))
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in shards]


def shard_rows(size: int, world_size: int) -> list[slice]:
    """Contiguous, nearly equal row ranges, one per rank (a rank may get none)."""
    base, extra = divmod(size, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append(slice(start, stop))
        start = stop
    return bounds
