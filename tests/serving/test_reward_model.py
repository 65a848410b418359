"""A reward model as the reward (``data.reward: {reward_model: {...}}``): a sequence-classification
network built from a config scores conversations, concurrent calls batched into few passes with
the scores one pass per conversation gives; a run trains with it; a wrong setting is named."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlasync.rewards import RewardInput, RewardModel, compute_reward, make_reward

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2ForSequenceClassification

    from rlasync.models import TinyLMConfig, build_tiny_lm

    lm, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=5))
    config = lm.config
    config.num_labels, config.pad_token_id = 1, tok.pad_token_id
    model = Qwen2ForSequenceClassification(config)
    folder = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _conversation(word: str) -> RewardInput:
    messages = [{"role": "user", "content": f"Reverse {word}"}, {"role": "assistant", "content": word[::-1]}]
    return RewardInput(response_text=word[::-1], messages=messages)


async def test_concurrent_calls_are_batched_and_score_as_alone(reward_model_dir: Path) -> None:
    words = ["abc", "dog", "moon", "tree", "lamp", "rock", "wind", "sand", "bird"]
    alone = []
    for word in words:  # one at a time: a pass each
        rm = RewardModel(path=str(reward_model_dir), score="raw")
        alone.append((await compute_reward(rm, _conversation(word))).score)
    together = RewardModel(path=str(reward_model_dir), batch_size=4, score="raw")
    outs = await asyncio.gather(*[compute_reward(together, _conversation(w)) for w in words])
    assert together.passes <= 4 < len(words)  # 9 calls at once: a first pass, then batches of 4
    # Padding changes nothing a conversation attends to (the attention mask), so only fp32 sums
    # over 64-wide layers in another order differ: a few ulps of logits near 1.
    assert [o.score for o in outs] == pytest.approx(alone, abs=1e-4)
    assert len(set(alone)) > 1  # the scores tell the conversations apart
    sig = RewardModel(path=str(reward_model_dir))
    assert 0.0 < (await compute_reward(sig, _conversation("abc"))).score < 1.0


async def test_on_a_node_of_its_own_it_batches_the_calls_of_every_caller(reward_model_dir: Path) -> None:
    from rlasync.agents.reward_server import RewardModelServer
    from rlasync.runtime import LocalCluster

    words = ["abc", "dog", "moon", "tree", "lamp", "rock", "wind", "sand", "bird"]
    here = RewardModel(path=str(reward_model_dir), score="raw")
    alone = [(await compute_reward(here, _conversation(w))).score for w in words]
    async with LocalCluster(nodes=2) as cluster:
        server = await cluster.spawn(
            RewardModelServer, {"path": str(reward_model_dir), "score": "raw", "batch_size": 4}, node=1
        )
        # The caller holds no model: it names a folder that need not exist where it runs.
        there = make_reward({"reward_model": {"path": "on-node-1", "node": 1, "served_by": server}})
        outs = await asyncio.gather(*[compute_reward(there, _conversation(w)) for w in words])
        passes = await server.passes()
    assert [o.score for o in outs] == pytest.approx(alone, abs=1e-4) and not any(o.metrics for o in outs)
    assert 0 < passes <= 4 < len(words)  # batched there, across the concurrent calls


def test_wrong_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"reward_model.path='nowhere' is not a model folder"):
        make_reward({"reward_model": {"path": "nowhere"}})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"reward_model.score: raw, sigmoid or label:<index>"):
        make_reward({"reward_model": {"path": str(tmp_path), "score": "tanh"}})
    from rlasync.compose.preflight import preflight
    from rlasync.config import ConfigError, load_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi", "ground_truth": "x"}) + "\n")
    on_node_3 = load_config(
        overrides=[
            f"data.train_files=[{rows}]",
            f"data.val_files=[{rows}]",
            f"data.reward={{reward_model: {{path: {tmp_path}, node: 3}}}}",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"data.reward.reward_model.node=3: the run has 1 node\(s\), 0 to 0"
    ):
        preflight(on_node_3)


def test_a_run_trains_on_the_reward_models_scores(
    tmp_path: Path, nano_model_dir: Path, reward_model_dir: Path
) -> None:
    rows = "".join(
        json.dumps({"prompt": f"Reverse {w}", "ground_truth": w[::-1]}) + "\n"
        for w in ["abc", "dog", "moon", "tree"]
    )
    (tmp_path / "rows.jsonl").write_text(rows)
    config = f"""\
train:
  model_dir: {nano_model_dir}
  run_dir: {tmp_path / "run"}
  steps: 2
  prompts_per_step: 2
  group_size: 4
  max_new_tokens: 8
  validate_every: 1000
  val_size: 2
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
data:
  train_files: [rows.jsonl]
  val_files: [rows.jsonl]
  reward: {{reward_model: {{path: "{reward_model_dir}", score: sigmoid, node: 1}}}}
cluster:
  nodes: 2     # node 1 runs the reward model alone, for the agent loops on node 0
"""
    (tmp_path / "run.yaml").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "run.yaml"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 < r["reward"] < 1.0 and r["reward/errors"] == 0 for r in steps)  # sigmoids of logits
