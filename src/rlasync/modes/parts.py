"""What every schedule is made of: the rows, the agent loops on the engine, advantages, the
model folder RL starts from, and the metrics file. A mode (``sync``, ``one_step_off``,
``fully_async``) is only the order in which it uses them."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from ..agents import get_loop, registered_reward
from ..algorithms import grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from ..config import Config, ConfigError
from ..data import Row, RowSampler, load_rows, synthetic_rows
from ..data.synthetic import loop_reward, synthetic_capacity
from ..engines import SamplingParams
from ..models.warmstart import DEFAULT_SETTINGS, warm_start
from ..tools import build_tools


class TrainResult(msgspec.Struct, kw_only=True):
    initial_accuracy: float
    final_accuracy: float
    steps: int
    wall_s: float


class Rollouts:
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


def build_run_tools(config: Config, rows: list[Row]) -> dict[str, Any]:
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


def read_rows(config: Config) -> tuple[list[Row], list[Row]]:
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


def group_advantages(config: Config, rewards: torch.Tensor) -> torch.Tensor:
    group = config.train.group_size
    if config.train.advantage == "rloo":
        return rloo_advantages(rewards, group)
    if config.train.advantage == "reinforce_pp":
        return reinforce_pp_baseline_advantages(rewards, group)
    return grpo_advantages(rewards, group, std_normalize=config.train.std_normalize)


async def model_dir_for(config: Config) -> Path:
    """The folder RL starts from: ``train.model_dir``, or the preset warm-started on the task."""
    cfg = config.train
    if cfg.model_dir:
        if not (Path(cfg.model_dir) / "config.json").is_file():
            raise ConfigError(f"train.model_dir={cfg.model_dir} is not a model folder (no config.json); leave it empty to warm-start train.preset")
        return Path(cfg.model_dir)
    settings = msgspec.structs.replace(DEFAULT_SETTINGS[cfg.task], greedy_threshold=cfg.warmstart_greedy_threshold)
    return await asyncio.to_thread(warm_start, cfg.task, run_dir=cfg.run_dir, preset=cfg.preset, seed=cfg.seed, settings=settings)


def open_metrics(path: Path, *, upto: int | None) -> Any:
    """``metrics.jsonl`` for writing: fresh, or (resuming) its records up to step ``upto`` kept."""
    if upto is None or not path.is_file():
        return path.open("w")
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= upto]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def as_random_state(value: Any) -> Any:
    version, internal, gauss = value  # JSON turned random.getstate()'s tuples into lists
    return (version, tuple(internal), gauss)


def write_record(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


class Run:
    """The parts of one training run, made and started together, closed in order: the rows and
    their sampler, the engine with the agent loops on it, the trainer actor, the synchroniser
    between them, and ``metrics.jsonl``. Every schedule drives these."""

    model_dir: Path
    tokenizer: Any
    pad: int
    engine: Any  # an Engine
    rollouts: Rollouts
    trainer: Any  # a TrainerActor
    synchronizer: Any  # a ParameterSynchronizer
    metrics: Any  # the open metrics.jsonl

    def __init__(self, config: Config) -> None:
        cfg = config.train
        self.config = config
        self.run_dir = Path(cfg.run_dir)
        self.train_rows, self.val_rows = read_rows(config)
        self.tools = build_run_tools(config, self.train_rows + self.val_rows)
        self.sampler = RowSampler(self.train_rows, seed=cfg.seed, shuffle=config.data.shuffle)
        self.rng = random.Random(cfg.seed)  # the sampling seeds
        self.params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
        self.started = time.perf_counter()
        self._closers: list[Any] = []
        self.checkpointing = True  # the sync mode saves checkpoints (not with simulated parts)
        self.validating = True  # held-out validation (not with simulated parts)

    @classmethod
    async def open(cls, config: Config, *, metrics_upto: int | None = None) -> Run:
        """Build and start everything (the warm-start first, if ``train.model_dir`` is empty)."""
        from ..engines import build_engine
        from ..models.tiny import load_tokenizer
        from ..trainer import TrainerActor
        from ..weights import ParameterSynchronizer

        run = cls(config)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(config)))
        run.model_dir = await model_dir_for(config)
        run.tokenizer = load_tokenizer(run.model_dir)
        run.pad = int(run.tokenizer.pad_token_id or 0)
        try:
            # The engine (engine.backend: torch, vllm, sglang) serves its own copy, updated by the synchroniser.
            run.engine = await build_engine(msgspec.structs.replace(config.engine, model=str(run.model_dir)))
            run._closers.append(run.engine.close)
            run.rollouts = Rollouts(config, run.engine, run.tokenizer, run.tools)
            run.trainer = TrainerActor(config.trainer, log_dir=run.run_dir)
            run._closers.append(run.trainer.close)
            run.synchronizer = ParameterSynchronizer(config.weights, run.trainer, run.engine)
            run._closers.append(run.synchronizer.close)
            run.metrics = open_metrics(run.run_dir / "metrics.jsonl", upto=metrics_upto)
            run._closers.append(run.metrics.close)
            await run.trainer.start(run.model_dir, total_steps=config.train.steps * _updates_per_step(config))
            await run.synchronizer.start()
        except BaseException:
            await run.close()
            raise
        # What is alive now (modules, the dataset rows, the model: ~0.5 M objects) lives as long
        # as the run; frozen, the collector never scans it again. Unfrozen, each full collection
        # paused the controller 0.05-0.26 s, every ~30 steps of the quickstart.
        gc.freeze()
        return run

    @classmethod
    def from_parts(cls, config: Config, *, engine: Any, trainer: Any, synchronizer: Any, tokenizer: Any) -> Run:
        """A run over parts made elsewhere, e.g. the simulation's (``rlasync.modes.sim``): it
        validates and checkpoints nothing, and closes only its metrics file."""
        run = cls(config)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.model_dir = run.run_dir
        run.engine, run.trainer, run.synchronizer, run.tokenizer = engine, trainer, synchronizer, tokenizer
        run.pad = int(tokenizer.pad_token_id or 0)
        run.rollouts = Rollouts(config, engine, tokenizer, run.tools)
        run.metrics = open_metrics(run.run_dir / "metrics.jsonl", upto=None)
        run._closers.append(run.metrics.close)
        run.checkpointing = run.validating = False
        return run

    def sampling(self) -> SamplingParams:
        """Sampling parameters with the next seed."""
        return msgspec.structs.replace(self.params, seed=self.rng.getrandbits(62))

    async def rollout(self, rows: list[Row], name: str) -> list[Any]:
        """Every row ``train.group_size`` times, contiguous groups."""
        return await self.rollouts.run([row for row in rows for _ in range(self.config.train.group_size)], self.sampling(), name=name)

    def train_batch(self, trajectories: list[Any]) -> tuple[Any, Any]:
        """``(RolloutBatch, TrainBatch)`` of whole groups, with group-relative advantages."""
        from ..agents import collate
        from ..trainer import TrainBatch

        batch = collate(trajectories, self.pad)
        return batch, TrainBatch.from_rollout(batch, group_advantages(self.config, batch.rewards))

    async def validate(self) -> float:
        if not self.validating:
            return 0.0
        return await self.rollouts.accuracy(self.val_rows, self.config.train.max_new_tokens)

    def write(self, record: dict[str, Any], on_step: Callable[[dict[str, Any]], None] | None = None) -> None:
        """One line of ``metrics.jsonl``, stamped with the seconds since the run began
        (``elapsed_s``), then handed to ``on_step`` (progress lines, tests)."""
        record.setdefault("elapsed_s", round(time.perf_counter() - self.started, 3))
        write_record(self.metrics, record)
        if on_step is not None:
            on_step(record)

    async def close(self) -> None:
        """Metrics file, weight group, trainer ranks, engine: in that order, each once."""
        while self._closers:
            closer = self._closers.pop()
            result = closer()
            if asyncio.iscoroutine(result):
                await result


def _updates_per_step(config: Config) -> int:
    return 1 if config.train.mode == "sync" else config.async_training.require_batches
