"""``data.sampler``: the registry, import paths, and the pass-rate curriculum (``rlasync.data.samplers``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlasync.data import (
    PassRateSampler,
    RowResult,
    Sampler,
    SamplerError,
    UniformSampler,
    make_sampler,
    register_sampler,
    registered_samplers,
)

ROWS: list[dict[str, Any]] = [{"i": i} for i in range(30)]
EASY, LEARNABLE = set(range(10)), set(range(10, 20))  # the rest: never solved


def _rewards(index: int) -> list[float]:
    """A group of 4: easy rows always solved, learnable ones half the time, the rest never."""
    return [1.0] * 4 if index in EASY else [1.0, 0.0, 1.0, 0.0] if index in LEARNABLE else [0.0] * 4


def _train(sampler: Sampler, steps: int, per_step: int = 6) -> list[int]:
    drawn: list[int] = []
    for _ in range(steps):
        uses = sampler.next_uses(per_step)
        drawn += [index for _, index in uses]
        sampler.update([RowResult(index, _rewards(index)) for _, index in uses])
    return drawn


def test_after_one_epoch_the_pass_rate_sampler_draws_mostly_rows_in_the_learning_band() -> None:
    uniform, curriculum = UniformSampler(ROWS, seed=1), PassRateSampler(ROWS, seed=1, revisit=0.1)
    assert sorted(_train(curriculum, 5)) == list(range(30))  # the first epoch tries every row once
    later = _train(curriculum, 20)
    share = sum(index in LEARNABLE for index in later) / len(later)
    # A third of the rows, most of the draws (the never solved come back at first: retry_unsolved).
    assert share > 0.7, share
    assert sum(index in LEARNABLE for index in _train(uniform, 25)[30:]) / 120 < 0.5
    assert curriculum.skipped > 0 and curriculum.in_band() == pytest.approx(1 / 3)
    assert all(0 <= index < 30 for index in later)


def test_rows_left_out_come_back_with_revisit_and_a_batch_is_never_short() -> None:
    nothing_learnable = PassRateSampler(ROWS, seed=0, revisit=0.0)
    nothing_learnable.update([RowResult(i, [1.0]) for i in range(30)])  # every row always solved
    assert len(nothing_learnable.next_uses(12)) == 12  # skipped all, then taken anyway
    revisiting = PassRateSampler(ROWS, seed=0, revisit=1.0)
    revisiting.update([RowResult(i, [1.0]) for i in range(30)])
    assert sorted(index for _, index in revisiting.next_uses(30)) == list(range(30))


def test_retry_unsolved_brings_a_row_never_solved_back_often_at_first_then_at_revisit() -> None:
    """``e`` epochs after a row was found unsolved it comes back with probability max(revisit,
    0.5 ** e), however often it was drawn meanwhile: the share of the rows each epoch draws, over
    a few hundred rows that stay unsolved (each draw measured again, as a run does)."""
    rows = [{"i": i} for i in range(400)]

    def shares(sampler: PassRateSampler) -> dict[int, float]:
        per_epoch: dict[int, int] = {}
        sampler.update([RowResult(i, [0.0] * 4) for _, i in sampler.next_uses(400)])  # epoch 0: all
        while sampler.epoch < 6:
            uses = sampler.next_uses(10)
            sampler.update([RowResult(i, [0.0] * 4) for _, i in uses])
            for epoch, _ in uses:
                per_epoch[epoch] = per_epoch.get(epoch, 0) + 1
        return {epoch: per_epoch[epoch] / 400 for epoch in range(1, 6)}

    plain = shares(PassRateSampler(rows, seed=0, revisit=0.1, retry_unsolved=0.0))
    retrying = shares(PassRateSampler(rows, seed=0, revisit=0.1))  # retry_unsolved 0.5, the default
    # Seeded draws (no float reduction: the same on every CPU); 400 per epoch, so a share p has a
    # standard deviation sqrt(p(1-p)/400): 0.015 at 0.1, 0.025 at 0.5. The bounds are 2.4-2.7 of them.
    assert all(share == pytest.approx(0.1, abs=0.04) for share in plain.values()), plain
    expected = {1: 0.5, 2: 0.25, 3: 0.125, 4: 0.1, 5: 0.1}
    assert all(retrying[e] == pytest.approx(p, abs=0.06) for e, p in expected.items()), retrying


def test_a_row_solved_once_leaves_the_unsolved_and_one_found_again_starts_over() -> None:
    sampler = PassRateSampler(ROWS, seed=0)
    sampler.update([RowResult(3, [0.0] * 4), RowResult(7, [0.0] * 4)])
    sampler.next_uses(len(ROWS) + 1)  # into epoch 1
    sampler.update([RowResult(3, [0.0] * 4), RowResult(7, [1.0, 0.0, 0.0, 0.0])])
    assert sampler.unsolved == {3: 0}  # still the epoch it was first found unsolved; 7 solved
    sampler.update([RowResult(7, [0.0] * 4)])
    assert sampler.unsolved == {3: 0, 7: 1}


@pytest.mark.parametrize("options", [{}, {"retry_unsolved": 0.0}])
def test_a_restored_curriculum_draws_what_the_uninterrupted_one_does(options: dict[str, Any]) -> None:
    whole = PassRateSampler(ROWS, seed=5, **options)
    expected = _train(whole, 12)
    first = PassRateSampler(ROWS, seed=5, **options)
    drawn = _train(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # as state.json keeps it
    second = PassRateSampler(ROWS, seed=5, **options)
    second.load_state_dict(state)
    assert drawn + _train(second, 5) == expected


def test_a_sampler_by_name_by_import_path_and_with_options() -> None:
    assert isinstance(make_sampler("uniform", ROWS, seed=0), UniformSampler)
    assert make_sampler({"name": "pass_rate", "revisit": 0.5}, ROWS, seed=0).revisit == 0.5  # type: ignore[attr-defined]
    by_path = make_sampler("rlasync.data.samplers:PassRateSampler", ROWS, seed=0)
    assert isinstance(by_path, PassRateSampler)

    @register_sampler("test_every_other")
    class EveryOther(UniformSampler):
        def next_uses(self, n: int) -> list[tuple[int, int]]:
            return super().next_uses(2 * n)[::2]

    assert "test_every_other" in registered_samplers()
    assert len(make_sampler("test_every_other", ROWS, seed=0).next_uses(4)) == 4


def not_a_sampler(rows: Any, **options: Any) -> str:
    return "a sampler in name only"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hardest_first", "unknown sampler 'hardest_first'; registered: .*pass_rate.*uniform"),
        ("no_such_module:Thing", "cannot import 'no_such_module:Thing'"),
        ({"name": "pass_rate", "low": 0.9, "high": 0.1}, "expected 0 <= low < high <= 1"),
        ({"name": "pass_rate", "temperature": 2}, "unexpected keyword argument 'temperature'"),
        ({"revisit": 0.1}, "needs the sampler's name"),
        (f"{__name__}:not_a_sampler", "made a str, not a rlasync.data.Sampler"),
    ],
)
def test_a_bad_sampler_is_a_config_error_naming_what_to_change(spec: Any, message: str) -> None:
    with pytest.raises(SamplerError, match=message):
        make_sampler(spec, ROWS, seed=0)


def test_rows_added_mid_epoch_join_the_next_epoch_and_restore_exactly() -> None:
    rows = [{"i": i} for i in range(4)]
    sampler = make_sampler("uniform", rows, seed=1)
    first = sampler.next_uses(2)
    sampler.add_rows([{"i": 4}, {"i": 5}])
    rest_of_epoch = sampler.next_uses(2)
    assert {i for _, i in first + rest_of_epoch} == {0, 1, 2, 3}  # epoch 0 is the rows it began with
    saved = sampler.state_dict()
    assert saved["num_rows"] == 6 and saved["size"] == 4
    epoch_1 = sampler.next_uses(6)
    assert {e for e, _ in epoch_1} == {1} and {i for _, i in epoch_1} == set(range(6))
    again = make_sampler("uniform", rows[:4], seed=1)
    again.add_rows([{"i": 4}, {"i": 5}])  # what a resumed run does: the generated rows first
    again.load_state_dict(saved)
    assert again.next_uses(6) == epoch_1


def test_rising_difficulty_adds_longer_words_each_time_the_window_passes() -> None:
    from rlasync.data import GeneratorError, make_generator, split_of

    spec = {
        "name": "rising_difficulty",
        "threshold": 0.5,
        "window": 2,
        "batch": 3,
        "start_length": 4,
        "max_length": 5,
    }
    grow = make_generator(spec, seed=0)
    assert grow is not None and make_generator("", seed=0) is None
    assert grow.generate([RowResult(0, [0.0, 0.0]), RowResult(1, [0.0, 1.0])], rows=[]) == []  # 0.25 < 0.5
    added = grow.generate([RowResult(2, [1.0, 1.0])], rows=[])
    assert [len(r["ground_truth"]) for r in added] == [4, 4, 4]
    assert all(split_of("reverse", r["problem"].key) == "train" for r in added)  # never a held-out problem
    assert all(r["messages"][0]["content"] == f"Reverse {r['ground_truth'][::-1]}" for r in added)
    state = grow.state_dict()
    assert grow.generate([RowResult(3, [1.0])], rows=[]) == []  # counting afresh after an addition
    longer = grow.generate([RowResult(4, [1.0])], rows=[])
    assert [len(r["ground_truth"]) for r in longer] == [5, 5, 5]
    assert grow.generate([RowResult(5, [1.0]), RowResult(6, [1.0])], rows=[]) == []  # max_length reached
    twin = make_generator(spec, seed=0)
    assert twin is not None
    twin.load_state_dict(state)
    twin.generate([RowResult(3, [1.0])], rows=[])
    assert twin.generate([RowResult(4, [1.0])], rows=[]) == longer  # the same rows after a restore
    with pytest.raises(
        GeneratorError, match=r"data.generator: no entry named 'harder' \(registered: rising_difficulty; "
    ):
        make_generator("harder", seed=0)
    with pytest.raises(GeneratorError, match="data.generator 'rising_difficulty': .*unexpected keyword"):
        make_generator({"name": "rising_difficulty", "speed": 2}, seed=0)
