"""The trainer agrees with the engine, and synchronous GRPO runs end to end."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from numerics import forward_rtol, rounding_close, step_rtol
from safetensors.torch import load_file

from rlasync.agents import SingleTurnAgentLoop, collate
from rlasync.algorithms import grpo_advantages
from rlasync.config import ConfigError, TrainerConfig, load_config
from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir
from rlasync.modes import train_sync
from rlasync.trainer import PolicyTrainer, TrainBatch

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
ROWS = [{"messages": [{"role": "user", "content": f"Reverse {w}"}]} for w in ("abc", "hgfe", "dd", "bcad")]


async def _rollouts(engine: Any, tok: Any, n: int) -> list[Any]:
    params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=1)
    loops = [SingleTurnAgentLoop(engine, tok, trajectory_id=f"t{i}") for i in range(n)]
    return [await loop.run(params, **ROWS[i % len(ROWS)]) for i, loop in enumerate(loops)]


@pytest.mark.numerics
async def test_the_trainer_recomputes_the_engines_logprobs_so_the_first_ratio_is_one() -> None:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=5))
    serving, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=5))
    engine = TorchEngine(serving)
    batch = collate(await _rollouts(engine, tok, 8), pad_token_id=0)
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2, micro_batch_size=3))
    fresh = trainer.compute_logprobs(TrainBatch.from_rollout(batch), temperature=0.9)
    mask = batch.response_mask.bool()
    # Same positions (real tokens only), same temperature: the engine's behaviour logprobs, up to
    # the rounding of a forward taken in another order (batched, KV-cached decode against one
    # padded forward of each micro-batch).
    rtol = forward_rtol(model.config, sequence=batch.attention_mask.shape[1])
    assert rounding_close(fresh[mask], batch.logprobs[mask], rtol)
    advantages = grpo_advantages(torch.arange(8, dtype=torch.float32), 4)
    metrics = trainer.step(TrainBatch.from_rollout(batch, advantages), temperature=0.9)
    # Each ratio is exp(new - old) with |new - old| within that rounding of the logprobs' scale.
    drift = rtol * float(batch.logprobs[mask].abs().max())
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=math.expm1(drift)) and metrics["grad_norm"] > 0
    assert metrics["ratio_min"] <= 1.0 <= metrics["ratio_max"] and metrics["tokens"] == float(
        batch.response_mask.sum()
    )
    after = trainer.compute_logprobs(TrainBatch.from_rollout(batch), temperature=0.9)
    # The step moved probability toward the positive-advantage samples.
    gain = ((after - fresh) * mask).sum(-1) / mask.sum(-1)
    assert float((gain * advantages).sum()) > 0
    await engine.update_weights(trainer.weights(), version=1)
    assert engine.weight_version == 1
    await engine.close()


@pytest.mark.numerics
async def test_the_kl_penalty_holds_the_policy_near_its_frozen_reference() -> None:
    model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=5))
    serving, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=5))
    engine = TorchEngine(serving)
    batch = TrainBatch.from_rollout(collate(await _rollouts(engine, tok, 8), pad_token_id=0))
    await engine.close()
    batch.advantages = grpo_advantages(torch.arange(8, dtype=torch.float32), 4)
    reference_before = None
    drift = {}
    for coef in (0.0, 5.0):
        trainer = PolicyTrainer(
            build_tiny_lm(TinyLMConfig.preset("nano", seed=5))[0],
            TrainerConfig(lr=1e-2, kl_coef=coef or 1e-9),
        )
        reference_before = trainer.reference_logprobs(batch, temperature=0.9)
        first = trainer.step(batch, temperature=0.9)
        # Policy == reference at first: the same weights through the same forward in this
        # process, so equal logprobs (k3(d) = e^d - d - 1 = 0), or, were a kernel to differ
        # between the grad and no-grad forwards, d within a forward's rounding of |logprob| <= ~10:
        # k3 ~ d^2 / 2 <= (1.8e-4 * 10)^2 / 2 = 1.6e-6.
        assert first["kl_ref"] == pytest.approx(0.0, abs=2e-6) and first["entropy"] > 0
        trainer.config = msgspec.structs.replace(trainer.config, kl_coef=coef)
        for _ in range(4):
            last = trainer.step(batch, temperature=0.9)
        assert torch.equal(trainer.reference_logprobs(batch, temperature=0.9), reference_before)  # frozen
        drift[coef] = last["kl_ref"]
    assert 0 < drift[5.0] < drift[0.0]  # the penalty keeps the policy closer to the reference


def _short_run(run_dir: Path, model: Path, *more: str) -> list[str]:
    return [
        "train.steps=3",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.val_size=16",
        "train.validate_every=2",
        f"train.run_dir={run_dir}",
        "train.max_new_tokens=20",
        f"train.model_dir={model}",
        *more,
    ]


async def test_a_short_sync_run_writes_its_run_directory(tmp_path: Path, reverse_model: Path) -> None:
    overrides = _short_run(tmp_path, reverse_model)
    config = load_config(CONFIG, overrides)
    result = await train_sync(config)
    assert result.steps == 3 and 0.0 <= result.initial_accuracy <= 1.0 and 0.0 <= result.final_accuracy <= 1.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "val_accuracy" in records[0] and "val_accuracy" in records[2] and "val_accuracy" in records[3]
    # On-policy: each ratio is exp(d), d the engine's and the trainer's rounding of one logprob:
    # |d| <= 1.8e-4 |logprob| (numerics.forward_rtol of the nano model), so the mean ratio is
    # within 1.8e-4 * mean |logprob| of 1, and the mean |logprob| of sampled tokens estimates
    # the policy's entropy (train/entropy, under 3 here): 1e-3 leaves room for a batch of rare tokens.
    assert all(r["train/entropy"] < 3 for r in records[1:])
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3) for r in records[1:])
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 3
    assert records[3]["checkpoint"].endswith("step_000003")  # the last step always saves
    model, tok = load_pretrained_dir(Path(records[3]["checkpoint"]) / "model")  # a complete HF folder
    assert tok.pad_token_id is not None and sum(p.numel() for p in model.parameters()) > 0


# 64 samples a step: with the warm-start's sampled accuracy (~0.1) some groups are mixed.
RESUME = (
    "train.checkpoint_every=2",
    "train.validate_every=100",
    "train.prompts_per_step=8",
    "train.group_size=8",
)


async def test_resume_reproduces_the_uninterrupted_runs_next_step(
    tmp_path: Path, reverse_model: Path
) -> None:
    whole = tmp_path / "whole"
    await train_sync(load_config(CONFIG, _short_run(whole, reverse_model, *RESUME)))
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    # Interrupted after step 2: the same run directory, without what came after the checkpoint.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000003")
    config = load_config(CONFIG, _short_run(cut, reverse_model, *RESUME))
    await train_sync(config, resume=True)
    expected = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert expected[3]["train/grad_norm"] > 0  # the groups were mixed: the step did something
    for key in ("reward", "response_tokens", "train/lr"):  # seeded samples, a schedule: exact
        assert resumed[3][key] == expected[3][key], key
    # The engine batches requests as they arrive, so the two runs' behaviour logprobs can differ
    # by a forward's rounding, and the step's figures by a training step's (numerics.step_rtol).
    model_config = load_pretrained_dir(reverse_model)[0].config
    rtol = step_rtol(model_config, tokens=64 * 48, sequence=48)
    for key in ("train/loss", "train/grad_norm", "train/ratio_mean"):
        assert resumed[3][key] == pytest.approx(expected[3][key], rel=rtol, abs=rtol), key
    # And the parameters after that step (saved in both runs' last checkpoint), from the same
    # step-2 checkpoint: one AdamW update of at most lr in either direction per weight, whatever
    # rounding did to a near-zero gradient, so they agree to 2 lr (plus a weight's spacing).
    after = [
        load_file(str(run / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
        for run in (whole, cut)
    ]
    bound = 2 * expected[3]["train/lr"] + 1e-6
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in after[0]) <= bound


async def test_resume_skips_a_torn_or_corrupt_checkpoint_naming_it(
    tmp_path: Path, reverse_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rlasync.trainer.checkpoint import CheckpointError, Checkpoints, verify

    overrides = _short_run(
        tmp_path,
        reverse_model,
        "train.steps=2",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=3",
        "train.validate_every=100",
    )
    await train_sync(load_config(CONFIG, overrides))
    first, second = tmp_path / "checkpoints" / "step_000001", tmp_path / "checkpoints" / "step_000002"
    manifest = json.loads((second / "manifest.json").read_text())["files"]
    assert {"state.json", "optimizer.pt", "model/model.safetensors", "model/config.json"} <= set(
        manifest
    ) and not verify(second)
    weights = second / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of the newest: its size is right, its contents are not
    weights.write_bytes(bytes(data))
    shutil.copytree(
        first, tmp_path / "checkpoints" / "step_000003.partial"
    )  # a save cut short: never a candidate
    with caplog.at_level("WARNING", logger="rlasync.trainer.checkpoint"):
        assert Checkpoints(tmp_path, keep=3).latest() == first
    assert any(
        "step_000002 is torn or corrupt (model/model.safetensors does not match its checksum)"
        in r.getMessage()
        for r in caplog.records
    )
    await train_sync(load_config(CONFIG, overrides), resume=True)  # from step 1: step 2 again, saved whole
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2 and not verify(
        second
    )
    (first / "optimizer.pt").unlink()  # and torn: a file missing
    assert verify(first) == "optimizer.pt is missing"
    weights.write_bytes(weights.read_bytes()[:-10])  # the newest cut short too
    assert "bytes, the manifest says" in verify(second)
    with pytest.raises(CheckpointError, match="every checkpoint .* is torn or corrupt"):
        Checkpoints(tmp_path, keep=3).latest()


def test_a_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = build_tiny_lm(TinyLMConfig.preset("nano", seed=6))[0]
    PolicyTrainer(model, TrainerConfig(lr=1e-2)).save(tmp_path)
    (tmp_path / "model" / "model.safetensors").unlink()
    model.save_pretrained(
        tmp_path / "model", max_shard_size="300KB"
    )  # shards and an index, as large models are saved
    assert len(list((tmp_path / "model").glob("model-*-of-*.safetensors"))) > 1
    fresh = PolicyTrainer(build_tiny_lm(TinyLMConfig.preset("nano", seed=7))[0], TrainerConfig(lr=1e-2))
    fresh.load(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_taken_for_the_background_is_a_copy_in_the_distributed_layout(tmp_path: Path) -> None:
    """``state_to_save`` of a whole model is what ``torch.distributed.checkpoint`` gives (names,
    groups, values), as copies: a step taken while it is written changes nothing in it."""
    from torch.distributed.checkpoint import state_dict as dcp

    trainer = PolicyTrainer(build_tiny_lm(TinyLMConfig.preset("nano", seed=6))[0], TrainerConfig(lr=1e-2))
    ids = torch.randint(0, 100, (2, 16))
    trainer.model(ids).logits.sum().backward()
    trainer.optimizer.step()
    taken = trainer.state_to_save()
    assert taken is not None
    full = dcp.StateDictOptions(full_state_dict=True)
    model, optimizer = (
        dcp.get_model_state_dict(trainer.model, options=full),
        dcp.get_optimizer_state_dict(trainer.model, trainer.optimizer, options=full),
    )
    assert list(taken["model"]) == list(model) and all(
        torch.equal(taken["model"][k], v) for k, v in model.items()
    )
    assert taken["optimizer"]["param_groups"] == optimizer["param_groups"] and list(
        taken["optimizer"]["state"]
    ) == list(optimizer["state"])
    before = {k: v.clone() for k, v in taken["model"].items()}
    trainer.model(ids).logits.sum().backward()
    trainer.optimizer.step()  # training goes on while the checkpoint is written
    assert all(torch.equal(before[k], taken["model"][k]) for k in before) and not torch.equal(
        before["model.embed_tokens.weight"], model["model.embed_tokens.weight"]
    )
    trainer.write_saved(tmp_path, taken)
    fresh = PolicyTrainer(build_tiny_lm(TinyLMConfig.preset("nano", seed=7))[0], TrainerConfig(lr=1e-2))
    fresh.load(tmp_path)
    assert all(torch.equal(before[name], p) for name, p in fresh.model.named_parameters())


def test_resume_without_a_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "train", str(CONFIG), f"train.run_dir={tmp_path}", "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no complete checkpoint" in lines[0] and "checkpoint_every" in lines[0], (
        done.stderr
    )


@pytest.mark.parametrize(("override", "needle"), [("trainer.lr=abc", "trainer.lr"), ("trainer.lrr=1", "lrr")])
def test_a_config_typo_is_a_one_line_error_naming_the_key(override: str, needle: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "configs/quickstart.yaml", override],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], done.stderr


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([], "train.model_dir=/nonexistent is not a model folder"),
        (
            ["train.task=calc"],
            "neither agent.tools nor agent.mcp_servers provide",
        ),  # calc rows offer the calculator
        (["data.train_files=[x.jsonl]"], "data.val_files"),
        (["data.val_files=[x.jsonl]"], "data.val_files is set but data.train_files is not"),
        (["train.val_size=100000"], "train.val_size=100000: the reverse task has"),
    ],
)
async def test_a_run_that_cannot_work_fails_before_it_starts(
    tmp_path: Path, overrides: list[str], needle: str
) -> None:
    config = load_config(CONFIG, [f"train.run_dir={tmp_path}", "train.model_dir=/nonexistent", *overrides])
    with pytest.raises(ConfigError, match=needle):
        await train_sync(config)


async def test_a_run_whose_rewards_all_fail_stops_and_failed_rewards_are_counted(
    tmp_path: Path, reverse_model: Path
) -> None:
    from rlasync.data import synthetic_rows
    from rlasync.rewards import RewardError, RewardInput, register_reward

    @register_reward("broken_for_test", replace=True)
    def broken(inp: RewardInput) -> float:
        raise ZeroDivisionError("the reward's own bug")

    for split, n in (("train", 16), ("val", 4)):
        rows = synthetic_rows("reverse", n, seed=0, split=split)  # type: ignore[arg-type]
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(
                json.dumps({"prompt": r["messages"][-1]["content"], "answer": r["ground_truth"]}) + "\n"
                for r in rows
            )
        )
    files = [
        f"data.train_files=[{tmp_path}/train.jsonl]",
        f"data.val_files=[{tmp_path}/val.jsonl]",
        "data.reward=broken_for_test",
    ]
    with pytest.raises(
        RewardError,
        match=r"every reward of training batch 1 failed .*ZeroDivisionError.*train.fail_on_reward_errors=0",
    ):
        await train_sync(
            load_config(CONFIG, _short_run(tmp_path / "a", reverse_model, "train.steps=2", *files))
        )
    config = load_config(
        CONFIG,
        _short_run(tmp_path / "b", reverse_model, "train.steps=2", "train.fail_on_reward_errors=0", *files),
    )
    await train_sync(config)  # told to train on: it does, and counts what failed
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["reward/errors"] == 2 * config.train.prompts_per_step * config.train.group_size


async def test_training_rows_come_from_files_with_their_own_reward(
    tmp_path: Path, reverse_model: Path
) -> None:
    """JSONL rows (a prompt column, an answer column) instead of the synthetic task."""
    from rlasync.data import synthetic_rows

    for split, n in (("train", 32), ("val", 8)):
        rows = synthetic_rows("reverse", n, seed=0, split=split)  # type: ignore[arg-type]
        lines = [
            json.dumps({"question": r["messages"][-1]["content"], "answer": r["ground_truth"]}) for r in rows
        ]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    overrides = _short_run(
        tmp_path / "run",
        reverse_model,
        "train.steps=1",
        f"data.train_files=[{tmp_path}/train.jsonl]",
        f"data.val_files=[{tmp_path}/val.jsonl]",
        "data.prompt_key=question",
        "data.answer_key=answer",
    )
    result = await train_sync(load_config(CONFIG, overrides))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 1 and records[0]["step"] == 0 and records[1]["response_tokens"] > 0
    assert 0.0 <= result.final_accuracy <= 1.0
