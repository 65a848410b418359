"""Which training rows a run draws next: the uniform epoch sampler, curriculum samplers that
learn from each step's rewards (verl's ``AbstractCurriculumSampler``), and their registry.

    data:
      sampler: pass_rate                              # a registered name
      sampler: {name: pass_rate, low: 0.0, high: 1.0, revisit: 0.1, retry_unsolved: 0.5}
      sampler: my_package.curriculum:HardFirst        # a class, by import path

A sampler hands out *uses*, ``(epoch, row index)`` (what ``metrics.jsonl`` records as trained);
after each training step the run calls ``update`` with the group rewards of every row the step
trained; ``state_dict`` / ``load_state_dict`` go into checkpoints, so a resumed run draws on as
the uninterrupted one would have. A sampler of your own:

    @register_sampler("hard_first")
    class HardFirst(Sampler):
        def __init__(self, rows, *, seed, shuffle=True, **options): ...
        def next_uses(self, n): ...                 # [(epoch, row index), ...]
        def update(self, results): ...              # [RowResult(index, rewards), ...]
        def metrics(self): ...                      # optional: {"name": number}, as sampler/name
        def state_dict(self): ...                   # JSON-safe
        def load_state_dict(self, state): ...

No torch.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ..config import ConfigError
from ..config.loader import import_object
from ..registry import Registry
from .datasets import Row, RowSampler


class RowResult(msgspec.Struct, frozen=True):
    """One trained row of a step: its index and the rewards of its group (one per sample)."""

    index: int
    rewards: list[float]


class Sampler(abc.ABC):
    """What a run draws its training rows with (see the module docstring)."""

    @abc.abstractmethod
    def next_uses(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` rows to train on, as ``(epoch, row index)``."""

    def update(self, results: list[RowResult]) -> None:  # noqa: B027  (optional: a plain sampler learns nothing)
        """A training step ended: the rewards of the rows it trained (verl's ``update(batch)``)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to draw on exactly (JSON-safe: it goes into ``state.json``)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]:
        """What the sampler knows, for each step's record (``metrics.jsonl``'s ``sampler/<name>``)."""
        return {}

    def add_rows(self, rows: list[Row]) -> None:
        """Rows added during the run (``data.generator``), after the ones it was made with."""
        raise TypeError(f"{type(self).__name__} cannot take rows added during a run (data.generator)")


class UniformSampler(RowSampler, Sampler):
    """Every row once per epoch, in a seeded shuffled order (``data.shuffle``): ``RowSampler``."""


class PassRateSampler(UniformSampler):
    """A curriculum: rows whose measured pass rate lies outside the learning band are mostly
    skipped, so the steps go to rows the policy sometimes solves (in the spirit of DAPO's
    dynamic sampling and prime-rl's difficulty pools; under GRPO a group whose rewards are all
    equal teaches nothing).

    Rows come in the uniform sampler's epoch order, so every row is tried once in the first
    epoch. After a step, a row's pass rate is the share of its group's rewards at least
    ``pass_reward``. From then on a row at or below ``low`` (never solved) or at or above
    ``high`` (always solved) is skipped, except with probability ``revisit`` per epoch
    (a fixed draw per row and epoch, so resuming draws the same), since the policy changes: a
    row revisited gets a fresh pass rate. When every row would be skipped, rows are taken anyway (a
    batch is never short).

    ``retry_unsolved`` (0: off) treats a row never solved as the likeliest to change, since
    training makes the policy better: ``e`` epochs after it was found at or below ``low`` (and
    not solved since) it comes back with probability ``max(revisit, retry_unsolved ** e)``, so a
    row too hard for the first epoch's policy is tried again soon, and one that stays unsolved
    fades to ``revisit``. Without it, the rows a weak first epoch missed rarely return, the few
    rows in the band are drawn over and over and learnt by heart, and held-out accuracy stalls
    (string reversal where every row is learnable, ten seeds, measured when the decay still
    counted draws: it missed the target on four, the uniform sampler on two; with
    ``retry_unsolved: 0.5`` on one). The price: a row no policy solves is drawn about once more
    over the following epochs (1/2 + 1/4 + ...) than without it. The decay counts epochs, not
    draws: a curriculum's epochs grow short as it skips rows, and a chance that fell only when
    the row was drawn again kept impossible rows at over a quarter of each batch
    (``curriculum_bench``, a third of the rows impossible, epochs 2-10)."""

    def __init__(
        self,
        rows: Iterable[Row],
        *,
        seed: int,
        shuffle: bool = True,
        low: float = 0.0,
        high: float = 1.0,
        revisit: float = 0.1,
        pass_reward: float = 1.0,
        retry_unsolved: float = 0.5,
    ) -> None:
        super().__init__(rows, seed=seed, shuffle=shuffle)
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"pass_rate sampler: expected 0 <= low < high <= 1, got low={low}, high={high}")
        for name, value in (("revisit", revisit), ("retry_unsolved", retry_unsolved)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"pass_rate sampler: {name} is a probability, got {value}")
        self.low, self.high, self.revisit, self.pass_reward = low, high, revisit, pass_reward
        self.retry_unsolved = retry_unsolved
        self.pass_rates: dict[int, float] = {}
        """Row index -> the pass rate of its latest trained group."""
        self.unsolved: dict[int, int] = {}
        """Row index -> the epoch it was found at or below ``low``, not solved since (others are absent)."""
        self.skipped = 0
        """Rows passed over so far (outside the band, not revisited)."""

    def next_uses(self, n: int) -> list[tuple[int, int]]:
        uses: list[tuple[int, int]] = []
        # Passed over in a row: 2 x the rows always hold one whole epoch, so past that every row
        # would be skipped, and rows are taken anyway.
        passed_over = 0
        while len(uses) < n:
            (use,) = super().next_uses(1)
            if passed_over < 2 * len(self.rows) and self._skips(*use):
                passed_over += 1
                self.skipped += 1
                continue
            passed_over = 0
            uses.append(use)
        return uses

    def _skips(self, epoch: int, index: int) -> bool:
        rate = self.pass_rates.get(index)
        if rate is None or self.low < rate < self.high:
            return False
        chance = self.revisit
        if rate <= self.low and self.retry_unsolved:
            since = epoch - self.unsolved.get(index, epoch - 1)
            chance = max(chance, self.retry_unsolved ** max(since, 1))
        digest = hashlib.blake2b(f"{self.seed}/{epoch}/{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 >= chance

    def update(self, results: list[RowResult]) -> None:
        for result in results:
            if result.rewards:
                passed = sum(reward >= self.pass_reward for reward in result.rewards)
                rate = self.pass_rates[result.index] = passed / len(result.rewards)
                if rate <= self.low:
                    self.unsolved.setdefault(result.index, self.epoch)
                else:
                    self.unsolved.pop(result.index, None)

    def in_band(self) -> float:
        """Share of the rows measured so far whose pass rate lies inside the band."""
        return self.metrics()["in_band"]

    def metrics(self) -> dict[str, float]:
        """``sampler/measured`` rows, the shares of them ``in_band``, ``solved`` (at or above
        ``high``) and ``unsolved`` (at or below ``low``), and the rows ``skipped`` so far."""
        solved = unsolved = 0
        for rate in self.pass_rates.values():  # one pass: this runs after every step
            solved += rate >= self.high
            unsolved += rate <= self.low
        measured = len(self.pass_rates)
        share = 1 / measured if measured else 0.0
        return {
            "measured": measured,
            "in_band": (measured - solved - unsolved) * share,
            "solved": solved * share,
            "unsolved": unsolved * share,
            "skipped": self.skipped,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "pass_rates": {str(index): rate for index, rate in self.pass_rates.items()},
            "unsolved_since": {str(index): epoch for index, epoch in self.unsolved.items()},
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pass_rates = {int(index): float(rate) for index, rate in state.get("pass_rates", {}).items()}
        self.unsolved = {int(index): int(epoch) for index, epoch in state.get("unsolved_since", {}).items()}
        self.skipped = int(state.get("skipped", 0))


class SamplerError(ConfigError):
    """``data.sampler`` names no sampler, or its options do not fit it."""


SamplerFactory = Callable[..., Sampler]
_SAMPLERS = Registry[SamplerFactory](
    "sampler",
    unknown="data.sampler: unknown sampler {name!r}; registered: {known} (or give module:Class, "
    "or import the module that registers it before the run)",
    error=SamplerError,
)
_SAMPLERS.register("uniform", UniformSampler)
_SAMPLERS.register("pass_rate", PassRateSampler)


def register_sampler(name: str) -> Callable[[SamplerFactory], SamplerFactory]:
    """Make a sampler class (or factory) available as ``data.sampler: NAME``."""
    return _SAMPLERS.decorator(name)


def registered_samplers() -> list[str]:
    return _SAMPLERS.names()


def make_sampler(spec: str | dict[str, Any], rows: list[Row], *, seed: int, shuffle: bool = True) -> Sampler:
    """The sampler ``data.sampler`` asks for: a name (registered, or ``module:Class`` /
    ``module.Class``), or ``{name: ..., option: value, ...}``."""
    options = dict(spec) if isinstance(spec, dict) else {"name": spec}
    name = options.pop("name", None)
    if not isinstance(name, str) or not name:
        raise SamplerError(f"data.sampler: {{name: ...}} needs the sampler's name, got {spec!r}")
    # A registered name, else an import path; a name that is neither: the registry's SamplerError.
    is_path = ":" in name or "." in name
    factory = _SAMPLERS.get(name) if name in _SAMPLERS or not is_path else _import(name)
    try:
        sampler = factory(rows, seed=seed, shuffle=shuffle, **options)
    except (TypeError, ValueError) as exc:  # an option it does not take, or a bad value
        raise SamplerError(f"data.sampler {name!r}: {exc}") from exc
    if not isinstance(sampler, Sampler):
        raise SamplerError(
            f"data.sampler {name!r} made a {type(sampler).__name__}, not a rlasync.data.Sampler"
        )
    return sampler


def _import(name: str) -> SamplerFactory:
    found = import_object(name, "data.sampler", SamplerError)
    if not callable(found):
        raise SamplerError(f"data.sampler: {name!r} is not a class or factory")
    return found
