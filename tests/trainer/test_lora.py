"""LoRA on the trainer (``trainer.lora``, peft): only the adapters train; engines get the merged
model under the base model's names (the same merge peft's own ``merge_and_unload`` makes);
checkpoints hold the merged model and the adapter in PEFT's format and resume onto the base;
two ranks (DDP, FSDP2) take the one-rank step; a run from YAML trains and resumes with it."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from numerics import assert_same_sgd_step, step_rtol
from test_packing import long_tailed

from rlasync.config import TrainerConfig, load_config
from rlasync.config.train import LoraSettings
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir
from rlasync.modes import train
from rlasync.trainer import PolicyTrainer, TrainerActor

peft = pytest.importorskip("peft", reason="needs peft: pip install 'rlasync[lora]'")

LORA = LoraSettings(rank=4, alpha=8)
CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _model() -> Any:
    return build_tiny_lm(TinyLMConfig.preset("nano", seed=1))[0]


def test_only_adapters_train_and_engines_get_the_model_peft_would_merge(tmp_path: Path) -> None:
    base = _model()
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    trainer = PolicyTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-2, lora=LORA))
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    first = trainer.weights()
    assert all(torch.equal(first[k], start[k]) for k in start)  # B starts at zero: the base, bit for bit
    trainer.step(long_tailed())
    merged = trainer.weights()
    assert set(merged) == set(start)  # the base model's names: what every engine loads
    changed = {k for k in start if not torch.equal(merged[k], start[k])}
    adapted = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert changed and all(k.endswith(".weight") and k.split(".")[-2] in adapted for k in changed)
    trainer.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").is_file()
    theirs = peft.PeftModel.from_pretrained(
        copy.deepcopy(base), tmp_path / "ckpt" / "adapter"
    ).merge_and_unload()
    for name, p in theirs.named_parameters():  # peft's own merge of the saved adapter
        assert torch.equal(p.detach(), merged[name]), name
    served, _ = load_pretrained_dir(tmp_path / "ckpt" / "model")  # the merged model, as any model folder
    for name, p in served.named_parameters():
        assert torch.equal(p.detach(), merged[name]), name


def test_a_checkpoint_resumes_onto_the_base_and_takes_the_same_next_step(tmp_path: Path) -> None:
    base, batch = _model(), long_tailed(seed=1)
    config = TrainerConfig(lr=1e-2, lora=LORA)
    first = PolicyTrainer(copy.deepcopy(base), config)
    first.step(batch)
    first.save(tmp_path / "ckpt")
    again = PolicyTrainer(copy.deepcopy(base), config)
    again.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(first.weights().values(), again.weights().values()))
    follow = long_tailed(seed=2)
    assert first.step(follow)["loss"] == again.step(follow)["loss"]  # AdamW's state came along
    assert all(torch.equal(a, b) for a, b in zip(first.weights().values(), again.weights().values()))


def test_a_checkpoint_refuses_to_resume_onto_another_base(tmp_path: Path) -> None:
    """Adapters trained on one base mean nothing on another: the merged model the checkpoint
    holds names the weight that differs (here the embeddings of a tiny model of another seed)."""
    config = TrainerConfig(lr=1e-2, lora=LORA)
    first = PolicyTrainer(_model(), config)
    first.step(long_tailed(seed=1))
    first.save(tmp_path / "ckpt")
    other = PolicyTrainer(build_tiny_lm(TinyLMConfig.preset("nano", seed=2))[0], config)
    with pytest.raises(
        ValueError, match=r"trained on another base model: its model\.embed_tokens\.weight differs"
    ):
        other.load(tmp_path / "ckpt")
    assert other.steps == 0  # nothing of the checkpoint was taken


def test_the_kl_reference_of_a_lora_trainer_is_its_base_not_a_copy() -> None:
    base, batch = _model(), long_tailed(seed=4)
    plain = PolicyTrainer(copy.deepcopy(base), TrainerConfig(kl_coef=0.1))
    adapted = PolicyTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-2, kl_coef=0.1, lora=LORA))
    assert adapted.reference is None  # no second model in memory
    for _ in range(2):
        metrics = adapted.step(batch)
    assert metrics["kl_ref"] > 0  # the adapters moved the policy off its start
    assert torch.equal(adapted.reference_logprobs(batch), plain.reference_logprobs(batch))


def test_a_missing_peft_or_an_unknown_layer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlasync.compose.preflight import preflight
    from rlasync.config import ConfigError

    with pytest.raises(ValueError, match=r"trainer.lora: .*no_such_proj"):
        PolicyTrainer(_model(), TrainerConfig(lora=LoraSettings(rank=2, target_modules=["no_such_proj"])))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"trainer.lora needs the peft package: pip install 'rlasync\[lora\]'"
    ):
        preflight(load_config(CONFIG, ["trainer.lora.rank=4"]))
    with pytest.raises(ValueError, match=r"pip install 'rlasync\[lora\]'"):
        PolicyTrainer(_model(), TrainerConfig(lora=LORA))


@pytest.mark.numerics
@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
async def test_two_ranks_take_the_one_rank_lora_step(nano_model_dir: Path, strategy: str) -> None:
    """Plain SGD of lr 1 writes the summed adapter gradients into the adapters, so the merged
    weights of two ranks and of one differ by the rounding of those gradients only, through B A."""
    batch = long_tailed(size=7, seed=3)
    sgd = {"optimizer": "sgd", "lr": 1.0, "lora": LORA, "micro_batch_size": 2}
    local = PolicyTrainer(load_pretrained_dir(nano_model_dir)[0], TrainerConfig(**sgd))
    local.step(batch)  # B is zero at the start: one step moves B only (A's gradient is B's times 0)
    async with TrainerActor(TrainerConfig(world_size=2, strategy=strategy, **sgd)) as trainer:  # type: ignore[arg-type]
        await trainer.start(nano_model_dir)
        await trainer.step(batch)
        distributed = await trainer.weights()
    start = {n: p.detach() for n, p in load_pretrained_dir(nano_model_dir)[0].named_parameters()}
    sequence = int(batch.attention_mask.shape[1])
    rtol = step_rtol(local.model.config, tokens=int(batch.attention_mask.sum()), sequence=sequence)
    mine = local.weights()
    moved = {k for k in start if not torch.equal(mine[k], start[k])}
    assert moved and all(torch.equal(distributed[k], start[k]) for k in set(start) - moved)  # frozen
    assert_same_sgd_step(
        {k: start[k] for k in moved}, distributed, {k: mine[k] for k in moved}, lr=1.0, rtol=rtol
    )


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_lora_run_from_yaml_trains_checkpoints_and_resumes(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    overrides = [
        f"train.model_dir={nano_model_dir}",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=16",
        "train.val_size=8",
        "train.validate_every=100",
        "train.steps=3",
        "train.checkpoint_every=2",
        "trainer.lr=1e-3",
        "trainer.lora.rank=4",
    ]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    await train(load_config(CONFIG, [*overrides, f"train.run_dir={whole}"]))
    step_2 = whole / "checkpoints" / "step_000002"
    assert (step_2 / "adapter" / "adapter_model.safetensors").is_file() and (
        step_2 / "model" / "config.json"
    ).is_file()
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000003")
    await train(load_config(CONFIG, [*overrides, f"train.run_dir={cut}"]), resume=True)
    expected, resumed = (
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (whole, cut)
    )
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[3]["reward"] == expected[3]["reward"]  # the same model after the resume: the same samples
    _exports(load_config(CONFIG, [*overrides, f"train.run_dir={whole}"]), whole, nano_model_dir, tmp_path)


def _exports(config: Any, run: Path, base: Path, tmp_path: Path) -> None:
    """``rlasync export``: the adapter in PEFT's format pointing at the base, and with ``--merge``
    the base with peft's merge of it, which is the model the checkpoint serves, bit for bit."""
    from typer.testing import CliRunner

    from rlasync.cli import app
    from rlasync.compose.export import export_checkpoint
    from rlasync.config import ConfigError

    newest = run / "checkpoints" / "step_000003"
    adapter = export_checkpoint(config, "newest", tmp_path / "adapter")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(base.resolve()) and settings["r"] == 4
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer_config.json").is_file()
    merged = tmp_path / "merged"
    done = CliRunner().invoke(
        app,
        [
            "export",
            str(CONFIG),
            f"train.run_dir={run}",
            f"train.model_dir={base}",
            "--merge",
            "--out",
            str(merged),
        ],
    )
    assert done.exit_code == 0, done.output
    theirs, served = load_pretrained_dir(merged)[0], load_pretrained_dir(newest / "model")[0]
    expected = dict(served.named_parameters())
    for name, p in theirs.named_parameters():
        assert torch.equal(p, expected[name]), name
    with pytest.raises(ConfigError, match="exists: remove it"):
        export_checkpoint(config, "newest", merged, merge=True)
    with pytest.raises(ConfigError, match="no such folder"):
        export_checkpoint(config, str(tmp_path / "nowhere"), tmp_path / "other")
