"""reasoning-gym as ``data.source``: its rows (held-out ones asking no training question), its
own ``score_answer`` as the reward, and runs from YAML in sync and fully async whose rewards are
reasoning-gym's scores of what the trajectories answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlasync.envs import EnvError, MissingExtraError, make_environment
from rlasync.rewards import RewardInput, compute_reward

rg = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'rlasync[envs]'")
from reasoning_gym.utils import extract_answer  # noqa: E402

SMALL = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
}  # 2 one-digit terms: ~200 questions


def _env(**options: Any) -> Any:
    return make_environment({"reasoning_gym": {"task": "chain_sum", "config": SMALL, **options}}, seed=5)


def test_rows_are_the_package_items_and_held_out_rows_ask_no_training_question() -> None:
    env = _env(size=300, val_pool=300)
    train, val = env.rows("train"), env.rows("val", 20)
    assert len(train) == 300 and len(val) == 20
    dataset = rg.create_dataset("chain_sum", size=12000, seed=5, **SMALL)
    for row in train[:5] + val[:5]:
        item = dataset[row["reasoning_gym_index"]]
        assert row["messages"][-1] == {"role": "user", "content": item["question"]}
        assert row["messages"][0]["role"] == "system" and "<answer>" in row["messages"][0]["content"]
        assert row["ground_truth"] == item["answer"] and row["data_source"] == "chain_sum"
    asked = {r["messages"][-1]["content"] for r in train}
    assert not asked & {r["messages"][-1]["content"] for r in val}
    assert len({r["uid"] for r in train + val}) == 320
    # Split by question, not by what training happened to ask (which would hold out mostly the
    # rarer, harder questions): held-out items come from the same stretch of the stream.
    assert (
        min(r["reasoning_gym_index"] for r in val) < 100
        and max(r["reasoning_gym_index"] for r in train) > 300
    )
    again = _env(size=300, val_pool=300)
    assert again.rows("val", 20) == val  # the same options: the same rows, on any process


async def test_the_score_is_the_package_own_score_of_the_tagged_answer() -> None:
    env = _env(size=50)
    row = env.rows("train")[7]
    dataset = rg.create_dataset("chain_sum", size=10, seed=5, **SMALL)
    item = dataset[row["reasoning_gym_index"]]
    extra = {k: v for k, v in row.items() if k not in ("messages", "ground_truth")}

    async def score(text: str) -> tuple[float, float]:
        out = await compute_reward(
            env.score, RewardInput(response_text=text, ground_truth=row["ground_truth"], extra=extra)
        )
        assert "error" not in out.metrics
        return out.score, float(out.metrics["answer_found"])

    assert await score(f"thinking... <answer>{item['answer']}</answer>") == (1.0, 1.0)
    wrong = str(int(item["answer"]) + 1)
    assert await score(f"<answer>{wrong}</answer>") == (
        rg.create_dataset("chain_sum", size=2050, seed=5, **SMALL).score_answer(wrong, item),
        1.0,
    )
    assert await score(item["answer"]) == (0.0, 0.0)  # untagged: no answer found
    text_env = _env(size=50, answer_format="text")
    out = await compute_reward(text_env.score, RewardInput(response_text=f" {item['answer']}\n", extra=extra))
    assert out.score == 1.0
    number_env = _env(size=50, answer_format="last_number")
    out = await compute_reward(
        number_env.score, RewardInput(response_text=f"so 1 and {item['answer']}.", extra=extra)
    )
    assert out.score == 1.0
    # A row that did not come from it is a recorded error, never a raise into the loop.
    out = await compute_reward(env.score, RewardInput(response_text="<answer>1</answer>", extra={}))
    assert out.score == 0.0 and "reasoning_gym_index" in str(out.metrics["error"])


def test_a_composite_of_weighted_tasks_scores_each_row_by_its_own_task() -> None:
    env = make_environment(
        {
            "reasoning_gym": {
                "tasks": {"chain_sum": 1.0, "basic_arithmetic": {"weight": 1.0, "config": {"max_terms": 2}}},
                "size": 40,
            }
        },
        seed=1,
    )
    rows = env.rows("train")
    assert {r["data_source"] for r in rows} == {"chain_sum", "basic_arithmetic"}
    for row in rows[:6]:
        extra = {k: v for k, v in row.items() if k not in ("messages", "ground_truth")}
        assert (
            env.score(RewardInput(response_text=f"<answer>{row['ground_truth']}</answer>", extra=extra)).score
            == 1.0
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"task": "chain_summ"}, r"no reasoning-gym task 'chain_summ' \(did you mean chain_sum"),
        (
            {"task": "chain_sum", "config": {"min_terms": 0}},
            r"reasoning-gym refused the config: min_terms must be positive",
        ),
        ({"task": "chain_sum", "config": {"bogus": 1}}, r"refused the config: .*bogus"),
        ({}, r"give one task"),
        ({"task": "chain_sum", "tasks": {"gcd": 1}}, r"give one task"),
        ({"task": "chain_sum", "colour": "red"}, r"data.source.reasoning_gym: .*colour"),
        ({"tasks": {"gcd": {"weight": 1, "confg": {}}}}, r"tasks.gcd: unknown keys \['confg'\]"),
    ],
)
def test_a_wrong_option_is_an_error_naming_the_setting(options: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvError, match=message):
        make_environment({"reasoning_gym": options}, seed=0)


def test_too_few_held_out_rows_or_questions_say_which_setting_to_change() -> None:
    with pytest.raises(EnvError, match=r"raise val_pool or lower train.val_size"):
        _env(size=100, val_pool=50).rows("val", 60)
    # 1 % of the questions held out, from the first 20 x (5 + 5) items: fewer than 5 of them.
    with pytest.raises(EnvError, match=r"too few distinct questions"):
        _env(size=5, val_pool=5, val_percent=1).rows("val", 5)


def test_an_unknown_environment_and_a_missing_package_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EnvError, match=r"data.source: no entry named 'gym'.*reasoning_gym"):
        make_environment({"gym": {}}, seed=0)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'rlasync\[envs\]'"):
        _env()


# -- training from YAML ------------------------------------------------------------------------
ORACLE = '''\
"""The model's own turn, except that on rows of even index the reply's text becomes the right
answer: the scorer then has right and wrong answers to tell apart (the tokens are the model's)."""
from rlasync.agents import SingleTurnAgentLoop, register


@register("half_oracle")
class HalfOracle(SingleTurnAgentLoop):
    async def _finish(self, row):
        if row["reasoning_gym_index"] % 2 == 0:
            self.state.messages[-1]["content"] = "<answer>" + row["ground_truth"] + "</answer>"
        return await super()._finish(row)
'''

CONFIG = """\
train:
  model_dir: {model}
  run_dir: {run_dir}
  mode: {mode}
  steps: 3
  prompts_per_step: 4
  group_size: 2
  max_new_tokens: 8
  validate_every: 3
  val_size: 6
  trace_every: 1
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
agent:
  default_loop: half_oracle
data:
  source:
    reasoning_gym:
      task: chain_sum
      config: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}
      size: 64
      val_pool: 200
plugins: [./oracle.py]
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_run_from_yaml_is_rewarded_by_reasoning_gym_own_scorer(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "oracle.py").write_text(ORACLE)
    (tmp_path / "run.yaml").write_text(
        CONFIG.format(model=nano_model_dir, run_dir=tmp_path / "run", mode=mode)
    )
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "run.yaml"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and r.get("reward") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert any(0.0 < r["reward"] < 1.0 for r in steps), [
        r["reward"] for r in steps
    ]  # half right: neither all nor none
    # Every traced trajectory's reward is reasoning-gym's score of what it answered.
    dataset = rg.create_dataset("chain_sum", size=264, seed=0, **SMALL)
    item_of = {dataset[i]["question"]: dataset[i] for i in range(264)}
    traces = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    assert traces and {t["reward"] for t in traces} <= {0.0, 1.0} and 1.0 in {t["reward"] for t in traces}
    for trace in traces:
        item = item_of[trace["messages"][1]["content"]]
        answer = trace["messages"][-1]["content"]
        assert trace["reward"] == dataset.score_answer(extract_answer(answer), item), trace
