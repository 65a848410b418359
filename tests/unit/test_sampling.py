"""The torch engine's sampler: the distribution it draws from, top-k/top-p, seeds."""

from __future__ import annotations

import torch

from rlasync.engines.sampling import sample, seeded_uniform, uniforms
from rlasync.engines.types import SamplingParams


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    rows = logits.expand(n, -1)
    tokens, _, _ = sample(rows, [params] * n, uniforms([None] * n, torch.Generator().manual_seed(seed)))
    return tokens


def test_samples_follow_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 40_000
    for temperature in (1.0, 0.5):
        counts = (
            torch.bincount(_draw(logits, SamplingParams(temperature=temperature), n), minlength=4).double()
            / n
        )
        expected = torch.softmax(logits[0].double() / temperature, -1)
        # A share p of n draws has a standard deviation sqrt(p(1-p)/n) <= 0.0025 at n = 40,000:
        # 0.01 is four of them, so a fair sampler fails about once in 10^4 seeds, a wrong one always.
        assert torch.allclose(counts, expected, atol=0.01), (temperature, counts, expected)


def test_top_k_and_top_p_only_pick_inside_their_set() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])  # probabilities 0.64, 0.23, 0.09, 0.03, 0.01
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_k=2), 5000).tolist()) == {0, 1}
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 5000).tolist()) == {
        0,
        1,
    }  # 0.64 < 0.8 <= 0.87
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.5), 5000).tolist()) == {0}
    counts = torch.bincount(
        _draw(logits, SamplingParams(temperature=1.0, top_k=2), 20_000), minlength=2
    ).double()
    assert abs(counts[0] / counts.sum() - 0.64 / 0.87) < 0.02  # renormalised over the kept set


def test_greedy_rows_take_the_argmax_with_their_temperature_one_logprob() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0]])
    tokens, logprobs, top = sample(
        logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)], torch.tensor([0.3, 0.0])
    )
    assert top is None  # no row asked for alternatives
    assert tokens[0] == 1 and torch.isclose(logprobs[0], torch.log_softmax(logits[0], -1)[1])
    assert tokens[1] == 0  # u = 0 picks the first token with any weight
    assert torch.isclose(logprobs[1], torch.log_softmax(logits[1] / 0.7, -1)[0])


def test_a_seeded_row_depends_only_on_its_seed_and_position() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    alone = sample(logits[:1], params[:1], uniforms([(7, 12)], torch.Generator()))[0]
    crowded = sample(logits, params, uniforms([(7, 12), None, (9, 12)], torch.Generator().manual_seed(5)))[0]
    assert alone[0] == crowded[0]
    values = [seeded_uniform(seed, position) for seed in range(20) for position in range(50)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03


def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_the_pick_is_drawn_from() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0], [4.0, 0.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    params = [
        SamplingParams(temperature=0.0, top_logprobs=2),
        SamplingParams(temperature=0.5, top_logprobs=3),
        SamplingParams(temperature=1.0),
    ]
    tokens, logprobs, top = sample(logits, params, torch.tensor([0.3, 0.5, 0.5]))
    assert top is not None and top[2] == []  # a row that asks for none gets none
    greedy = torch.log_softmax(logits[0], -1)  # a greedy row's logprobs are under temperature 1
    assert [t for t, _ in top[0]] == [1, 3] and torch.allclose(
        torch.tensor([lp for _, lp in top[0]]), greedy[[1, 3]]
    )
    assert top[0][0] == (int(tokens[0]), float(logprobs[0]))  # the greedy pick is the first alternative
    scaled = torch.log_softmax(logits[1] / 0.5, -1)
    assert [t for t, _ in top[1]] == [0, 3, 2]
    assert torch.allclose(torch.tensor([lp for _, lp in top[1]]), scaled[[0, 3, 2]])
    assert dict(top[1]).get(int(tokens[1]), float(logprobs[1])) == float(logprobs[1])  # one number per token
