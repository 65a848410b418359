"""What a run trains and validates on: the rows (its environment's: ``data.source``, the data
files, or the synthetic task's splits), their sampler, ``data.generator`` adding rows as the run learns, dynamic sampling
(``train.dynamic_sampling``), and the sampling seeds. Its state (``position``) goes into every
checkpoint, so a resumed run draws and samples what the uninterrupted one would have."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from .. import plugins
from ..config import Config, ConfigError
from ..data import DataGenerator, Row, RowResult, Sampler, make_sampler
from ..engines import SamplingParams
from ..envs import make_environment

log = logging.getLogger(__name__)

# Rolls out rows under a name (``Run.rollout``): their groups of trajectories, contiguous.
Rollout = Callable[[list[Row], str], Awaitable[list[Any]]]


def tool_loop(config: Config) -> str:
    """The loop of a synthetic task's tool-calling rows (calc): ``agent.default_loop`` when it
    names one other than ``single_turn`` (``openai``: an agent of the user's), else ``tool``."""
    return config.agent.default_loop if config.agent.default_loop != "single_turn" else "tool"


def environment_source(config: Config) -> str | dict[str, Any]:
    """The environment a run's rows and rewards come from (``rlasync.envs``): ``data.source``;
    else the data files (``files``, scored by ``data.reward`` or ``custom_reward_function``, its
    file as the head resolves it: a node's working directory may differ); else the synthetic
    ``train.task`` (``synthetic``)."""
    data, custom = config.data, config.custom_reward_function
    if data.source:
        return data.source
    if data.train_files:
        return {
            "files": {
                "train_files": list(data.train_files),
                "val_files": list(data.val_files),
                "prompt_key": data.prompt_key,
                "answer_key": data.answer_key,
                "system_prompt": data.system_prompt,
                "reward": data.reward,
                "custom_reward": (
                    {
                        "path": plugins.resolved([custom.path])[0],
                        "name": custom.name,
                        "reward_kwargs": custom.reward_kwargs,
                    }
                    if custom.path
                    else None
                ),
            }
        }
    task = config.train.task
    return {
        "synthetic": {"task": task, "train_size": data.synthetic_train_size, "tool_loop": tool_loop(config)}
    }


def read_rows(config: Config) -> tuple[list[Row], list[Row]]:
    """Training and validation rows (``train.val_size`` of these at most), from the run's
    environment (``environment_source``). Blocking: files are read, problems drawn."""
    cfg = config.train
    environment = make_environment(environment_source(config), seed=cfg.seed)
    assert environment is not None
    train, val = environment.rows("train"), environment.rows("val", cfg.val_size)
    if not train or not val:
        raise ConfigError(f"data.source made no {'training' if not train else 'held-out'} rows")
    return train, val


def as_random_state(value: Any) -> Any:
    version, internal, gauss = value  # JSON turned random.getstate()'s tuples into lists
    return (version, tuple(internal), gauss)


class Feed:
    """The rows and what draws them. ``read`` (blocking: the run calls it in a thread) reads the
    rows, unless preflight read them already (``files``); the rest is called by the schedules
    through ``Run``."""

    train_rows: list[Row]
    val_rows: list[Row]
    sampler: Sampler
    _given_rows: int  # rows of the data; those after them were generated during the run

    def __init__(
        self,
        config: Config,
        files: tuple[list[Row], list[Row]] | None,
        generator: DataGenerator | None,
    ) -> None:
        cfg = config.train
        self.config = config
        self._files = files  # the rows of data.train_files/val_files, read by preflight
        self.generator = generator  # data.generator: adds rows as the run learns
        self.rng = random.Random(cfg.seed)  # the sampling seeds
        self.params = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos
        )

    def read(self) -> None:
        """The rows (the synthetic task's drawn now) and their sampler. Blocking."""
        config = self.config
        self.train_rows, self.val_rows = self._files or read_rows(config)
        self.sampler = make_sampler(
            config.data.sampler, self.train_rows, seed=config.train.seed, shuffle=config.data.shuffle
        )
        self._given_rows = len(self.train_rows)

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """Sampling parameters with ``seed``, else the next seed."""
        return msgspec.structs.replace(self.params, seed=self.rng.getrandbits(62) if seed is None else seed)

    def draw(self, n: int) -> tuple[list[tuple[int, int]], list[Row]]:
        """The next ``n`` training rows and their uses, ``(epoch, row index)``: what the metrics
        record as trained (``data/rows``), so a run's data can be checked across restarts."""
        uses = self.sampler.next_uses(n)
        return uses, [dict(self.train_rows[index]) for _, index in uses]

    def learned(self, uses: list[tuple[int, int]], groups: list[list[Any]]) -> None:
        """A step trained these rows (``uses``) on these groups of trajectories: the sampler
        hears each row's rewards (a curriculum moves on from them)."""
        results = [
            RowResult(index, [float(t.reward) for t in group]) for (_, index), group in zip(uses, groups)
        ]
        self.sampler.update(results)
        if (
            self.generator is not None
            and results
            and (added := self.generator.generate(results, self.train_rows))
        ):
            self.train_rows.extend(added)
            self.sampler.add_rows(added)
            log.info("data.generator added %d rows (%d in all)", len(added), len(self.train_rows))

    def position(self) -> dict[str, Any]:
        """Where the data stands, for a checkpoint (JSON-safe): the sampler's position, the
        generator's state with the rows it made (``restore`` adds them back first), and the
        sampling RNG."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        if self.generator is not None:
            state["generator"] = {
                "state": self.generator.state_dict(),
                "rows": msgspec.to_builtins(self.train_rows[self._given_rows :]),
            }
        return {**state, "rng": self.rng.getstate()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``position``'s ``state`` (a checkpoint's)."""
        if self.generator is not None and "generator" in state:
            made = state["generator"]["rows"]
            self.train_rows.extend(made)
            self.sampler.add_rows(made)
            self.generator.load_state_dict(state["generator"]["state"])
        self.sampler.load_state_dict(state["sampler"])
        self.rng.setstate(as_random_state(state["rng"]))

    async def with_signal(
        self, uses: list[tuple[int, int]], trajectories: list[Any], name: str, rollout: Rollout
    ) -> tuple[list[tuple[int, int]], list[Any], dict[str, int]]:
        """DAPO's dynamic sampling (``train.dynamic_sampling``): of these rolled-out rows (``uses``,
        their groups in ``trajectories``), the groups whose rewards differ; more rows are drawn and
        rolled out (``rollout``), as many as ``uses`` at a time, until there are that many such
        groups or ``max_gen_batches`` rounds were made. The sampler hears of the groups left out
        now (of the kept ones when the schedule calls ``learned``). No group with signal at all:
        the last round's are kept (a step that changes nothing but stays a step). Also returns
        the rounds made and the groups dropped, for the step's record."""
        cfg = self.config.train
        want, size = len(uses), cfg.group_size
        kept_uses: list[tuple[int, int]] = []
        kept: list[Any] = []
        left_uses: list[tuple[int, int]] = []
        left: list[list[Any]] = []
        rounds = 1
        while True:
            for use, start in zip(uses, range(0, len(trajectories), size)):
                group = trajectories[start : start + size]
                if len(kept_uses) < want and len({float(t.reward) for t in group}) > 1:
                    kept_uses.append(use)
                    kept += group
                else:
                    left_uses.append(use)
                    left.append(group)
            if len(kept_uses) >= want or rounds >= cfg.max_gen_batches:
                break
            uses, rows = self.draw(want)
            trajectories = await rollout(rows, f"{name}/{rounds}")
            rounds += 1
        if not kept_uses:
            kept_uses, kept = left_uses[-len(uses) :], [t for group in left[-len(uses) :] for t in group]
            left_uses, left = left_uses[: -len(uses)], left[: -len(uses)]
        self.learned(left_uses, left)
        return kept_uses, kept, {"gen_batches": rounds, "dropped_groups": len(left_uses)}
