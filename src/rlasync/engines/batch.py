"""The running batch of the torch engine: one KV cache for every sequence being decoded.

Sequences sit in rows, left-padded: every row's history ends at the same column, so one
decoding step feeds one token per row and appends one column. A per-row attention mask
hides the padding and per-row position ids keep each sequence's own positions (what
``generate`` does for a left-padded batch). Joining pads the newcomer's cache (or the
batch) on the left; leaving drops the row; columns that are padding for every row are
trimmed. Runs in the engine's worker thread only.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers (0.4 s to import) loads with the first prefill, not with the engines
    from transformers import DynamicCache


class _KVLayer(Protocol):
    """One layer of a ``DynamicCache`` as this batch uses it (transformers types its layers as a
    union that also holds linear-attention layers, which the models served here do not have)."""

    keys: torch.Tensor
    values: torch.Tensor
    is_initialized: bool


def _layers(cache: DynamicCache) -> list[_KVLayer]:
    layers: list[_KVLayer] = cache.layers  # type: ignore[assignment]
    return layers


class KVBatch:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [rows, columns]: 1 = real token
        self.last = torch.zeros(0, dtype=torch.long)  # [rows]: the token to feed next
        self.pos = torch.zeros(0, dtype=torch.long)  # [rows]: its position

    @property
    def rows(self) -> int:
        return int(self.last.shape[0])

    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in _layers(self.cache) if layer.is_initialized
        )

    # -- model steps ------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, model: Any, prompts: list[list[int]]) -> torch.Tensor:
        """Run new prompts (left-padded together) and join them; the logits of their last token."""
        width = max(len(p) for p in prompts)
        device = model.device
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=position.to(device),
            use_cache=True,
            logits_to_keep=1,
            **_cache_kwarg(model, cache),
        )
        self._join(cache, mask, torch.tensor([len(p) for p in prompts]))
        return out.logits[:, -1, :]

    @torch.no_grad()
    def decode(self, model: Any) -> torch.Tensor:
        """One step for every row: feed ``last`` at ``pos``; the logits of the next token."""
        assert self.cache is not None
        device = model.device
        mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=self.last[:, None].to(device),
            attention_mask=mask.to(device),
            position_ids=self.pos[:, None].to(device),
            use_cache=True,
            **_cache_kwarg(model, self.cache),
        )
        self.mask = mask
        self.pos = self.pos + 1
        return out.logits[:, -1, :]

    # -- membership -------------------------------------------------------------------------
    def _join(self, cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.cache is None or self.rows == 0:
            self.cache, self.mask = cache, mask
            self.last = torch.zeros(mask.shape[0], dtype=torch.long)
            self.pos = lengths.clone()
            return
        old, new = self.mask.shape[1], mask.shape[1]
        width = max(old, new)
        for mine, theirs in zip(_layers(self.cache), _layers(cache)):
            mine.keys = torch.cat(
                [_left_pad(mine.keys, width - old), _left_pad(theirs.keys, width - new)], dim=0
            )
            mine.values = torch.cat(
                [_left_pad(mine.values, width - old), _left_pad(theirs.values, width - new)], dim=0
            )
        self.mask = torch.cat([F.pad(self.mask, (width - old, 0)), F.pad(mask, (width - new, 0))], dim=0)
        self.last = torch.cat([self.last, torch.zeros(mask.shape[0], dtype=torch.long)])
        self.pos = torch.cat([self.pos, lengths])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then trim columns no row uses."""
        if len(rows) == self.rows:
            return
        if not rows:
            self.cache = None
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            self.last = self.pos = torch.zeros(0, dtype=torch.long)
            return
        index = torch.tensor(rows)
        self.mask, self.last, self.pos = self.mask[index], self.last[index], self.pos[index]
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        assert self.cache is not None
        for layer in _layers(self.cache):
            layer.keys = layer.keys[index.to(layer.keys.device), :, first:]
            layer.values = layer.values[index.to(layer.values.device), :, first:]
        self.mask = self.mask[:, first:]


def _cache_kwarg(model: Any, cache: DynamicCache) -> dict[str, DynamicCache]:
    # transformers renamed `past_key_values` to `cache` (the old name warns from 5.2x on);
    # we support 5.19, which only knows the old one, and pass whichever the model takes.
    name = _CACHE_KWARG.get(type(model))
    if name is None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        _CACHE_KWARG[type(model)] = name
    return {name: cache}


_CACHE_KWARG: dict[type, str] = {}


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    # [rows, heads, columns, dim]: n zero columns in front
    return F.pad(t, (0, 0, n, 0)) if n else t
