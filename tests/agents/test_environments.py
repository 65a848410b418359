"""Every run's rows, rewards and environment turns go through one protocol (``rlasync.envs``):
the synthetic task and the data files are environments like the adapters, an environment's own
``interaction`` talks with the model in our loops ahead of ``agent.interaction``, and the
agent-loop worker scores with whatever environment the run names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from scripted import ScriptedEngine

import rlasync
from rlasync.agents import AgentLoopWorker, AgentWorkerSpec
from rlasync.compose.feed import environment_source, read_rows
from rlasync.config import AgentConfig, ConfigError, load_config
from rlasync.data import synthetic_rows
from rlasync.engines import SamplingParams
from rlasync.envs import EnvError, Environment, Interaction, make_environment, register_environment
from rlasync.models import build_tokenizer
from rlasync.rewards import RewardInput, compute_reward

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _answer(row: dict[str, Any], text: str) -> RewardInput:
    return RewardInput(
        response_text=text,
        full_text=text,
        ground_truth=row.get("ground_truth"),
        extra={k: v for k, v in row.items() if k not in ("messages", "ground_truth")},
    )


# -- the synthetic task and the data files are environments -----------------------------------


async def test_the_synthetic_task_is_an_environment_of_the_same_rows_and_reward() -> None:
    env = make_environment({"synthetic": {"task": "reverse", "train_size": 50}}, seed=3)
    assert env is not None
    train, val = env.rows("train"), env.rows("val", 8)
    assert train == synthetic_rows("reverse", 50, seed=3, split="train", distinct=False)
    assert val == synthetic_rows("reverse", 8, seed=3, split="val")
    row = val[0]
    right, wrong = _answer(row, row["ground_truth"]), _answer(row, row["ground_truth"] + "x")
    assert (await compute_reward(env.score, right)).score == 1.0
    assert (await compute_reward(env.score, wrong)).score == 0.0
    # A row that crossed the wire carries its problem as plain data: scored the same.
    wired = msgspec.msgpack.decode(msgspec.msgpack.encode(row))
    assert (await compute_reward(env.score, _answer(wired, row["ground_truth"]))).score == 1.0
    with pytest.raises(EnvError, match=r"data.source.synthetic.task: unknown synthetic task 'nope'"):
        make_environment({"synthetic": {"task": "nope"}}, seed=0)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


async def test_data_files_are_an_environment_scored_by_the_run_reward_or_a_verl_function(
    tmp_path: Path,
) -> None:
    rows = [{"prompt": f"Say {w}", "answer": w} for w in ("ab", "cd", "ef")]
    files = {
        "train_files": [_jsonl(tmp_path / "t.jsonl", rows)],
        "val_files": [_jsonl(tmp_path / "v.jsonl", rows[:2])],
    }
    env = make_environment({"files": {**files, "answer_key": "answer", "reward": "exact_match"}}, seed=0)
    assert env is not None
    train, val = env.rows("train"), env.rows("val", 1)
    assert [r["ground_truth"] for r in train] == ["ab", "cd", "ef"] and len(val) == 1
    assert (await compute_reward(env.score, _answer(train[1], "cd"))).score == 1.0
    assert (await compute_reward(env.score, _answer(train[1], "ab"))).score == 0.0

    scorer = tmp_path / "score.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info, bonus=0.0):\n"
        "    return float(solution_str.startswith(ground_truth)) + bonus\n"
    )
    custom = {"path": str(scorer), "reward_kwargs": {"bonus": 0.5}}
    env = make_environment({"files": {**files, "answer_key": "answer", "custom_reward": custom}}, seed=0)
    assert env is not None
    assert (await compute_reward(env.score, _answer(train[0], "ab!"))).score == 1.5

    with pytest.raises(EnvError, match=r"^data.reward: .*no_such_reward"):
        make_environment({"files": {**files, "reward": "no_such_reward"}}, seed=0)
    with pytest.raises(EnvError, match="data.val_files is not"):
        make_environment({"files": {"train_files": files["train_files"], "val_files": []}}, seed=0)
    with pytest.raises(EnvError, match="custom_reward_function .*no such file"):
        make_environment({"files": {**files, "custom_reward": {"path": str(tmp_path / "none.py")}}}, seed=0)


def test_a_run_without_data_source_names_the_files_or_the_synthetic_environment(tmp_path: Path) -> None:
    synthetic = load_config(
        overrides=["train.task=arith", "data.synthetic_train_size=30", "agent.default_loop=tool"]
    )
    assert environment_source(synthetic) == {
        "synthetic": {"task": "arith", "train_size": 30, "tool_loop": "tool"}
    }
    train, val = read_rows(
        msgspec.structs.replace(synthetic, train=msgspec.structs.replace(synthetic.train, val_size=5))
    )
    assert len(train) == 30 and len(val) == 5 and all(r["task"] == "arith" for r in train + val)

    path = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "hi", "ground_truth": "x"}])
    files = load_config(
        overrides=[f"data.train_files=[{path}]", f"data.val_files=[{path}]", "data.reward=exact_numeric"]
    )
    source = environment_source(files)
    assert isinstance(source, dict) and source["files"]["reward"] == "exact_numeric"
    assert source["files"]["train_files"] == [path] and source["files"]["custom_reward"] is None
    named = load_config(overrides=["data.source={synthetic: {task: calc}}"])
    assert environment_source(named) == {"synthetic": {"task": "calc"}}
    empty = _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ConfigError, match="data.train_files hold no rows"):
        read_rows(load_config(overrides=[f"data.train_files=[{empty}]", f"data.val_files=[{path}]"]))


# -- an environment's own turns, in our loops ------------------------------------------------


class _Coach(Interaction):
    """Says "again" after each wrong answer; ends the conversation on the right one."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    async def respond(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> tuple[bool, str, float]:
        right = messages[-1]["content"].strip() == self.answer
        return right, "" if right else "again", float(right)


@register_environment("coached_words")
class CoachedWords(Environment):
    """Rows asking for a word; its own coach talks with the model until it says it, except on
    rows marked ``uncoached`` (the config's or the row's interaction answers those)."""

    def __init__(self, *, seed: int) -> None:
        self.seed = seed

    def rows(self, split: Any, n: int | None = None) -> list[dict[str, Any]]:
        return [{"messages": [{"role": "user", "content": "Say ok"}], "ground_truth": "ok", "uid": "w"}]

    async def score(self, inp: RewardInput) -> float:
        return 1.0 if inp.response_text.strip() == inp.ground_truth else 0.25

    def interaction(self, row: dict[str, Any]) -> Interaction | None:
        return None if row.get("uncoached") else _Coach(str(row["ground_truth"]))


async def test_an_environment_interaction_talks_in_our_loops_and_its_score_is_the_reward(tok: Any) -> None:
    engine = ScriptedEngine(tok, ["no", "nope", "ok"])
    spec = AgentWorkerSpec(
        model="", agent=AgentConfig(default_loop="tool"), source={"coached_words": {}}, seed=1
    )
    row = CoachedWords(seed=1).rows("train")[0]
    uncoached = {**row, "uid": "u", "interaction_kwargs": {"name": "no_such_user"}, "uncoached": True}
    async with rlasync.LocalCluster(nodes=1) as cluster:  # the head alone: the worker in this process
        worker = await cluster.spawn(AgentLoopWorker, spec, engine=engine, tokenizer=tok, name="loops")
        coached, refused = await worker.generate([row, uncoached], PARAMS)
    said = [(m["role"], m["content"]) for m in coached.messages[1:]]
    assert said == [
        ("assistant", "no"),
        ("user", "again"),
        ("assistant", "nope"),
        ("user", "again"),
        ("assistant", "ok"),
    ]
    assert coached.reward == 1.0 and coached.termination == "interaction"  # the coach ended it
    # Not the environment's: the row names an interaction no one registered, and only it fails.
    assert refused.termination == "error" and "no_such_user" in refused.metrics.error
