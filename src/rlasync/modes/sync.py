"""Synchronous GRPO, the baseline the asynchronous modes are measured against.

Each step, in order:

1. sample ``prompts_per_step`` training rows (``data.*``: files, or the synthetic task), each
   ``group_size`` times;
2. roll them out with the agent loops on the engine (the policy's current weights);
3. score them (the task's reward), and turn rewards into group-relative advantages;
4. one optimiser step on the batch (on-policy: the PPO ratio starts at 1);
5. push the new weights to the engine (``rlasync.weights``: a bucketed broadcast from the
   trainer's rank 0 into a staging copy, then a swap);
6. every ``validate_every`` steps, score held-out problems greedily;
7. every ``checkpoint_every`` steps (and after the last), save a checkpoint to resume from.

The trainer is a ``TrainerActor``: ``trainer.world_size`` data-parallel rank processes.

    result = await train_sync(load_config("configs/quickstart.yaml"))
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from ..agents import collate, get_loop, registered_reward
from ..algorithms import grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from ..config import Config, ConfigError
from ..data import Row, RowSampler, load_rows, synthetic_rows
from ..data.synthetic import loop_reward, synthetic_capacity
from ..engines import SamplingParams, build_engine
from ..models.tiny import load_tokenizer
from ..models.warmstart import DEFAULT_SETTINGS, warm_start
from ..tools import build_tools
from ..trainer import TrainBatch, TrainerActor
from ..trainer.checkpoint import Checkpoints, read_state
from ..weights import ParameterSynchronizer

log = logging.getLogger(__name__)


class TrainResult(msgspec.Struct, kw_only=True):
    initial_accuracy: float
    final_accuracy: float
    steps: int
    wall_s: float


class _Rollouts:
    """The agent loops on one engine: each row's loop (its ``agent_name``, else
    ``agent.default_loop``), the configured tools, and the run's reward."""

    def __init__(self, config: Config, engine: Any, tokenizer: Any, tools: dict[str, Any]) -> None:
        # ``engine``: an Engine (``build_engine``), which the loops call as their generator.
        synthetic = not config.data.train_files
        self.reward = loop_reward(config.train.task) if synthetic else registered_reward(config.data.reward)
        self.engine, self.tokenizer, self.agent, self.tools = engine, tokenizer, config.agent, tools

    async def run(self, rows: list[Row], params: SamplingParams, *, name: str) -> list[Any]:
        """Roll out ``rows``; trajectory ids (hence sampling seeds) are ``name`` and the
        index, so a resumed run samples what the uninterrupted one did."""
        loops = [
            get_loop(str(row.get("agent_name") or self.agent.default_loop))(
                self.engine, self.tokenizer, self.agent, tools=self.tools, reward_fn=self.reward, trajectory_id=f"{name}/{i}"
            )
            for i, row in enumerate(rows)
        ]  # fmt: skip
        return list(await asyncio.gather(*[loop.run(params, **row) for loop, row in zip(loops, rows)]))

    async def accuracy(self, rows: list[Row], max_new_tokens: int) -> float:
        greedy = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        trajectories = await self.run(rows, greedy, name="val")
        return sum(t.reward for t in trajectories) / len(trajectories)


def _tools(config: Config, rows: list[Row]) -> dict[str, Any]:
    """``agent.tools``, built; fails at start-up, not mid-run, on a loop or tool the rows need
    and the config lacks."""
    tools = build_tools(config.agent.tools)
    for row in rows:
        try:
            get_loop(str(row.get("agent_name") or config.agent.default_loop))
        except KeyError as exc:
            raise ConfigError(f"agent.default_loop or a row's agent_name: {exc.args[0]}") from None
        missing = {str(t.get("function", t).get("name")) for t in row.get("tools") or []} - set(tools)
        if missing:
            raise ConfigError(f"rows offer the tool(s) {sorted(missing)} that agent.tools does not provide: add them to agent.tools")
    return tools


def _rows(config: Config) -> tuple[list[Row], list[Row]]:
    """Training and validation rows: the data files, or the synthetic task's two splits."""
    cfg, data = config.train, config.data
    if not data.train_files:
        size = min(data.synthetic_train_size, synthetic_capacity(cfg.task, "train"))
        return synthetic_rows(cfg.task, size, seed=cfg.seed, split="train"), synthetic_rows(cfg.task, cfg.val_size, seed=cfg.seed, split="val")
    if not data.val_files:
        raise ConfigError("data.train_files is set but data.val_files is not: give held-out rows to validate on")

    def read(files: list[str]) -> list[Row]:
        return [row for f in files for row in load_rows(f, prompt_key=data.prompt_key, answer_key=data.answer_key, system_prompt=data.system_prompt)]

    train, val = read(data.train_files), read(data.val_files)[: cfg.val_size]
    if not train or not val:
        raise ConfigError(f"data.{'train' if not train else 'val'}_files hold no rows")
    return train, val


def _advantages(config: Config, rewards: torch.Tensor) -> torch.Tensor:
    group = config.train.group_size
    if config.train.advantage == "rloo":
        return rloo_advantages(rewards, group)
    if config.train.advantage == "reinforce_pp":
        return reinforce_pp_baseline_advantages(rewards, group)
    return grpo_advantages(rewards, group, std_normalize=config.train.std_normalize)


async def train_sync(config: Config, *, resume: bool = False, on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run the schedule above; with ``resume``, continue from the newest checkpoint in
    ``train.run_dir`` exactly as if the run had not stopped.

    Shutdown order, after the last step or on an error: close the metrics file, drop the
    weight group, stop the trainer's ranks, then the engine."""
    cfg, tcfg = config.train, config.trainer
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    started = time.perf_counter()
    checkpoints = Checkpoints(run_dir, keep=cfg.keep_checkpoints)
    resume_from = checkpoints.latest() if resume else None
    state = read_state(resume_from) if resume_from is not None else {}
    train_rows, val = _rows(config)
    tools = _tools(config, train_rows + val)
    sampler = RowSampler(train_rows, seed=cfg.seed, shuffle=config.data.shuffle)
    rng = random.Random(cfg.seed)  # the per-step sampling seeds
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    model_dir = await _model_dir(config)
    tokenizer = load_tokenizer(model_dir)
    pad = int(tokenizer.pad_token_id or 0)
    # The engine (engine.backend: torch, vllm, sglang) serves its own copy, updated after each step.
    engine = await build_engine(msgspec.structs.replace(config.engine, model=str(model_dir)))
    rollouts = _Rollouts(config, engine, tokenizer, tools)
    trainer = TrainerActor(tcfg, log_dir=run_dir)
    synchronizer = ParameterSynchronizer(config.weights, trainer, engine)
    metrics_file = _metrics_file(run_dir / "metrics.jsonl", upto=state.get("step"))
    try:
        await trainer.start(model_dir, total_steps=cfg.steps)
        await synchronizer.start()
        if resume_from is not None:
            await trainer.load(resume_from)
            await synchronizer.sync(state["weight_version"])
            sampler.load_state_dict(state["sampler"])
            rng.setstate(_as_random_state(state["rng"]))
            initial, accuracy = state["initial_accuracy"], state["accuracy"]
            log.info("resumed from %s (step %d)", resume_from, state["step"])
        else:
            initial = accuracy = await rollouts.accuracy(val, cfg.max_new_tokens)
            _write(metrics_file, {"step": 0, "val_accuracy": initial})
        for step in range(state.get("step", 0) + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            rows = sampler.next_batch(cfg.prompts_per_step)
            group_params = msgspec.structs.replace(params, seed=rng.getrandbits(62))
            trajectories = await rollouts.run([row for row in rows for _ in range(cfg.group_size)], group_params, name=f"step{step}")
            t1 = time.perf_counter()
            batch = collate(trajectories, pad)
            advantages = _advantages(config, batch.rewards)
            train_metrics = await trainer.step(TrainBatch.from_rollout(batch, advantages), temperature=cfg.temperature)
            synced = await synchronizer.sync(step)
            t2 = time.perf_counter()
            record: dict[str, Any] = {
                "step": step, "reward": float(batch.rewards.mean()), "rollout_s": t1 - t0, "train_s": t2 - t1,
                "response_tokens": int(batch.response_mask.sum()), **{f"train/{k}": v for k, v in train_metrics.items()},
                "weights/transfer_s": synced.transfer_s, "weights/pause_s": synced.pause_s,
            }  # fmt: skip
            if step % cfg.validate_every == 0 or step == cfg.steps:
                accuracy = await rollouts.accuracy(val, cfg.max_new_tokens)
                record["val_accuracy"] = accuracy
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                run_state = {"weight_version": step, "sampler": sampler.state_dict(), "rng": rng.getstate(), "initial_accuracy": initial, "accuracy": accuracy}
                record["checkpoint"] = str(await checkpoints.save(step, trainer, run_state, model_source=model_dir))
            _write(metrics_file, record)
            if on_step is not None:
                on_step(record)
    finally:
        metrics_file.close()
        synchronizer.close()
        await trainer.close()
        await engine.close()
    return TrainResult(initial_accuracy=initial, final_accuracy=accuracy, steps=cfg.steps, wall_s=time.perf_counter() - started)


async def _model_dir(config: Config) -> Path:
    """The folder RL starts from: ``train.model_dir``, or the preset warm-started on the task."""
    cfg = config.train
    if cfg.model_dir:
        if not (Path(cfg.model_dir) / "config.json").is_file():
            raise ConfigError(f"train.model_dir={cfg.model_dir} is not a model folder (no config.json); leave it empty to warm-start train.preset")
        return Path(cfg.model_dir)
    settings = msgspec.structs.replace(DEFAULT_SETTINGS[cfg.task], greedy_threshold=cfg.warmstart_greedy_threshold)
    return await asyncio.to_thread(warm_start, cfg.task, run_dir=cfg.run_dir, preset=cfg.preset, seed=cfg.seed, settings=settings)


def _metrics_file(path: Path, *, upto: int | None) -> Any:
    """``metrics.jsonl`` for writing: fresh, or (resuming) its records up to step ``upto`` kept."""
    if upto is None or not path.is_file():
        return path.open("w")
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= upto]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def _as_random_state(value: Any) -> Any:
    version, internal, gauss = value  # JSON turned random.getstate()'s tuples into lists
    return (version, tuple(internal), gauss)


def _write(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


__all__ = ["TrainResult", "train_sync"]
