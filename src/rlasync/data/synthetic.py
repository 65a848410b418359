"""Synthetic tasks for the quickstart: string reversal, arithmetic, arithmetic with a calculator.

Each task draws problems from a seeded ``random.Random``; a problem belongs to the train or
the validation split by a hash of its key (``"abcd"``, ``"47+8"``), so the splits never
overlap whatever the seeds. ``make_problems(task, n, seed=, split=)`` gives the same ``n``
distinct problems for the same arguments; ``iter_problems`` is an endless stream (with
repeats) for training. A problem carries its prompt (chat messages, and tool schemas for
``calc``), its answer, and the SFT ``target``: the messages of a correct solution after
the prompt (one assistant turn, or for ``calc`` the tool call, the tool's reply, the answer).

Why these tasks (measured on 2 cores): a 0.8 M-parameter model
learns reversal and tool use in about a minute, and RL then improves them because a
half-trained policy is *uncertain per problem*. Single-digit tables are memorised instead
(every problem is confidently right or wrong, so a GRPO group has no variance), and 2-digit +
2-digit addition is too slow to learn from scratch. ``arith`` sits between: a 2-digit number
plus a 1-digit number, where the answer's tens digit depends on a carry (a rule shared by
all problems rather than a per-problem fact), over 900 problems.

No torch here: ``rlasync.compose.warmstart`` trains on these, the RL loop rewards with them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from ..tools.calculator import CALCULATOR

Split = Literal["train", "val"]
Message = dict[str, Any]

VAL_PERCENT = 10
"""Share of each task's problem space held out for validation (by hash of the problem key)."""

REVERSE_ALPHABET = "abcdefgh"
"""Letters of ``reverse`` payloads: none of them merge with another in the tiny models' BPE,
so every letter is one token (measured: merged payloads capped reversal accuracy)."""


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One task instance: the prompt, the answer, and a correct solution to imitate."""

    task: str
    key: str
    """What identifies the problem within its task (``"abcd"``, ``"37*58"``); the split is hashed from it."""
    messages: list[Message]
    """The prompt as chat messages (rendered with ``add_generation_prompt=True``)."""
    answer: str
    """The exact final answer."""
    target: list[Message]
    """The messages of a correct solution after the prompt: assistant turn(s), and tool turns."""
    tools: list[Message] | None = None
    """Tool schemas for the chat template (``calc`` only)."""


@dataclass(frozen=True)
class Task:
    name: str
    draw: Callable[[random.Random], Problem]
    """One random problem (from either split)."""
    reward: Callable[[Problem, str], float]
    """Reward of a final answer text (the last assistant turn's content)."""
    max_new_tokens: int
    """Enough tokens for one assistant turn of a correct solution, with room to spare."""
    size: int
    """Number of distinct problems (both splits)."""


def exact_match(problem: Problem, final: str) -> float:
    """1.0 when the final answer equals the expected one, ignoring surrounding whitespace."""
    return 1.0 if final.strip() == problem.answer else 0.0


def split_of(task: str, key: str) -> Split:
    digest = hashlib.sha256(f"{task}:{key}".encode()).digest()
    return "val" if int.from_bytes(digest[:4], "big") % 100 < VAL_PERCENT else "train"


# -- reverse ----------------------------------------------------------------------------------
def _reverse(rng: random.Random) -> Problem:
    return reverse_problem("".join(rng.choice(REVERSE_ALPHABET) for _ in range(rng.randint(3, 6))))


def reverse_problem(word: str) -> Problem:
    """The ``reverse`` problem of ``word`` (any length; the task draws 3 to 6 letters)."""
    answer = word[::-1]
    return Problem(
        task="reverse",
        key=word,
        messages=[{"role": "user", "content": f"Reverse {word}"}],
        answer=answer,
        target=[{"role": "assistant", "content": answer}],
    )


# -- arith ------------------------------------------------------------------------------------
def _arith(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(0, 9)
    answer = str(a + b)
    return Problem(
        task="arith",
        key=f"{a}+{b}",
        messages=[{"role": "user", "content": f"What is {a}+{b}?"}],
        answer=answer,
        target=[{"role": "assistant", "content": answer}],
    )


# -- calc: the same question shape, but a product the model cannot compute: it calls a tool --
def _calc(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    expression, answer = f"{a}*{b}", str(a * b)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return Problem(
        task="calc",
        key=expression,
        messages=[{"role": "user", "content": f"What is {expression}?"}],
        answer=answer,
        tools=[CALCULATOR],
        target=[
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ],
    )


TASKS: dict[str, Task] = {
    "reverse": Task("reverse", _reverse, exact_match, max_new_tokens=16, size=sum(8**n for n in range(3, 7))),
    "arith": Task("arith", _arith, exact_match, max_new_tokens=8, size=90 * 10),
    "calc": Task("calc", _calc, exact_match, max_new_tokens=40, size=90 * 90),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


def loop_reward(task: str) -> Callable[[dict[str, Any], Any], float]:
    """An agent loop's ``reward_fn`` for a synthetic task: the task's reward of the trajectory's
    last assistant message, against the ``problem`` its dataset row carries."""
    reward = get_task(task).reward

    def score(row: dict[str, Any], trajectory: Any) -> float:
        answers = [m for m in trajectory.messages if m.get("role") == "assistant"]
        return reward(as_problem(row["problem"]), str(answers[-1]["content"]) if answers else "")

    return score


def as_problem(value: Any) -> Problem:
    """A row's ``problem``: the ``Problem`` itself, or (a row that crossed the wire) its plain data."""
    return value if isinstance(value, Problem) else msgspec.convert(value, Problem)


def _rng(task: str, seed: int, split: Split) -> random.Random:
    return random.Random(f"{task}/{seed}/{split}")  # str seeds hash with sha512: stable across runs


def iter_problems(task: str, *, seed: int, split: Split = "train") -> Iterator[Problem]:
    """An endless, seeded stream of problems of one split (repeats allowed)."""
    draw, rng = get_task(task).draw, _rng(task, seed, split)
    while True:
        problem = draw(rng)
        if split_of(task, problem.key) == split:
            yield problem


def synthetic_capacity(task: str, split: Split) -> int:
    """How many distinct problems of a split ``make_problems`` will draw (80 % of the split:
    finding the last unseen ones would take long)."""
    return get_task(task).size * (VAL_PERCENT if split == "val" else 100 - VAL_PERCENT) // 100 * 4 // 5


def make_problems(task: str, n: int, *, seed: int = 0, split: Split = "val") -> list[Problem]:
    """``n`` distinct problems of one split, the same for the same arguments."""
    if n > synthetic_capacity(task, split):
        raise ValueError(
            f"{task}: asked for {n} distinct {split} problems, at most {synthetic_capacity(task, split)} can be drawn"
        )
    seen: dict[str, Problem] = {}
    for problem in iter_problems(task, seed=seed, split=split):
        seen.setdefault(problem.key, problem)
        if len(seen) == n:
            break
    return list(seen.values())
