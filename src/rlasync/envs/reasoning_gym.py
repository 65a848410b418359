"""reasoning-gym's procedural tasks as an environment: its rows, scored by its own ``score_answer``.

    data:
      source:
        reasoning_gym:
          task: chain_sum                    # any of its ~100 tasks ...
          config: {min_terms: 2, max_terms: 3}
          size: 2000                         # training rows
    # ... or several, each with a weight (and its own config):
    #     tasks: {chain_sum: 2.0, basic_arithmetic: {weight: 1.0, config: {max_terms: 3}}}

reasoning-gym makes item ``i`` of a dataset from the seed ``seed + i`` alone, so one dataset of
``size + val_pool`` items holds both splits: training rows are items ``0 .. size-1``, held-out
rows the items after them whose question no training row asks (small task spaces repeat). A row
carries its item's index; the scorer on an agent-loop node makes the same dataset from the same
options and scores against that item, so nothing but plain data crosses the wire.

The model is asked (``system_prompt``, reasoning-gym's ``default`` unless set) to put its final
answer in ``<answer>...</answer>``; with ``answer_format: text`` the whole reply is the answer
(for small models prompted to answer at once). Needs ``pip install 'rlasync[envs]'``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
from collections.abc import Sequence
from typing import Any, Literal

from ..data import Row
from ..rewards import RewardInput, RewardOutput
from .base import Environment, EnvironmentError, MissingExtraError, Split, register_environment

INDEX = "reasoning_gym_index"
"""The row field holding its item's index in the environment's dataset."""


def _package() -> Any:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MissingExtraError(
            "data.source.reasoning_gym needs the reasoning-gym package: pip install 'rlasync[envs]'"
        )
    import reasoning_gym

    return reasoning_gym


@register_environment("reasoning_gym")
class ReasoningGym(Environment):
    """reasoning-gym rows and scores (see the module docstring). ``task`` and ``config``, or
    ``tasks`` (name -> weight, or -> ``{weight, config}``) for a composite."""

    def __init__(
        self,
        *,
        seed: int,
        task: str = "",
        config: dict[str, Any] | None = None,
        tasks: dict[str, float | dict[str, Any]] | None = None,
        size: int = 10000,
        val_pool: int = 2000,
        system_prompt: str = "default",
        answer_format: Literal["tag", "text"] = "tag",
    ) -> None:
        where = "data.source.reasoning_gym"
        if bool(task) == bool(tasks):
            raise EnvironmentError(
                f"{where}: give one task (task: chain_sum) or several (tasks: {{name: weight}})"
            )
        if tasks and config:
            raise EnvironmentError(
                f"{where}: config is the single task's; with tasks, give each its own config"
            )
        if size < 1 or val_pool < 1:
            raise EnvironmentError(
                f"{where}: size and val_pool must be at least 1, got {size} and {val_pool}"
            )
        if answer_format not in ("tag", "text"):
            raise EnvironmentError(f"{where}.answer_format: expected tag or text, got {answer_format!r}")
        rg = _package()
        self.seed, self.size, self.val_pool, self.answer_format = int(seed), size, val_pool, answer_format
        self.system_prompt = rg.utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.label = task or "+".join(sorted(tasks or {}))
        self.dataset = self._build(rg, where, task, dict(config or {}), dict(tasks or {}))
        # Item i, made once: a GRPO group scores one item as many times as it has trajectories.
        self._item = functools.lru_cache(maxsize=4096)(self.dataset.__getitem__)

    def _build(self, rg: Any, where: str, task: str, config: dict[str, Any], tasks: dict[str, Any]) -> Any:
        known = sorted(rg.factory.DATASETS)
        specs = []
        for name, value in ({task: {"config": config}} if task else tasks).items():
            if name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                raise EnvironmentError(
                    f"{where}: no reasoning-gym task {name!r}"
                    + (
                        f" (did you mean {', '.join(close)}?)"
                        if close
                        else f"; it has {len(known)}, e.g. {', '.join(known[:8])}"
                    )
                )
            spec: dict[str, Any] = value if isinstance(value, dict) else {"weight": value}
            unknown = set(spec) - {"weight", "config"}
            if unknown:
                raise EnvironmentError(
                    f"{where}.tasks.{name}: unknown keys {sorted(unknown)} (a task takes weight and config)"
                )
            weight, task_config = spec.get("weight", 1.0), spec.get("config") or {}
            specs.append((name, float(weight), dict(task_config)))
        total = self.size + self.val_pool
        try:
            if task:
                return rg.create_dataset(task, size=total, seed=self.seed, **config)
            from reasoning_gym.composite import DatasetSpec

            return rg.create_dataset(
                "composite", size=total, seed=self.seed, datasets=[DatasetSpec(n, w, c) for n, w, c in specs]
            )
        except (TypeError, ValueError, AssertionError) as exc:  # its config classes check with assert
            raise EnvironmentError(
                f"{where}: reasoning-gym refused the config: {exc or type(exc).__name__}"
            ) from None

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        indices: Sequence[int]
        if split == "train":
            indices = range(self.size if n is None else min(n, self.size))
        else:
            n = self.val_pool if n is None else n
            asked = {self._item(i)["question"] for i in range(self.size)}
            indices = [
                i
                for i in range(self.size, self.size + self.val_pool)
                if self._item(i)["question"] not in asked
            ][:n]
            if len(indices) < n:
                raise EnvironmentError(
                    f"data.source.reasoning_gym: only {len(indices)} of the {self.val_pool} held-out candidates "
                    f"(val_pool) ask a question no training row asks; {n} are wanted (train.val_size): "
                    "raise val_pool, or lower train.val_size or size"
                )
        return [self._row(i, split) for i in indices]

    def _row(self, index: int, split: Split) -> Row:
        item = self._item(index)
        messages = [{"role": "user", "content": item["question"]}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        row: Row = {
            "messages": messages,
            "uid": f"{self.label}:{index}",
            INDEX: index,
            "data_source": item["metadata"].get("source_dataset", self.label),
            "kind": split,
        }
        if item.get("answer") is not None:
            row["ground_truth"] = str(item["answer"])
        return row

    def score(self, inp: RewardInput) -> RewardOutput:
        index = inp.extra.get(INDEX)
        if not isinstance(index, int) or not 0 <= index < self.size + self.val_pool:
            raise ValueError(
                f"the row has no {INDEX} of this environment (got {index!r}): it did not come from it"
            )
        if self.answer_format == "tag":
            from reasoning_gym.utils import extract_answer

            answer = extract_answer(inp.response_text)
        else:
            answer = inp.response_text.strip() or None
        score = float(self.dataset.score_answer(answer, self._item(index)))
        return RewardOutput(score=score, metrics={"answer_found": float(answer is not None)})
