"""Synchronous GRPO, the baseline the asynchronous modes are measured against.

Each step, in order:

1. sample ``prompts_per_step`` training problems, each ``group_size`` times;
2. roll them out with the agent loops on the engine (the policy's current weights);
3. score them (the task's reward), and turn rewards into group-relative advantages;
4. one optimiser step on the batch (on-policy: the PPO ratio starts at 1);
5. push the new weights to the engine (an in-process copy here; a broadcast later);
6. every ``validate_every`` steps, score held-out problems greedily.

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

from ..agents import SingleTurnAgentLoop, ToolAgentLoop, collate
from ..algorithms import grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from ..config import Config
from ..data.synthetic import Problem, iter_problems, loop_reward, make_problems
from ..engines import SamplingParams, TorchEngine
from ..models import load_pretrained_dir
from ..models.warmstart import DEFAULT_SETTINGS, warm_start
from ..tools import build_tools
from ..trainer import PolicyTrainer

log = logging.getLogger(__name__)


class TrainResult(msgspec.Struct, kw_only=True):
    initial_accuracy: float
    final_accuracy: float
    steps: int
    wall_s: float


class _Rollouts:
    """The agent loops of one task on one engine."""

    def __init__(self, config: Config, engine: TorchEngine, tokenizer: Any) -> None:
        self.reward = loop_reward(config.train.task)
        self.engine, self.tokenizer = engine, tokenizer
        self.tools = build_tools(["calculator"]) if config.train.task == "calc" else {}
        self.agent = msgspec.structs.replace(config.agent, tools=list(self.tools), max_assistant_turns=config.agent.max_assistant_turns or 3)
        self.count = 0

    async def run(self, problems: list[Problem], params: SamplingParams) -> list[Any]:
        loops = []
        for problem in problems:
            self.count += 1
            cls: Callable[..., Any] = ToolAgentLoop if self.tools else SingleTurnAgentLoop
            loops.append(cls(self.engine, self.tokenizer, self.agent, tools=self.tools, reward_fn=self.reward, trajectory_id=f"r{self.count}"))
        rows = [{"messages": p.messages, "problem": p} for p in problems]
        return list(await asyncio.gather(*[loop.run(params, **row) for loop, row in zip(loops, rows)]))

    async def accuracy(self, problems: list[Problem], max_new_tokens: int) -> float:
        greedy = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        trajectories = await self.run(problems, greedy)
        return sum(t.reward for t in trajectories) / len(trajectories)


def _advantages(config: Config, rewards: torch.Tensor) -> torch.Tensor:
    group = config.train.group_size
    if config.train.advantage == "rloo":
        return rloo_advantages(rewards, group)
    if config.train.advantage == "reinforce_pp":
        return reinforce_pp_baseline_advantages(rewards, group)
    return grpo_advantages(rewards, group, std_normalize=config.train.std_normalize)


async def train_sync(config: Config, *, on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    cfg, tcfg = config.train, config.trainer
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    started = time.perf_counter()
    settings = msgspec.structs.replace(DEFAULT_SETTINGS[cfg.task], greedy_threshold=cfg.warmstart_greedy_threshold)
    model_dir = await asyncio.to_thread(warm_start, cfg.task, run_dir=run_dir, preset=cfg.preset, seed=cfg.seed, settings=settings)
    torch.manual_seed(cfg.seed)
    policy, tokenizer = load_pretrained_dir(model_dir)
    serving, _ = load_pretrained_dir(model_dir)  # the engine's own copy, updated after each step
    engine = TorchEngine(serving, max_batch=max(64, cfg.prompts_per_step * cfg.group_size), seed=cfg.seed)
    trainer = PolicyTrainer(policy, tcfg, total_steps=cfg.steps)
    rollouts = _Rollouts(config, engine, tokenizer)
    val = make_problems(cfg.task, cfg.val_size, seed=cfg.seed, split="val")
    train_stream = iter_problems(cfg.task, seed=cfg.seed, split="train")
    rng = random.Random(cfg.seed)
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    pad = int(tokenizer.pad_token_id or 0)
    metrics_file = (run_dir / "metrics.jsonl").open("w")
    try:
        initial = await rollouts.accuracy(val, cfg.max_new_tokens)
        accuracy = initial
        _write(metrics_file, {"step": 0, "val_accuracy": initial})
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            problems = [next(train_stream) for _ in range(cfg.prompts_per_step)]
            group_params = msgspec.structs.replace(params, seed=rng.getrandbits(62))
            trajectories = await rollouts.run([p for p in problems for _ in range(cfg.group_size)], group_params)
            t1 = time.perf_counter()
            batch = collate(trajectories, pad)
            advantages = _advantages(config, batch.rewards)
            train_metrics = await asyncio.to_thread(trainer.step, batch, advantages, temperature=cfg.temperature)
            await engine.update_weights(trainer.weights(), version=step)
            t2 = time.perf_counter()
            record: dict[str, Any] = {
                "step": step, "reward": float(batch.rewards.mean()), "rollout_s": t1 - t0, "train_s": t2 - t1,
                "response_tokens": int(batch.response_mask.sum()), **{f"train/{k}": v for k, v in train_metrics.items()},
            }  # fmt: skip
            if step % cfg.validate_every == 0 or step == cfg.steps:
                accuracy = await rollouts.accuracy(val, cfg.max_new_tokens)
                record["val_accuracy"] = accuracy
            _write(metrics_file, record)
            if on_step is not None:
                on_step(record)
    finally:
        metrics_file.close()
        await engine.close()
    return TrainResult(initial_accuracy=initial, final_accuracy=accuracy, steps=cfg.steps, wall_s=time.perf_counter() - started)


def _write(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


__all__ = ["TrainResult", "train_sync"]
