"""Sampling on the device: temperature, top-k, top-p, per-request seeds; logprobs of the pick."""

from __future__ import annotations

from typing import Sequence

import torch

from .types import SamplingParams


def sample(
    logits: torch.Tensor,  # [rows, vocab]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row and its logprob under the temperature-scaled distribution.

    Greedy rows (temperature 0) take the argmax, and their logprob is under temperature 1.
    top-k/top-p shape what is sampled, not the logprob (the full scaled distribution is what
    a trainer recomputes).
    """
    logits = logits.float()
    rows, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = (~greedy).nonzero().flatten().tolist()
    if sampled:
        sub = scaled[sampled]
        ks = torch.tensor([params[i].top_k or vocab for i in sampled], device=logits.device)
        ps = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
        order = sub.argsort(dim=-1, descending=True)
        ranked = sub.gather(-1, order)
        drop = torch.arange(vocab, device=logits.device)[None, :] >= ks[:, None]
        probs = torch.softmax(ranked, dim=-1)
        drop |= (probs.cumsum(-1) - probs) >= ps[:, None]  # keep the smallest prefix reaching top_p
        ranked = ranked.masked_fill(drop, float("-inf"))
        weights = torch.softmax(ranked, dim=-1)
        shared = [j for j, i in enumerate(sampled) if generators[i] is None]
        picks = torch.empty(len(sampled), dtype=torch.long, device=logits.device)
        if shared:
            picks[shared] = torch.multinomial(weights[shared], 1, generator=default_generator).flatten()
        for j, i in enumerate(sampled):
            generator = generators[i]
            if generator is not None:
                picks[j] = torch.multinomial(weights[j : j + 1], 1, generator=generator).flatten()[0]
        tokens[sampled] = order.gather(-1, picks[:, None]).flatten()
    return tokens, logprobs.gather(-1, tokens[:, None]).flatten()
