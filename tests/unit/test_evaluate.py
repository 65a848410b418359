"""pass@k, avg@k and maj@k (``rlasync.compose.evaluate``): the estimator against brute force, and
the vote."""

from __future__ import annotations

import itertools

import pytest

from rlasync.compose.evaluate import pass_at, scores, voted_answer


@pytest.mark.parametrize(("n", "c"), [(4, 0), (4, 1), (4, 2), (5, 3), (6, 6)])
def test_pass_at_is_the_share_of_j_subsets_with_a_right_answer(n: int, c: int) -> None:
    samples = [True] * c + [False] * (n - c)
    for j in range(1, n + 1):
        subsets = list(itertools.combinations(samples, j))
        assert pass_at(n, c, j) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at(4, 1, 5)


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        ("<think>maybe 3</think>so <answer> 4 </answer>", "4"),
        ("<answer>1</answer> wait <answer>2</answer>", "2"),
        (r"therefore \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        ("<think>long\nthought</think>\nfirst\n  the   end  \n\n", "the end"),
        ("", ""),
    ],
)
def test_a_reply_votes_for_its_final_answer(text: str, vote: str) -> None:
    assert voted_answer(text) == vote


def test_scores_of_rows_of_samples() -> None:
    groups = [
        [("<answer>4</answer>", 1.0), ("<answer>5</answer>", 0.0), ("<answer>4</answer>", 1.0), ("x", 0.0)],
        [
            ("<answer>7</answer>", 0.0),
            ("<answer>7</answer>", 0.0),
            ("<answer>6</answer>", 1.0),
            ("<answer>8</answer>", 0.0),
        ],
        [("a", 0.0), ("b", 0.0), ("c", 0.0), ("d", 0.0)],
    ]
    got = scores(groups)
    assert got["pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    assert got["avg@4"] == pytest.approx(3 / 12)
    assert got["maj@4"] == pytest.approx(1 / 3)  # row 1's majority (4) is right; row 2's (7) is not
    # Partial credit: avg@k is the mean credit, pass@k counts rewards of at least `correct`.
    partial = scores([[("a", 0.5), ("b", 0.5)]], correct=0.5)
    assert partial["avg@2"] == 0.5 and partial["pass@1"] == 1.0
    with pytest.raises(ValueError):
        scores([[("a", 1.0)], [("a", 1.0), ("b", 0.0)]])  # rows of unequal samples
