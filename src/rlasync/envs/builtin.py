"""The environments a run has when ``data.source`` names none: its data files (``files``) or the
quickstart's synthetic task (``synthetic``). Through them every run's rows and rewards take the
one path the adapters take (``Environment``: rows on the head, scores on the agent-loop nodes).

    data:
      source: {synthetic: {task: reverse}}                  # what train.task: reverse means
      source: {files: {train_files: [a.parquet], val_files: [b.parquet], reward: math_verify}}

A run writes neither: ``data.train_files`` (with ``data.reward`` or ``custom_reward_function``)
is the ``files`` environment, and no files at all the ``synthetic`` one of ``train.task``
(``rlasync.compose.feed.environment_source``).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import msgspec

from ..data import Row, load_rows, synthetic_rows
from ..data.synthetic import as_problem, get_task, synthetic_capacity
from ..rewards import RewardInput, load_compute_score, make_reward
from ..rewards.registry import is_async
from ..rewards.verl import CustomRewardError
from .base import EnvError, Environment, Split, register_environment


@register_environment("synthetic")
class SyntheticTask(Environment):
    """A synthetic task's problems (``rlasync.data.synthetic``: ``reverse``, ``arith``, ``calc``),
    scored by the task's own reward of the final answer. Training rows are the first
    ``train_size`` problems its training split draws (repeats kept: the task's own mix);
    held-out rows are distinct problems of its validation split (split by a hash of each
    problem, so never a training one). ``calc`` rows call the calculator in ``tool_loop``."""

    def __init__(
        self, *, seed: int, task: str = "reverse", train_size: int = 20000, tool_loop: str = "tool"
    ) -> None:
        try:
            self.reward = get_task(task).reward
        except ValueError as exc:
            raise EnvError(f"data.source.synthetic.task: {exc}") from None
        if train_size < 1:
            raise EnvError(f"data.source.synthetic.train_size: at least 1, got {train_size}")
        self.task, self.seed, self.train_size, self.tool_loop = task, seed, train_size, tool_loop

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        if split == "train":
            return synthetic_rows(
                self.task,
                n or self.train_size,
                seed=self.seed,
                split="train",
                tool_loop=self.tool_loop,
                distinct=False,
            )
        return synthetic_rows(
            self.task,
            n or synthetic_capacity(self.task, "val"),
            seed=self.seed,
            split="val",
            tool_loop=self.tool_loop,
        )

    async def score(self, inp: RewardInput) -> float:  # async: a string comparison needs no thread
        return self.reward(as_problem(inp.extra["problem"]), inp.response_text)


class CustomReward(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A verl reward function (``custom_reward_function``): file, function name, keyword arguments."""

    path: str
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = {}


@register_environment("files")
class DataFiles(Environment):
    """Rows read from files (``rlasync.data.load_rows``: JSONL, Parquet in verl's layout, a
    ``datasets`` folder), all of ``train_files`` for training and the first of ``val_files``
    held out, scored by ``reward`` (a reward of ``rlasync.rewards`` by name or options) or a verl
    reward function (``custom_reward``). Built on every agent-loop node to score, it reads the
    files only when asked for rows (on the head), and it checks the reward now, so a wrong name
    or path fails at start-up."""

    def __init__(
        self,
        *,
        seed: int,
        train_files: list[str],
        val_files: list[str],
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        system_prompt: str | None = None,
        reward: str | dict[str, Any] = "exact_match",
        custom_reward: dict[str, Any] | None = None,
    ) -> None:
        if not train_files:
            raise EnvError("data.train_files: give the files of the training rows")
        if not val_files:
            raise EnvError(
                "data.train_files is set but data.val_files is not: give held-out rows to validate on"
            )
        self.train_files, self.val_files = list(train_files), list(val_files)
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        try:
            if custom_reward is not None:
                custom = msgspec.convert(custom_reward, CustomReward)
                self._reward: Any = load_compute_score(custom.path, custom.name, custom.reward_kwargs)
            else:
                self._reward = make_reward(reward)
        except CustomRewardError as exc:
            raise EnvError(str(exc)) from None
        except (ValueError, msgspec.ValidationError) as exc:
            message = str(exc)
            raise EnvError(
                message if message.startswith("data.reward") else f"data.reward: {message}"
            ) from None
        self._async = is_async(self._reward)
        timeout_s = getattr(self._reward, "timeout_s", None)  # a judge's, a reward model's deadline
        self.score_timeout_s = float(timeout_s) if timeout_s else None
        del seed  # the files' order is theirs; data.shuffle shuffles them

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        files = self.train_files if split == "train" else self.val_files
        rows = [
            row
            for f in files
            for row in load_rows(
                f, prompt_key=self.prompt_key, answer_key=self.answer_key, system_prompt=self.system_prompt
            )
        ]
        if not rows:
            raise EnvError(f"data.{split}_files hold no rows")
        return rows[:n] if n is not None else rows

    async def score(self, inp: RewardInput) -> Any:
        """The reward's result: an async reward (a judge, a reward model) awaited here, a sync one
        (a parser, sympy) run in a thread, as ``compute_reward`` runs them; the worker bounds both."""
        if self._async:
            return await self._reward(inp)
        result = await asyncio.to_thread(self._reward, inp)
        return await result if inspect.isawaitable(result) else result  # a function that returned a coroutine
