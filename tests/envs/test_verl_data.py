"""verl's data as it is: a Parquet file written the way verl's ``examples/data_preprocess/gsm8k.py``
writes one (``datasets``' ``map`` and ``to_parquet``), and a reward file with verl's
``compute_score``, train unchanged from YAML with verl's own keys; verl's default scorer; the
errors of a row without its answer and of a reward function verl could not call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlasync.rewards import CustomRewardError, RewardInput, compute_reward, load_compute_score

datasets = pytest.importorskip("datasets", reason="writes verl's Parquet with `datasets`, as verl does")

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def write_gsm8k_like(folder: Path, n: int = 12) -> None:
    """train.parquet and test.parquet in verl's GSM8K layout, made as its script makes them
    (the problems are ours: there is no hub here)."""
    raw = [
        {
            "question": f"Tom has {i} apples and buys {i + 2}. How many?",
            "answer": f"{i}+{i + 2}\n#### {2 * i + 2}",
        }
        for i in range(n)
    ]

    def make_map_fn(split: str) -> Any:
        def process_fn(example: dict[str, Any], idx: int) -> dict[str, Any]:
            question_raw, answer_raw = example.pop("question"), example.pop("answer")
            return {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer_raw.split("#### ")[1]},
                "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
            }

        return process_fn

    for split in ("train", "test"):
        ds = datasets.Dataset.from_list(raw).map(function=make_map_fn(split), with_indices=True)
        ds.to_parquet(str(folder / f"{split}.parquet"))


# Scores 0.25 when verl's four arguments arrive as verl passes them, 0 otherwise: the run's mean
# reward is then 0.25 exactly, and anything else says which argument went wrong.
REWARD_FILE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    right = (
        data_source == "openai/gsm8k"
        and isinstance(solution_str, str)
        and extra_info["answer"].endswith("#### " + ground_truth)
        and isinstance(extra_info["index"], int)
    )
    return {"score": 0.25 + bonus if right else 0.0, "acc": float(right), "pred": solution_str[:5]}
"""


async def test_compute_score_gets_verl_arguments_and_its_dict_is_score_and_metrics(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    reward = load_compute_score(str(tmp_path / "reward.py"), "compute_score", {"bonus": 0.5})
    extra = {
        "data_source": "openai/gsm8k",
        "reward_model": {"style": "rule", "ground_truth": "8"},
        "extra_info": {"index": 3, "answer": "3+5\n#### 8"},
    }
    out = await compute_reward(reward, RewardInput(response_text="#### 8", ground_truth="8", extra=extra))
    assert out.score == 0.75 and out.metrics == {"acc": 1.0, "pred": "#### "}


@pytest.mark.parametrize(
    ("source", "name", "message"),
    [
        ("def compute_score(a, b):\n    return 1.0\n", "compute_score", r"cannot be called as verl calls it"),
        (
            "def other(data_source, solution_str, ground_truth, extra_info):\n    return 1\n",
            "compute_score",
            r"defines no function 'compute_score' \(it has other\)",
        ),
        ("raise RuntimeError('boom')\n", "compute_score", r"RuntimeError: boom"),
    ],
)
def test_a_reward_file_verl_could_not_call_is_refused_by_name(
    tmp_path: Path, source: str, name: str, message: str
) -> None:
    path = tmp_path / f"r{abs(hash(source))}.py"
    path.write_text(source)
    with pytest.raises(CustomRewardError, match=message):
        load_compute_score(str(path), name)
    with pytest.raises(CustomRewardError, match=r"no such file"):
        load_compute_score(str(tmp_path / "nope.py"))


@pytest.mark.parametrize(
    ("source", "response", "truth", "score"),
    [
        ("openai/gsm8k", "so 3+5 = 8\n#### 8", "8", 1.0),
        ("openai/gsm8k", "#### 1,000", "1000", 1.0),
        ("openai/gsm8k", "the answer is 8", "8", 0.0),  # verl's strict rule: no ####, no score
        ("openai/gsm8k", "#### 8" + " and so on" * 40, "8", 0.0),  # verl reads the last 300 characters only
        ("lighteval/MATH", r"so $x = \boxed{\frac{1}{2}}$", "0.5", 1.0),
        ("HuggingFaceH4/MATH-500", r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    ],
)
async def test_verl_default_scores_by_data_source(
    source: str, response: str, truth: str, score: float
) -> None:
    out = await compute_reward(
        "verl_default", RewardInput(response_text=response, ground_truth=truth, extra={"data_source": source})
    )
    assert out.score == score, out.metrics


async def test_verl_default_names_a_source_it_cannot_score() -> None:
    out = await compute_reward(
        "verl_default", RewardInput(response_text="x", ground_truth="1", extra={"data_source": "my/set"})
    )
    assert out.score == 0.0 and "custom_reward_function.path" in str(out.metrics["error"])


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
  val_size: 4
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
"""


def _train(cwd: Path, config: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    (cwd / "run.yaml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "run.yaml", *overrides],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=cwd,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_verl_parquet_and_compute_score_train_unchanged(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    write_gsm8k_like(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    done = _train(
        tmp_path,
        CONFIG.format(model=nano_model_dir, run_dir=tmp_path / "run", mode=mode),
        "data.train_files=[train.parquet]",
        "data.val_files=[test.parquet]",
        "custom_reward_function.path=reward.py",
        "custom_reward_function.name=compute_score",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and r.get("reward") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward"] == 0.25 for r in steps), [r["reward"] for r in steps]


def test_a_row_without_its_answer_stops_the_run_before_it_starts_naming_row_and_column(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    import pyarrow.parquet as pq

    write_gsm8k_like(tmp_path)
    table = pq.read_table(tmp_path / "train.parquet").to_pylist()
    table[5]["reward_model"]["ground_truth"] = None
    datasets.Dataset.from_list(table).to_parquet(str(tmp_path / "train.parquet"))
    done = _train(
        tmp_path,
        CONFIG.format(model=nano_model_dir, run_dir=tmp_path / "run", mode="sync"),
        "data.train_files=[train.parquet]",
        "data.val_files=[test.parquet]",
        "data.reward=verl_default",
    )
    assert done.returncode != 0
    assert "train.parquet: row 5: field 'reward_model.ground_truth': missing" in done.stderr, done.stderr[
        -2000:
    ]
    assert "Traceback" not in done.stderr


INTERACTION_PLUGIN = """\
from rlasync.agents import Interaction, register_interaction


@register_interaction("gsm8k")
class Gsm8kInteraction(Interaction):
    \"\"\"verl's GSM8K interaction's shape: it reads its row's interaction_kwargs.\"\"\"

    def __init__(self, score):
        self.score, self.turns = score, 0

    async def respond(self, messages, row):
        self.turns += 1
        kwargs = row["interaction_kwargs"]
        return self.turns > 1, f"Not quite. {kwargs['query'][:8]}: {kwargs['ground_truth']}", 0.0
"""


@pytest.mark.timeout(600)
def test_verl_rows_name_their_interaction_and_carry_their_tools_kwargs(
    tmp_path: Path, calc_model: Path
) -> None:
    """Rows as verl's ``gsm8k_multiturn_w_interaction.py`` writes them: ``agent_name: tool_agent``,
    ``extra_info.interaction_kwargs`` naming the interaction and its data, ``extra_info.tools_kwargs``
    by tool. The interaction the row names answers each trajectory with the row's own data."""
    write_gsm8k_like(tmp_path)
    for split in ("train", "test"):
        rows = datasets.Dataset.from_parquet(str(tmp_path / f"{split}.parquet")).to_list()
        for row in rows:
            # The question the calculator task's warm-started model was trained on, so that its
            # turns end (it calls the calculator, then answers): where a turn runs to its token
            # limit the trajectory ends before any interaction. Out of its distribution (verl's
            # own wording) it babbled to the limit on one CPU and stopped on another.
            i = row["extra_info"]["index"]
            question, truth = f"What is {i + 10}*{i + 20}?", str((i + 10) * (i + 20))
            row["prompt"] = [{"role": "user", "content": question}]
            row["agent_name"] = "tool_agent"
            row["extra_info"]["interaction_kwargs"] = {
                "name": "gsm8k",
                "query": question,
                "ground_truth": truth,
            }
            row["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {"ground_truth": truth}}}
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"{split}.parquet"))
    (tmp_path / "gsm8k_interaction.py").write_text(INTERACTION_PLUGIN)
    config = (
        CONFIG.format(model=calc_model, run_dir=tmp_path / "run", mode="sync")
        .replace("  val_size: 4\n", "  val_size: 4\n  trace_every: 1\n")
        .replace("max_new_tokens: 8", "max_new_tokens: 40")
    )
    done = _train(
        tmp_path,
        config + "agent:\n  tools: [calculator]\n  max_assistant_turns: 3\nplugins: [gsm8k_interaction.py]\n",
        "data.train_files=[train.parquet]",
        "data.val_files=[test.parquet]",
        "data.reward=verl_default",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    # The interaction's reply is the user turn after the prompt. What the model does with it (a
    # question it was never trained on) is not this test's concern, so no termination is required.
    answered = [t for t in traces if [m for m in t["messages"] if m["role"] == "user"][1:]]
    assert answered, [t["messages"] for t in traces]
    for trace in answered:
        question = trace["messages"][0]["content"]
        a, b = map(int, re.match(r"What is (\d+)\*(\d+)\?", question).groups())  # type: ignore[union-attr]
        said = [m["content"] for m in trace["messages"] if m["role"] == "user"][1]
        assert said == f"Not quite. {question[:8]}: {a * b}", trace
