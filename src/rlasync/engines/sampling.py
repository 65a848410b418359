"""Sampling on the device: temperature, top-k, top-p, per-request seeds; logprobs of the pick.

Every sampled row draws by inverse CDF from one uniform number. A seeded request's number is a
hash of (seed, position), so its pick depends on nothing else in the batch, and a request
resumed from its partial output (prompt + tokens so far, same seed) samples exactly what the
uninterrupted one would have; the others take theirs from the engine's generator. One
vectorised draw for the whole batch: a generator per seeded row (reseeded at every position,
one ``multinomial`` each) measured a fifth of a tiny model's decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .types import Alternatives, SamplingParams

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, position): splitmix64 of the pair, top 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def uniforms(seeds: Sequence[tuple[int, int] | None], generator: torch.Generator) -> torch.Tensor:
    """One uniform per row: ``seeded_uniform(seed, position)`` for rows given as (seed,
    position), the next numbers of ``generator`` for the rows given as None."""
    drawn = iter(
        torch.rand(sum(pair is None for pair in seeds), generator=generator, dtype=torch.float64).tolist()
    )
    return torch.tensor(
        [next(drawn) if pair is None else seeded_uniform(*pair) for pair in seeds], dtype=torch.float64
    )


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[Alternatives] | None]:
    """The next token of every row (``logits``: [rows, vocab]; ``u``: a uniform per row, see
    ``uniforms``), its logprob under the temperature-scaled distribution, and each row's most
    likely tokens under that distribution when a row's ``top_logprobs`` asks (else None).

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
    sampled = (~greedy).nonzero().flatten()
    if len(sampled):
        picked = [params[i] for i in sampled.tolist()]
        sub = logprobs[sampled]
        if any(p.top_k or p.top_p < 1.0 for p in picked):  # rank the vocabulary, cut, renormalise
            ks = torch.tensor([p.top_k or vocab for p in picked], device=logits.device)
            ps = torch.tensor([p.top_p for p in picked], device=logits.device)
            order = sub.argsort(dim=-1, descending=True)
            ranked = sub.gather(-1, order)
            drop = torch.arange(vocab, device=logits.device)[None, :] >= ks[:, None]
            probs = ranked.exp()
            drop |= (probs.cumsum(-1) - probs) >= ps[:, None]  # keep the smallest prefix reaching top_p
            weights = ranked.exp().masked_fill(drop, 0.0)
        else:
            order, weights = None, sub.exp()
        cdf = weights.double().cumsum(-1)
        target = (u.to(cdf.device)[sampled] * cdf[:, -1])[:, None]
        picks = (
            torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1).flatten()
        )  # a zero weight is never picked
        tokens[sampled] = picks if order is None else order.gather(-1, picks[:, None]).flatten()
    return tokens, logprobs.gather(-1, tokens[:, None]).flatten(), _alternatives(logprobs, params)


def _alternatives(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[Alternatives] | None:
    """Each row's ``top_logprobs`` most likely tokens ([] for a row that asks for none), or
    None when no row asks (the common case costs nothing)."""
    k = max(p.top_logprobs for p in params)
    if not k:
        return None
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [
        list(zip(row_ids[: p.top_logprobs], row_values[: p.top_logprobs]))
        for p, row_ids, row_values in zip(params, ids.tolist(), values.tolist())
    ]
