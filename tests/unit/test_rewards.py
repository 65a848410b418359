"""Rewards: the built-ins on hand-written cases, the registry, and compute_reward's failure contract."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from fractions import Fraction

import pytest

from rlasync.rewards import (
    RewardInput,
    RewardOutput,
    ToolFormat,
    boxed_math,
    compute_reward,
    exact_match,
    exact_numeric,
    extract_boxed,
    get_reward,
    normalize_math_answer,
    parse_last_number,
    register_reward,
    registered_rewards,
    registry,
    tool_format,
)


@pytest.fixture(autouse=True)
def _isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into a copy of the registry and warns afresh."""
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
    monkeypatch.setattr(registry, "_warned", set())


def answer(text: str, truth: str | None = None, **kw: object) -> RewardInput:
    return RewardInput(response_text=text, ground_truth=truth, **kw)  # type: ignore[arg-type]


# -- exact_numeric ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", Fraction(42)),
        ("The answer is 1,234.", Fraction(1234)),
        ("x = -5", Fraction(-5)),
        ("3-5 is not it, 7 is", Fraction(7)),
        ("3-5", Fraction(5)),  # a binary minus is not a sign
        ("-1,234.5", Fraction(-2469, 2)),
        ("1,2,3", Fraction(3)),  # a list, not thousands
        ("12,3456", Fraction(3456)),
        ("about 0.25 or .5", Fraction(1, 2)),
        ("\u22127", Fraction(-7)),  # unicode minus sign
        ("no digits here", None),
        ("", None),
    ],
)
def test_parse_last_number(text: str, expected: Fraction | None) -> None:
    assert parse_last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "truth", "score"),
    [
        ("57", "57", 1.0),
        ("  So 40+17 = 57.\n", "57", 1.0),
        ("57.0", "57", 1.0),
        ("1,000", "1000", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("57 then 58", "57", 0.0),  # the last number counts
        ("fifty-seven", "57", 0.0),
    ],
)
def test_exact_numeric(text: str, truth: str, score: float) -> None:
    out = exact_numeric(answer(text, truth))
    assert out.score == score
    assert out.metrics["answer_found"] == (0.0 if text == "fifty-seven" else 1.0)


def test_exact_numeric_rejects_missing_or_non_numeric_truth() -> None:
    with pytest.raises(ValueError, match="ground_truth"):
        exact_numeric(answer("5"))
    with pytest.raises(ValueError, match="no number"):
        exact_numeric(answer("5", "five"))


# -- boxed_math -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last one
        (r"\boxed {3}", "3"),
        (r"\fbox{4}", "4"),
        (r"\boxed{1} and then \boxed{2", None),  # cut off inside the last box
        ("no box at all: 5", None),
        (r"\boxed", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (r"$\dfrac{1}{2}.$", "1/2"),
        (r"\frac12", "1/2"),
        (r"\tfrac{3}{4}", "3/4"),
        (r"-\frac{3}{4}", "-3/4"),
        (r"\frac{1+x}{2}", "(1+x)/(2)"),
        (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"),
        (r"\frac{\frac{1}{2}}{3}", "(1/2)/(3)"),
        (r"\frac\pi2", r"\pi/2"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"10\!000", "10000"),
        (r"x = 5", "5"),
        (r"\text{(A)}", "(A)"),
        (r"\frac{1}", r"\frac{1}"),  # malformed: kept as written
    ],
)
def test_normalize_math_answer(raw: str, normal: str) -> None:
    assert normalize_math_answer(raw) == normal


@pytest.mark.parametrize(
    ("text", "truth", "score"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "1/2", 1.0),
        (r"\boxed{\frac12}", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", r"\dfrac{1}{2}", 1.0),  # numbers compare as numbers
        (r"\boxed{\dfrac{3}{4}.}", "0.75", 1.0),
        (r"\boxed{ 1,000 }", "1000", 1.0),
        (r"\boxed{10\!000}", "10000", 1.0),
        (r"\boxed{-\frac{2}{4}}", "-0.5", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{\left(1, 2\right)}", "(1,2)", 1.0),  # strings compare normalised
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\sqrt{3}/2", 1.0),
        (r"\boxed{7}", r"so \boxed{7}", 1.0),  # a boxed ground truth is unboxed
        (r"\boxed{\boxed{7}}", "7", 1.0),
        (r"\boxed{1} no wait \boxed{2}", "2", 1.0),  # the last box counts
        (r"\boxed{2} no wait \boxed{1}", "2", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.333", 0.0),  # exact, no tolerance
        (r"\boxed{\frac{1}{0}}", "1/0", 1.0),  # not a number: compared as strings
        ("the answer is 7", "7", 0.0),  # no box
        (r"\boxed{7", "7", 0.0),  # truncated box
    ],
)
def test_boxed_math(text: str, truth: str, score: float) -> None:
    out = boxed_math(answer(text, truth))
    assert out.score == score, (text, truth)
    assert out.metrics["answer_found"] == float(extract_boxed(text) is not None)


# -- tool_format ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "calls", "errors", "score"),
    [
        ("3944", 1, 0, 1.0),
        ("<think>multiply</think> 3944", 2, 0, 1.0),
        ("I think it is 3944", 0, 0, 0.0),  # no tool call
        ("3944", 2, 1, 0.0),  # a tool error
        ("   ", 1, 0, 0.0),  # no final answer
        ("<think>still thinking", 1, 0, 0.0),  # unclosed think: no answer
        ("reasoning without an opening tag</think>", 1, 0, 0.0),  # Qwen3 style: the prompt opened <think>
        ('<tool_call>{"name": "calculator"}</tool_call>', 1, 0, 0.0),  # ended on a call
    ],
)
def test_tool_format_all_or_nothing_by_default(text: str, calls: int, errors: int, score: float) -> None:
    assert tool_format(answer(text, num_tool_calls=calls, tool_errors=errors)) == score


def test_tool_format_partial_credit() -> None:
    soft = ToolFormat(tool_call=0.25, no_errors=0.25, final_answer=0.25)
    assert soft(answer("3944", num_tool_calls=1)) == 1.0
    assert soft(answer("3944")) == 0.25  # answered, no call (and no errors does not count without calls)
    assert soft(answer("3944", num_tool_calls=2, tool_errors=1)) == 0.5
    assert soft(answer("", num_tool_calls=1)) == 0.5
    assert soft(answer("")) == 0.0


def test_tool_format_rejects_bad_credits() -> None:
    with pytest.raises(ValueError, match=r"ToolFormat\.no_errors"):
        ToolFormat(no_errors=-0.1)
    with pytest.raises(ValueError, match="sum to at most 1.0"):
        ToolFormat(tool_call=0.5, no_errors=0.5, final_answer=0.5)


# -- exact_match ------------------------------------------------------------------------------
def test_exact_match() -> None:
    assert exact_match(answer(" dcba\n", "dcba")) == 1.0
    assert exact_match(answer("dcba", " dcba ")) == 1.0
    assert exact_match(answer("dcb a", "dcba")) == 0.0
    assert exact_match(answer("DCBA", "dcba")) == 0.0


# -- registry ---------------------------------------------------------------------------------
def test_builtins_are_registered() -> None:
    assert {"exact_numeric", "boxed_math", "tool_format", "exact_match"} <= set(registered_rewards())
    assert get_reward("boxed_math") is boxed_math
    assert get_reward("tool_format") is tool_format


def test_register_and_get() -> None:
    @register_reward("length_penalty")
    def length_penalty(inp: RewardInput) -> float:
        return -len(inp.response_text) / 100

    assert get_reward("length_penalty") is length_penalty
    assert register_reward("length_penalty")(length_penalty) is length_penalty  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("length_penalty")(lambda inp: 0.0)
    replacement = register_reward("length_penalty", replace=True)(lambda inp: 0.0)
    assert get_reward("length_penalty") is replacement


def test_unknown_reward_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*boxed_math.*register_reward"):
        get_reward("nope")


# -- compute_reward ---------------------------------------------------------------------------
async def test_sync_reward_runs_off_the_event_loop_thread() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    @register_reward("where")
    def where(inp: RewardInput) -> float:
        seen.append(threading.get_ident())
        return 0.5

    assert await compute_reward("where", answer("x")) == RewardOutput(score=0.5)
    assert seen and seen[0] != loop_thread


async def test_builtins_through_compute_reward() -> None:
    out = await compute_reward("boxed_math", answer(r"\boxed{\frac12}", "0.5"))
    assert out == RewardOutput(score=1.0, metrics={"answer_found": 1.0})
    out = await compute_reward(exact_match, answer("abc", "abc"))
    assert out == RewardOutput(score=1.0)


async def test_async_rewards_are_awaited() -> None:
    @register_reward("async_judge")
    async def judge(inp: RewardInput) -> RewardOutput:
        await asyncio.sleep(0)
        return RewardOutput(score=0.75, metrics={"judge_calls": 1.0})

    class Judge:  # a callable object with an async __call__
        async def __call__(self, inp: RewardInput) -> float:
            await asyncio.sleep(0)
            return 1

    assert await compute_reward("async_judge", answer("x")) == RewardOutput(
        score=0.75, metrics={"judge_calls": 1.0}
    )
    out = await compute_reward(Judge(), answer("x"))
    assert out == RewardOutput(score=1.0) and type(out.score) is float


async def test_a_raising_reward_is_a_recorded_zero(caplog: pytest.LogCaptureFixture) -> None:
    @register_reward("broken")
    def broken(inp: RewardInput) -> float:
        raise ValueError("boom")

    with caplog.at_level(logging.WARNING, logger="rlasync.rewards.registry"):
        first = await compute_reward("broken", answer("x"))
        second = await compute_reward("broken", answer("y"))
    assert first == second == RewardOutput(score=0.0, metrics={"error": "ValueError: boom"})
    assert len(caplog.records) == 1 and "broken" in caplog.text  # logged once, not per sample


@pytest.mark.parametrize(
    ("result", "error"),
    [
        (float("nan"), "ValueError: reward score must be a finite number"),
        (float("inf"), "ValueError: reward score must be a finite number"),
        ("1.0", "TypeError: a reward must return a float or a RewardOutput, got str"),
        (RewardOutput(score=float("nan")), "ValueError: reward score must be a finite number"),
    ],
)
async def test_a_bad_result_is_a_recorded_zero(result: object, error: str) -> None:
    out = await compute_reward(lambda inp: result, answer("x"))  # type: ignore[arg-type,return-value]
    assert out.score == 0.0
    assert str(out.metrics["error"]).startswith(error)


async def test_unknown_name_and_missing_ground_truth_are_recorded_zeros() -> None:
    out = await compute_reward("nope", answer("x"))
    assert out.score == 0.0 and str(out.metrics["error"]).startswith("ValueError: unknown reward 'nope'")
    out = await compute_reward("exact_match", answer("x"))
    assert out == RewardOutput(score=0.0, metrics={"error": "ValueError: exact_match needs a ground_truth"})


async def test_a_slow_async_reward_times_out() -> None:
    async def slow(inp: RewardInput) -> float:
        await asyncio.sleep(10)
        return 1.0

    start = time.monotonic()
    out = await compute_reward(slow, answer("x"), timeout_s=0.05)
    assert time.monotonic() - start < 2
    assert out == RewardOutput(
        score=0.0, metrics={"error": "TimeoutError: reward 'slow' took longer than timeout_s=0.05"}
    )


async def test_a_slow_sync_reward_times_out_and_is_abandoned() -> None:
    release = threading.Event()

    @register_reward("stuck")
    def stuck(inp: RewardInput) -> float:
        release.wait(10)
        return 1.0

    try:
        out = await compute_reward("stuck", answer("x"), timeout_s=0.05)
    finally:
        release.set()  # let the abandoned thread finish
    assert out == RewardOutput(
        score=0.0, metrics={"error": "TimeoutError: reward 'stuck' took longer than timeout_s=0.05"}
    )


async def test_a_reward_raising_timeout_error_itself_is_told_apart() -> None:
    async def flaky(inp: RewardInput) -> float:
        raise TimeoutError("judge server did not answer")

    out = await compute_reward(flaky, answer("x"), timeout_s=5)
    assert out.metrics == {"error": "TimeoutError: judge server did not answer"}


async def test_no_deadline() -> None:
    async def fine(inp: RewardInput) -> float:
        await asyncio.sleep(0.01)
        return 1.0

    assert (await compute_reward(fine, answer("x"), timeout_s=None)).score == 1.0


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_cancellation_propagates(kind: str) -> None:
    started, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    async def waits(inp: RewardInput) -> float:
        started.set()
        await asyncio.sleep(10)
        return 1.0

    def blocks(inp: RewardInput) -> float:
        loop.call_soon_threadsafe(started.set)
        release.wait(10)
        return 1.0

    task = asyncio.create_task(compute_reward(waits if kind == "async" else blocks, answer("x"), timeout_s=5))
    try:
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
