"""What a user adds from a YAML file, through ``rlasync train``: plugins (their loop and reward
run on another node), a simulated user (``agent.interaction``), and the filters and corrections
(dynamic sampling, the overlong penalty, rejection sampling), each seen in ``metrics.jsonl``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
# Each test is one or two short runs (300 s deadline each); the first to ask for reverse_model
# also builds it.
pytestmark = pytest.mark.timeout(600)

PLUGIN = '''\
"""A user's plugin: a reward and a loop, registered when rlasync imports this file."""
from rlasync.agents import SingleTurnAgentLoop, register
from rlasync.rewards import register_reward


@register_reward("quarter")
def quarter(inp):
    return 0.25


@register("tagged")
class Tagged(SingleTurnAgentLoop):
    async def run(self, params, **row):
        trajectory = await super().run(params, **row)
        trajectory.termination = "tagged"  # seen per step in rollout/termination/tagged
        return trajectory
'''

BASE = """\
train:
  model_dir: {model}
  run_dir: {run_dir}
  steps: {steps}
  prompts_per_step: 4
  group_size: 4
  max_new_tokens: 12
  validate_every: 1000
  val_size: 8
  trace_every: 1
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
data:
  synthetic_train_size: 64
"""


def _train(cwd: Path, config: str, *args: str) -> subprocess.CompletedProcess[str]:
    (cwd / "run.yaml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "run.yaml", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > 0]


def test_a_plugin_file_adds_the_reward_and_the_loop_a_cluster_run_uses_on_its_engine_node(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    (tmp_path / "rows.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"Reverse {w}", "ground_truth": w[::-1]}) + "\n"
            for w in ["abc", "dog", "xyz", "moon"]
        )
    )
    config = BASE.format(model=nano_model_dir, run_dir=tmp_path / "run", steps=2) + (
        "  train_files: [rows.jsonl]\n"
        "  val_files: [rows.jsonl]\n"
        "  reward: quarter\n"
        "agent:\n"
        "  default_loop: tagged\n"
        "cluster:\n"  # the loops run on node 1, a process of its own: it imported the plugin too
        "  engines: [1]\n"
        "  trainer: [0]\n"
        "  agent_loops: engines\n"
    )
    done = _train(tmp_path, config, "--plugin", "./my_plugin.py")  # relative to where rlasync runs
    assert done.returncode == 0, done.stderr[-3000:]
    assert "agent loops next to their engines" in done.stderr
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["reward"] == 0.25 and r["rollout/termination/tagged"] == 1.0 for r in records), records


LOGGING_REWARD = '''\
"""Scores nothing; writes each held-out answer (rows of kind val) to answers.jsonl."""
import json
from rlasync.rewards import register_reward


@register_reward("log_val")
def log_val(inp):
    if inp.extra.get("kind") == "val":
        with open("answers.jsonl", "a") as f:
            f.write(json.dumps([inp.ground_truth, inp.response_text]) + "\\n")
    return 0.0
'''


def test_validation_samples_val_samples_answers_per_held_out_row_at_val_temperature(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    """verl's ``val_kwargs``: 3 held-out rows x ``val_samples`` 4 answers, at the first and the
    last step's validation, sampled (an untrained model at temperature 1 does not repeat itself
    four times on every row)."""
    (tmp_path / "log_val.py").write_text(LOGGING_REWARD)
    words = ["abc", "dog", "xyz"]
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(
                json.dumps({"prompt": f"Reverse {w}", "ground_truth": w[::-1], "kind": split}) + "\n"
                for w in words
            )
        )
    config = BASE.format(model=nano_model_dir, run_dir=tmp_path / "run", steps=1) + (
        "  train_files: [train.jsonl]\n  val_files: [val.jsonl]\n  reward: log_val\nplugins: [./log_val.py]\n"
    )
    done = _train(tmp_path, config, "train.val_temperature=1.0", "train.val_samples=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validation accuracy (4 sampled at temperature 1, held-out)" in done.stdout, done.stdout
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 * 3 * 4, answers  # step 0 and step 1, every row four times
    by_row = {w[::-1]: [a for truth, a in answers if truth == w[::-1]] for w in words}
    assert all(len(a) == 8 for a in by_row.values()), by_row
    assert any(len(set(a)) > 1 for a in by_row.values()), by_row  # sampled, not greedy


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (
            "./missing_plugin.py",
            "missing_plugin.py': no such file (a relative path is taken from the directory rlasync runs in)",
        ),
        ("no_such_package.rl", "plugin 'no_such_package.rl': no module named 'no_such_package'"),
        (
            "./broken.py",
            "broken.py' failed while importing: ZeroDivisionError: division by zero (/",
        ),
    ],
)
def test_a_plugin_that_does_not_import_stops_the_run_with_one_line(
    tmp_path: Path, nano_model_dir: Path, plugin: str, message: str
) -> None:
    (tmp_path / "broken.py").write_text("x = 1\ny = x / 0\n")
    config = BASE.format(model=nano_model_dir, run_dir=tmp_path / "run", steps=1) + f"plugins: [{plugin}]\n"
    done = _train(tmp_path, config)
    assert done.returncode == 2, done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_simulated_user_makes_the_model_try_again_in_an_async_run_with_rejection_sampling(
    tmp_path: Path, reverse_model: Path
) -> None:
    """The retry interaction answers every wrong answer once (max_attempts 2): a wrong first
    answer gets the feedback as a user turn and a second try, rewarded on its final answer."""
    run_dir = tmp_path / "run"
    config = BASE.format(model=reverse_model, run_dir=run_dir, steps=3) + (
        "agent:\n"
        "  default_loop: tool\n"
        "  interaction: {name: retry, max_attempts: 2, feedback: Wrong. Try again.}\n"
        "async_training:\n"
        "  rollout_rs: token\n"
        "  rollout_rs_threshold: 1.5\n"
    )
    done = _train(tmp_path, config, "train.mode=fully_async", "train.trace_samples=16")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(run_dir)
    assert len(records) == 3
    assert sum(r.get("rollout/termination/interaction", 0.0) for r in records) > 0, records
    assert any(r["rollout/turns_max"] == 4 for r in records), records  # prompt, answer, feedback, answer
    assert all("train/offpolicy/rejected_token_frac" in r for r in records), records[0]
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    retried = [t for t in traces if any(m.get("content") == "Wrong. Try again." for m in t["messages"])]
    assert retried, traces[:2]
    for t in retried:  # the feedback is the user's turn, between two of the model's
        roles = [m["role"] for m in t["messages"]]
        assert roles[-3:] == ["assistant", "user", "assistant"], roles


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_dynamic_sampling_trains_only_groups_with_signal_and_long_responses_lose_reward(
    tmp_path: Path, reverse_model: Path, mode: str
) -> None:
    run_dir = tmp_path / "run"
    config = BASE.format(model=reverse_model, run_dir=run_dir, steps=3) + (
        "agent:\n  response_length: 12\n  default_loop: single_turn\n"
    )
    done = _train(
        tmp_path,
        config,
        f"train.mode={mode}",
        "train.dynamic_sampling=true",
        "train.max_gen_batches=3",
        "train.overlong_buffer=4",
        "train.overlong_penalty=0.5",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(run_dir)
    for r in records:
        assert 1 <= r["rollout/gen_batches"] <= 3
        rolled = 4 * r["rollout/gen_batches"]
        assert r["rollout/dropped_groups"] == rolled - len(r["data/rows"]), r
        assert len(r["data/rows"]) == 4 or r["rollout/gen_batches"] == 3, r
        assert -0.5 <= r["rollout/overlong_penalty"] <= 0.0
    assert any(r["rollout/dropped_groups"] > 0 for r in records), (
        records
    )  # the warm-start's groups: 44 % mixed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agent.interaction=retry"], "agent.interaction needs a loop that talks with a simulated user"),
        (
            ["agent.default_loop=tool", "agent.interaction=nagging"],
            "agent.interaction: no entry named 'nagging' (registered: retry; register yours with @rlasync.agents.register_interaction",
        ),
        (
            ["agent.default_loop=tool", "agent.interaction={name: retry, max_attempts: 0}"],
            "agent.interaction 'retry': max_attempts must be at least 1, got 0",
        ),
        (
            ["train.mode=fully_async", "train.dynamic_sampling=true"],
            "train.dynamic_sampling runs with train.mode=sync or one_step_off, not fully_async",
        ),
        (
            ["train.val_samples=4"],
            "train.val_samples=4 with train.val_temperature=0: greedy answers are all the same",
        ),
        (
            ["train.overlong_buffer=2000"],
            "train.overlong_buffer=2000 is longer than agent.response_length=1024",
        ),
    ],
)
def test_a_wrong_setting_stops_the_run_before_it_starts(
    tmp_path: Path, nano_model_dir: Path, overrides: list[str], message: str
) -> None:
    done = _train(tmp_path, BASE.format(model=nano_model_dir, run_dir=tmp_path / "run", steps=1), *overrides)
    assert done.returncode == 2, done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_generator_adds_harder_rows_that_later_epochs_train_on_and_a_resumed_run_keeps_them(
    tmp_path: Path, reverse_model: Path
) -> None:
    """``rising_difficulty`` with ``pass_reward: 0`` (every sample counts as passed, so each
    window of 4 trained rows adds rows): 8 rows of 7 letters after step 1, 8 of 8 letters after
    step 2, then no more (max_length 8). Epoch 2 (steps 3-4) draws from all 24 rows."""
    run_dir = tmp_path / "run"
    generator = "{name: rising_difficulty, threshold: 1.0, window: 4, batch: 8, start_length: 7, max_length: 8, pass_reward: 0.0}"
    config = BASE.format(model=reverse_model, run_dir=run_dir, steps=4).replace(
        "synthetic_train_size: 64", f"synthetic_train_size: 8\n  generator: {generator}"
    )
    done = _train(tmp_path, config, "train.checkpoint_every=2", "train.max_new_tokens=16")
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "state.json").read_text())
    made = state["generator"]["rows"]
    assert state["generator"]["state"]["length"] == 8 and len(made) == 16
    assert sorted(len(row["ground_truth"]) for row in made) == [7] * 8 + [8] * 8
    records = _records(run_dir)
    first_epoch = {i for r in records[:2] for _, i in r["data/rows"]}
    second_epoch = {i for r in records[2:] for _, i in r["data/rows"]}
    assert first_epoch == set(range(8)) and max(second_epoch) >= 8, (first_epoch, second_epoch)
    assert state["sampler"]["num_rows"] == 24

    resumed = _train(tmp_path, config.replace("steps: 4", "steps: 6"), "--resume", "train.max_new_tokens=16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((run_dir / "checkpoints" / "step_000006" / "state.json").read_text())
    assert after["generator"]["rows"] == made and after["sampler"]["num_rows"] == 24
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 7))
