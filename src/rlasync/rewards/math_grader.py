"""Math answers compared by math-verify (Hugging Face's grader) when it is installed
(``pip install rlasync[envs]``), by ``math_answers_equal`` otherwise, with one warning.

math-verify parses both answers to sympy and compares them as mathematics: ``\\frac{1}{2}``,
``0.5`` and ``1/2`` agree, so do ``\\{1, 2\\}`` and ``\\{2, 1\\}``, intervals, matrices and
expressions. Its own timeouts use ``signal.alarm``, which works only on a process's main thread,
where our event loop runs; rewards run in worker threads (``compute_reward``), so its timeouts
are off here and the reward call's deadline bounds the wait instead. Answers longer than
``MAX_ANSWER_CHARS`` are not parsed at all (sympy is superlinear on them): they are compared as
written.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

from .builtin import MAX_ANSWER_CHARS, _truth, extract_boxed, math_answers_equal
from .registry import RewardInput, RewardOutput, register_reward

log = logging.getLogger(__name__)


@functools.cache
def math_verify_installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None


@functools.cache
def _warn_fallback() -> None:
    log.warning(
        "math-verify is not installed: math answers are compared by rlasync's own normaliser, which "
        "knows numbers, fractions and plain LaTeX only (pip install 'rlasync[envs]' for math-verify)"
    )


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return list(parse(text, parsing_timeout=None))  # None: no signal.alarm (see the module)


def answers_equal(truth: str, answer: str) -> bool:
    """Whether ``answer`` is mathematically ``truth`` (both bare answers, as a ``\\boxed{}`` holds
    them): ``math_answers_equal`` first (exact numbers and normalised text: it also reads what
    math-verify does not, such as ``\\dfrac{3}{4}.`` with its full stop), then math-verify when
    installed."""
    if len(truth) > MAX_ANSWER_CHARS or len(answer) > MAX_ANSWER_CHARS:
        return truth.strip() == answer.strip()
    if not math_verify_installed():
        _warn_fallback()
        return math_answers_equal(answer, truth)
    if math_answers_equal(answer, truth):  # the same number or text: no need to parse
        return True
    from math_verify import verify

    gold, target = _parse(f"\\boxed{{{truth}}}"), _parse(f"\\boxed{{{answer}}}")
    return bool(gold) and bool(target) and bool(verify(gold, target, timeout_seconds=None))


def response_matches(truth: str, response: str) -> tuple[bool, bool]:
    """(right, an answer was found) for a whole response, as math-verify extracts its final
    answer (``\\boxed{}`` first, then the last LaTeX or plain expression). Without math-verify
    the last ``\\boxed{}`` only."""
    if not math_verify_installed() or len(response) > 50 * MAX_ANSWER_CHARS:
        boxed = extract_boxed(response)
        return boxed is not None and answers_equal(truth, boxed), boxed is not None
    from math_verify import verify

    target = _parse(response)
    if not target:
        return False, False
    gold = _parse(f"\\boxed{{{extract_boxed(truth) or truth}}}")
    return bool(gold) and bool(verify(gold, target, timeout_seconds=None)), True


@register_reward("boxed_math")
def boxed_math(inp: RewardInput) -> RewardOutput:
    """1.0 when the last ``\\boxed{}`` of the response is the ground truth (itself boxed or not)
    as mathematics (``answers_equal``)."""
    truth = _truth(inp, "boxed_math")
    truth = extract_boxed(truth) or truth
    answer = extract_boxed(inp.response_text)
    score = float(answer is not None and answers_equal(truth, answer))
    return RewardOutput(score=score, metrics={"answer_found": float(answer is not None)})


@register_reward("math_verify")
def math_verify(inp: RewardInput) -> RewardOutput:
    """1.0 when the response's final answer, as math-verify finds it (a ``\\boxed{}``, else the
    last expression), is the ground truth as mathematics: the grader of verl's and TRL's math
    recipes, for answers not always boxed (``response_matches``)."""
    right, found = response_matches(_truth(inp, "math_verify"), inp.response_text)
    return RewardOutput(score=float(right), metrics={"answer_found": float(found)})
