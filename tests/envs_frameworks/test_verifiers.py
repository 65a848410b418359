"""verifiers environments trained unchanged (``data.source.verifiers``), in sync and fully async:
a ``SingleTurnEnv`` whose ``Rubric`` (two weighted functions) is the reward, a ``MultiTurnEnv``
whose ``env_response`` turns are the environment's turns of one trajectory, and a ``ToolEnv``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlasync.envs import EnvError, make_environment

vf = pytest.importorskip("verifiers", reason="needs verifiers 0.3.x: the envs tier, `make test-envs`")
if not hasattr(vf, "SingleTurnEnv"):
    pytest.skip(
        "needs verifiers' classic API (0.3.x): the envs tier, `make test-envs`", allow_module_level=True
    )

from frameworks import run_yaml  # noqa: E402

pytestmark = pytest.mark.timeout(900)

WORDS_ENV = '''\
"""Reverse a word. The rubric: the reply's vowel share (weight 1) and whether it names the answer (0.5)."""
import verifiers as vf
from datasets import Dataset

WORDS = ["abc", "dog", "cat", "moon", "tree", "fish", "bird", "lamp", "door", "rock", "sand", "wind"]


def vowel_share(completion, **kwargs) -> float:
    text = completion[-1]["content"] or ""
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


def names_answer(completion, answer, **kwargs) -> float:
    return float(answer in (completion[-1]["content"] or ""))


def load_environment(words: int = 8, coach: bool = False):
    rows = [{"question": f"Reverse {w}", "answer": w[::-1]} for w in WORDS[:words]]
    held = [{"question": f"Reverse {w}", "answer": w[::-1]} for w in WORDS[words:]]
    if coach:
        return Coach(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(held), rubric=vf.Rubric(funcs=[turns]), max_turns=3)
    rubric = vf.Rubric(funcs=[vowel_share, names_answer], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(held), system_prompt="Be brief.", rubric=rubric
    )


class Coach(vf.MultiTurnEnv):
    """Answers each reply with a hint until the third; the reward is the number of replies."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"Hint {len(state['trajectory'])}: the last letter first."}]


def turns(completion, **kwargs) -> float:
    return float(sum(m["role"] == "assistant" for m in completion))

'''


def _vowel_share(text: str) -> float:
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_single_turn_env_trains_with_its_rubric_as_the_reward(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "vf_words.py").write_text(WORDS_ENV)
    run = run_yaml(
        tmp_path,
        "data:\n  source:\n    verifiers: {env: ./vf_words.py, args: {words: 8}}\n",
        model=nano_model_dir,
        mode=mode,
    )
    assert any(r["reward"] > 0 for r in run["steps"])  # vowels happen
    for trace in run["traces"]:  # each reward is the rubric's weighted sum of the reply it scored
        assert trace["messages"][0] == {"role": "system", "content": "Be brief."}
        reply, word = trace["messages"][-1]["content"], trace["messages"][1]["content"].split()[-1]
        assert trace["reward"] == pytest.approx(_vowel_share(reply) + 0.5 * (word[::-1] in reply)), trace


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_multi_turn_env_answers_between_the_model_turns(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "vf_words.py").write_text(WORDS_ENV)
    source = "data:\n  source:\n    verifiers: {env: ./vf_words.py, args: {coach: true}}\n"
    run = run_yaml(tmp_path, source, model=nano_model_dir, mode=mode)
    assert all(r["reward"] == 3.0 for r in run["steps"])  # three model turns each, as max_turns says
    for trace in run["traces"]:
        roles = [m["role"] for m in trace["messages"]]
        assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"], roles
        assert trace["messages"][2]["content"] == "Hint 1: the last letter first."


TOOL_ENV = '''\
"""Arithmetic with a tool the environment runs; the rubric grades the final answer and counts calls."""
import verifiers as vf
from datasets import Dataset


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def correct(completion, answer, **kwargs) -> float:
    return float((completion[-1]["content"] or "").strip() == answer)


def load_environment():
    rows = [{"question": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(11, 19) for b in range(21, 23)]
    # Its author forces a call each turn (structured outputs make even an untrained model's call
    # valid), so the environment runs its tool between the model's turns, max_turns of them.
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]),
        tools=[multiply], rubric=vf.Rubric(funcs=[correct]), max_turns=3,
        sampling_args={"tool_choice": "required"},
    )
'''


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_tool_env_runs_its_tools_between_the_model_turns(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "vf_calc.py").write_text(TOOL_ENV)
    run = run_yaml(
        tmp_path,
        "data:\n  source:\n    verifiers: {env: ./vf_calc.py}\n",
        model=nano_model_dir,
        mode=mode,
        tokens=96,
    )
    assert all(r["reward"] == 0.0 for r in run["steps"])  # an untrained model answers no product
    for trace in run["traces"]:
        messages = trace["messages"]
        assert [m["role"] for m in messages] == [
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
        ], messages
        # The environment ran its tool on each call's (integer) arguments: a product each time.
        assert all(re.fullmatch(r"-?\d+", m["content"]) for m in messages if m["role"] == "tool"), messages


GROUP_ENV = '''\
"""Reverse a word; the rubric: the reply's vowel share (weight 1), and a group function (0.25)."""
import verifiers as vf
from datasets import Dataset


def vowel_share(completion, **kwargs) -> float:
    text = completion[-1]["content"] or ""
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


def group_seen(completions, **kwargs) -> list[float]:
    """Each rollout's score is the number of rollouts scored with it: the group's size."""
    return [float(len(completions))] * len(completions)


def load_environment():
    rows = [{"question": f"Reverse {w}", "answer": w[::-1]} for w in ["abc", "dog", "cat", "moon", "tree", "fish"]]
    rubric = vf.Rubric(funcs=[vowel_share, group_seen], weights=[1.0, 0.25])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:2]), rubric=rubric)
'''


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_rubric_with_group_functions_scores_each_prompts_group_together(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "vf_group.py").write_text(GROUP_ENV)
    run = run_yaml(
        tmp_path, "data:\n  source:\n    verifiers: {env: ./vf_group.py}\n", model=nano_model_dir, mode=mode
    )
    assert run["traces"]
    for trace in run["traces"]:  # group_size 2: the group function saw both rollouts of its prompt
        reply = trace["messages"][-1]["content"]
        assert trace["reward"] == pytest.approx(_vowel_share(reply) + 0.25 * 2), trace


def test_a_wrong_env_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match=r"data.source.verifiers.env='no_such_env'"):
        make_environment({"verifiers": {"env": "no_such_env"}}, seed=0)
    (tmp_path / "vf_none.py").write_text("def other():\n    pass\n")
    with pytest.raises(EnvError, match=r"defines no load_environment"):
        make_environment({"verifiers": {"env": str(tmp_path / "vf_none.py")}}, seed=0)
