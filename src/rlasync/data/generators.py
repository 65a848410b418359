"""Training rows made during a run (verl's ``dynamic_dataset``): a generator hears each step's
results and may add rows, which the sampler hands out from its next epoch on.

    data:
      generator: {name: rising_difficulty, threshold: 0.7, batch: 32}

After each training step the run calls ``generate`` with the step's trained rows and their group
rewards (verl's ``on_batch_end``) and the rows so far; the rows it returns are added to the
training set. They and the generator's ``state_dict`` go into checkpoints, so ``--resume``
draws from the same rows. A generator of your own:

    @register_generator("paraphrases")
    class Paraphrases(DataGenerator):
        def __init__(self, *, seed: int, **options): ...
        def generate(self, results, rows): ...      # -> new rows (often [])
        def state_dict(self): ...                  # JSON-safe
        def load_state_dict(self, state): ...

No torch.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Sequence
from typing import Any

from ..config import ConfigError
from ..config.loader import registry_choice
from ..registry import Registry
from .datasets import Row, problem_row
from .samplers import RowResult
from .synthetic import REVERSE_ALPHABET, reverse_problem, split_of


class DataGenerator(abc.ABC):
    """What adds training rows during a run (see the module docstring). Built as
    ``cls(seed=train.seed, **options)``."""

    @abc.abstractmethod
    def generate(self, results: list[RowResult], rows: Sequence[Row]) -> list[Row]:
        """A training step ended (``results``: its rows' group rewards; ``rows``: the training
        rows so far, by index): the rows to add, in the shape of the run's rows."""

    def state_dict(self) -> dict[str, Any]:
        """What continuing needs (JSON-safe); the rows it made are saved by the run."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027  (a stateless generator)
        """Continue from ``state``."""


class GeneratorError(ConfigError):
    """``data.generator`` names no generator, or its options do not fit it."""


# An unknown name is registry_choice's GeneratorError, so no ``unknown`` message here.
_GENERATORS = Registry[Callable[..., DataGenerator]]("generator")


def register_generator(name: str) -> Callable[[Callable[..., DataGenerator]], Callable[..., DataGenerator]]:
    """Make a generator class available as ``data.generator: NAME``."""
    return _GENERATORS.decorator(name)


def registered_generators() -> list[str]:
    return _GENERATORS.names()


def make_generator(spec: str | dict[str, Any], *, seed: int) -> DataGenerator | None:
    """The generator ``data.generator`` asks for (a name, or ``{name: ..., option: value}``);
    None for "" (no generator)."""
    choice = registry_choice(
        spec, "data.generator", _GENERATORS.view(), "@rlasync.data.register_generator", GeneratorError
    )
    if choice is None:
        return None
    name, factory, options = choice
    try:
        return factory(seed=seed, **options)
    except (TypeError, ValueError) as exc:
        raise GeneratorError(f"data.generator {name!r}: {exc}") from None


@register_generator("rising_difficulty")
class RisingDifficulty(DataGenerator):
    """The built-in example: string reversal whose words grow longer as the policy masters them.
    Over the last ``window`` trained rows, once the share of samples with reward at least
    ``pass_reward`` reaches ``threshold``, it adds ``batch`` new problems one letter longer than
    the last ones (from ``start_length`` up to ``max_length``), and starts counting afresh. Rows of
    the ``reverse`` task (scored by its reward: the run's ``train.task`` must be ``reverse``)."""

    def __init__(
        self,
        *,
        seed: int,
        threshold: float = 0.7,
        window: int = 64,
        batch: int = 32,
        start_length: int = 6,
        max_length: int = 12,
        pass_reward: float = 1.0,
    ) -> None:
        if not 0.0 < threshold <= 1.0 or min(window, batch, start_length) < 1 or max_length < start_length:
            raise ValueError(
                "expected 0 < threshold <= 1, window, batch and start_length >= 1, max_length >= start_length"
            )
        self.seed, self.threshold, self.window, self.batch = seed, threshold, window, batch
        self.max_length, self.pass_reward = max_length, pass_reward
        self.length = start_length - 1  # the length of the words added last (none yet)
        self.recent: list[float] = []  # pass rates of the rows trained since the last addition

    def generate(self, results: list[RowResult], rows: Sequence[Row]) -> list[Row]:
        self.recent += [
            sum(r >= self.pass_reward for r in res.rewards) / len(res.rewards)
            for res in results
            if res.rewards
        ]
        self.recent = self.recent[-self.window :]
        if len(self.recent) < self.window or sum(self.recent) / len(self.recent) < self.threshold:
            return []
        if self.length >= self.max_length:
            return []
        self.length += 1
        self.recent = []
        rng = random.Random(f"rlasync.rising_difficulty/{self.seed}/{self.length}")
        words: set[str] = set()
        for _ in range(20 * self.batch):  # bounded: about 9 words in 10 are of the training split
            if len(words) == self.batch:
                break
            word = "".join(rng.choice(REVERSE_ALPHABET) for _ in range(self.length))
            if (
                split_of("reverse", word) == "train"
            ):  # never a held-out problem (6 letters and fewer are the task's)
                words.add(word)
        return [problem_row(reverse_problem(w), uid=f"reverse:generated:{w}") for w in sorted(words)]

    def state_dict(self) -> dict[str, Any]:
        return {"length": self.length, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.length, self.recent = int(state["length"]), [float(x) for x in state["recent"]]
