"""Synthetic tasks: seeded, disjoint splits, exact-match rewards, calc solutions with a tool call."""

from __future__ import annotations

import itertools

import pytest

from rlasync.data import TASKS, get_task, iter_problems, make_problems, split_of
from rlasync.data.synthetic import REVERSE_ALPHABET
from rlasync.models import build_tokenizer
from rlasync.tools import HermesParser, calculator


@pytest.mark.parametrize("task", sorted(TASKS))
def test_same_arguments_same_problems_other_seed_other_problems(task: str) -> None:
    a = make_problems(task, 20, seed=3, split="train")
    assert a == make_problems(task, 20, seed=3, split="train")
    assert [p.key for p in a] != [p.key for p in make_problems(task, 20, seed=4, split="train")]
    assert len({p.key for p in a}) == 20


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_val_never_share_a_problem(task: str) -> None:
    val = make_problems(task, 60, seed=0, split="val")
    train = list(itertools.islice(iter_problems(task, seed=1, split="train"), 3000))
    assert {p.key for p in val}.isdisjoint(p.key for p in train)
    assert all(split_of(task, p.key) == "val" for p in val)
    assert all(split_of(task, p.key) == "train" for p in train)


def test_asking_for_more_distinct_problems_than_a_split_holds_fails() -> None:
    with pytest.raises(ValueError, match="arith"):
        make_problems("arith", 200, split="val")
    with pytest.raises(ValueError, match="unknown synthetic task"):
        get_task("chess")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_reward_is_exact_match_of_the_stripped_answer(task: str) -> None:
    problem = make_problems(task, 1, seed=0)[0]
    reward = get_task(task).reward
    assert reward(problem, problem.answer) == 1.0
    assert reward(problem, f"  {problem.answer}\n") == 1.0
    assert reward(problem, problem.answer + "1") == 0.0
    assert reward(problem, "") == 0.0
    assert problem.target[-1] == {"role": "assistant", "content": problem.answer}


def test_answers_are_right() -> None:
    for p in make_problems("reverse", 10):
        assert p.answer == p.key[::-1] and set(p.key) <= set(REVERSE_ALPHABET) and 3 <= len(p.key) <= 6
    for p in make_problems("arith", 10):
        a, b = map(int, p.key.split("+"))
        assert p.answer == str(a + b) and 10 <= a <= 99 and 0 <= b <= 9
    for p in make_problems("calc", 10):
        a, b = map(int, p.key.split("*"))
        assert p.answer == str(a * b) and 10 <= min(a, b) and max(a, b) <= 99


def test_calc_target_renders_a_tool_call_its_response_and_the_answer() -> None:
    tok = build_tokenizer()
    problem = make_problems("calc", 1)[0]
    text = str(
        tok.apply_chat_template(problem.messages + problem.target, tools=problem.tools, tokenize=False)
    )  # type: ignore[arg-type]
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{problem.key}"}}}}</tool_call><|im_end|>'
    assert text.startswith('<|im_start|>system\n<tools>{"name": "calculator"')
    assert f"<|im_start|>user\nWhat is {problem.key}?<|im_end|>\n<|im_start|>assistant\n{call}" in text
    assert text.endswith(
        f"<tool_response>{problem.answer}</tool_response><|im_end|>\n<|im_start|>assistant\n{problem.answer}<|im_end|>\n"
    )
    # The assistant turn parses back to the call (the agent loops' parser), and the calculator answers it.
    turn = HermesParser().parse(call.removesuffix("<|im_end|>"))
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": problem.key})]
    assert not turn.errors and calculator(problem.key) == problem.answer


def test_reverse_letters_are_one_token_each() -> None:
    # Merges inside payloads cap reversal accuracy (feasibility notes, gotcha 3).
    tok = build_tokenizer()
    for a, b in itertools.product(REVERSE_ALPHABET, repeat=2):
        assert tok.convert_ids_to_tokens(tok.encode(f"Reverse {a}{b}{a}"))[-3:] == [a, b, a]
