"""Padding-free micro-batches (``trainer.packing``): a micro-batch's rows, without their padding,
laid end to end in a few sequences ("bins") as long as its longest row, each row's positions
starting again at 0.

    packed = pack(part)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.keep)
    logits = packed.unpack(out.logits)                      # [B, R, V], as the padded forward gives

Given position ids and no attention mask, transformers attends only within each packed row
(``masking_utils.find_packed_sequence_indices``: a row begins wherever a position does not follow
the one before; flash-attention kernels take the same boundaries as variable-length sequences),
so every row sees exactly what it sees padded. A bin holds what a padded row of the longest row's
width would hold, so a bin costs what a padded row costs in attention, and a long-tailed batch
(most rows short, a few long) runs as a fraction of its rows. Rows go into bins longest first,
each into the first with room (first-fit decreasing). Only the positions that predict a response
token go through the LM head (``logits_to_keep`` as indices), as in the padded forward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .types import TrainBatch


class Packing(NamedTuple):
    """A micro-batch packed: the model's inputs, and where each response token's logits are."""

    input_ids: torch.Tensor
    """[bins, width] the rows' real tokens end to end; a bin's unused tail holds token 0."""
    position_ids: torch.Tensor
    """[bins, width] each row's own positions; a bin's tail counts from 0 as a row of its own."""
    keep: torch.Tensor
    """[K] the positions (in every bin) whose logits are computed: those that predict a response token somewhere."""
    bins: torch.Tensor
    """[N] for each response token of the batch (row-major, padding excluded): its bin,"""
    kept: torch.Tensor
    """its predicting position's index into ``keep``,"""
    rows: torch.Tensor
    """its row in the padded batch,"""
    cols: torch.Tensor
    """and its response column."""
    shape: tuple[int, int]
    """The padded batch's (rows, response width)."""

    def unpack(self, logits: torch.Tensor) -> torch.Tensor:
        """``[bins, K, V]`` logits as the padded forward's ``[B, R, V]`` (zeros where a response
        is padding: every loss masks those)."""
        picked = logits[self.bins, self.kept]
        rows, width = self.shape
        out = picked.new_zeros(rows, width, picked.shape[-1])
        return out.index_put((self.rows, self.cols), picked)


def pack(batch: TrainBatch) -> Packing:
    """``batch`` (left-padded prompts, right-padded responses) packed (see the module)."""
    prompt_width, response_width = batch.prompts.shape[1], batch.responses.shape[1]
    mask = batch.attention_mask
    prompt_lens = mask[:, :prompt_width].sum(-1).tolist()
    response_lens = mask[:, prompt_width:].sum(-1).tolist()
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    width = max(max(lengths, default=1), 1)
    used: list[int] = []  # tokens in each bin so far
    place: dict[int, tuple[int, int]] = {}  # row -> (bin, offset)
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        for b, filled in enumerate(used):
            if filled + lengths[row] <= width:
                place[row], used[b] = (b, filled), filled + lengths[row]
                break
        else:
            place[row] = (len(used), 0)
            used.append(lengths[row])
    tokens, positions = batch.input_ids, batch.position_ids
    device = tokens.device
    input_ids = torch.zeros(len(used), width, dtype=tokens.dtype, device=device)
    position_ids = torch.zeros(len(used), width, dtype=positions.dtype, device=device)
    bins: list[int] = []
    predicting: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    for row, (b, offset) in place.items():
        start, length = prompt_width - prompt_lens[row], lengths[row]
        input_ids[b, offset : offset + length] = tokens[row, start : start + length]
        position_ids[b, offset : offset + length] = positions[row, start : start + length]
        n = response_lens[row]
        first = offset + prompt_lens[row] - 1  # the last prompt token predicts the first response token
        bins += [b] * n
        predicting += range(first, first + n)
        rows += [row] * n
        cols += range(n)
    for b, filled in enumerate(used):  # the tail: a row of its own (positions 0, 1, ...), never read
        position_ids[b, filled:] = torch.arange(width - filled, device=device)
    where = torch.tensor(predicting, dtype=torch.long, device=device)
    keep = torch.unique(where)  # sorted
    return Packing(
        input_ids=input_ids,
        position_ids=position_ids,
        keep=keep,
        bins=torch.tensor(bins, dtype=torch.long, device=device),
        kept=torch.searchsorted(keep, where),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        shape=(int(mask.shape[0]), response_width),
    )


def packed_logits(model: Any, batch: TrainBatch) -> torch.Tensor:
    """``[B, R, V]`` logits that predict ``batch``'s response tokens, from one packed forward
    (on the batch's device)."""
    packed = pack(batch)
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.keep,
    )
    return packed.unpack(out.logits)
