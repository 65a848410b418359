"""reasoning-gym's procedural tasks as an environment: its rows, scored by its own ``score_answer``.

    data:
      source:
        reasoning_gym:
          task: chain_sum                    # any of its ~100 tasks ...
          config: {min_terms: 2, max_terms: 3}
          size: 2000                         # training rows
    # ... or several, each with a weight (and its own config):
    #     tasks: {chain_sum: 2.0, basic_arithmetic: {weight: 1.0, config: {max_terms: 3}}}

reasoning-gym makes item ``i`` of a dataset from the seed ``seed + i`` alone, so one dataset
holds both splits. An item is held out when a hash of its question falls in ``val_percent``
(10 %) of the hash space: a held-out question is never a training question (small task spaces
repeat questions), and both splits follow the task's distribution. Training rows are the first
``size`` training items, held-out rows the first held-out ones (``val_pool`` at most). A row
carries its item's index; the scorer on an agent-loop node makes the same dataset from the same
options and scores against that item, so nothing but plain data crosses the wire.

What reaches the scorer is the reply's answer, as ``answer_format`` finds it: ``tag`` (the
default, as reasoning-gym's own evaluations do) the last ``<answer>...</answer>``, which the
system prompt (``system_prompt``: reasoning-gym's ``default`` unless set; a key of its
``SYSTEM_PROMPTS`` or your text) asks for; ``text`` the whole reply; ``last_number`` the reply's
last number as written (commas dropped), for numeric tasks and models too small to keep to tags.
Needs ``pip install 'rlasync[envs]'``.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import re
from typing import Any, Literal

from ..data import Row
from ..rewards import RewardInput, RewardOutput
from .base import EnvError, Environment, Split, import_extra, register_environment

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

INDEX = "reasoning_gym_index"
"""The row field holding its item's index in the environment's dataset."""


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
        val_percent: int = 10,
        system_prompt: str = "default",
        answer_format: Literal["tag", "text", "last_number"] = "tag",
    ) -> None:
        where = "data.source.reasoning_gym"
        if bool(task) == bool(tasks):
            raise EnvError(f"{where}: give one task (task: chain_sum) or several (tasks: {{name: weight}})")
        if tasks and config:
            raise EnvError(f"{where}: config is the single task's; with tasks, give each its own config")
        if size < 1 or val_pool < 1:
            raise EnvError(f"{where}: size and val_pool must be at least 1, got {size} and {val_pool}")
        if answer_format not in ("tag", "text", "last_number"):
            raise EnvError(f"{where}.answer_format: expected tag, text or last_number, got {answer_format!r}")
        rg = import_extra(
            "reasoning_gym", setting="data.source.reasoning_gym", package="reasoning-gym", extra="envs"
        )
        self.seed, self.size, self.val_pool, self.answer_format = int(seed), size, val_pool, answer_format
        self.val_percent = val_percent
        # Items scanned for each split's rows (a bound: a task of few questions may not fill one).
        self.items = 20 * (size + val_pool)
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
                raise EnvError(
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
                raise EnvError(
                    f"{where}.tasks.{name}: unknown keys {sorted(unknown)} (a task takes weight and config)"
                )
            weight, task_config = spec.get("weight", 1.0), spec.get("config") or {}
            specs.append((name, float(weight), dict(task_config)))
        try:
            if task:
                return rg.create_dataset(task, size=self.items, seed=self.seed, **config)
            from reasoning_gym.composite import DatasetSpec

            return rg.create_dataset(
                "composite",
                size=self.items,
                seed=self.seed,
                datasets=[DatasetSpec(n, w, c) for n, w, c in specs],
            )
        except (TypeError, ValueError, AssertionError) as exc:  # its config classes check with assert
            raise EnvError(
                f"{where}: reasoning-gym refused the config: {exc or type(exc).__name__}"
            ) from None

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        want = (self.size if split == "train" else self.val_pool) if n is None else n
        if split == "val" and want > self.val_pool:
            raise EnvError(
                f"data.source.reasoning_gym: {want} held-out rows wanted (train.val_size), val_pool is {self.val_pool}: "
                "raise val_pool or lower train.val_size"
            )
        indices: list[int] = []
        for index in range(self.items):
            if len(indices) == want:
                break
            if self._split(index) == split:
                indices.append(index)
        else:
            raise EnvError(
                f"data.source.reasoning_gym: only {len(indices)} of its first {self.items} items ask a question of "
                f"the {split} split, {want} wanted: the task has too few distinct questions for this size and "
                "val_percent"
            )
        return [self._row(i, split) for i in indices]

    def _split(self, index: int) -> Split:
        """The split of item ``index``, by a hash of its question: a question is held out or not
        wherever it comes up, and each split follows the task's own distribution (holding out the
        questions training happened not to ask would keep mostly the rarer, harder ones)."""
        digest = hashlib.blake2b(self._item(index)["question"].encode(), digest_size=8).digest()
        return "val" if int.from_bytes(digest, "big") % 100 < self.val_percent else "train"

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
        if not isinstance(index, int) or not 0 <= index < self.items:
            raise ValueError(
                f"the row has no {INDEX} of this environment (got {index!r}): it did not come from it"
            )
        if self.answer_format == "tag":
            from reasoning_gym.utils import extract_answer

            answer = extract_answer(inp.response_text)
        elif self.answer_format == "last_number":
            numbers = _NUMBER.findall(inp.response_text.replace(",", ""))
            answer = numbers[-1] if numbers else None
        else:
            answer = inp.response_text.strip() or None
        score = float(self.dataset.score_answer(answer, self._item(index)))
        return RewardOutput(score=score, metrics={"answer_found": float(answer is not None)})
