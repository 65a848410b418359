"""The protocol every task source of a run speaks: an ``Environment`` yields rows, may take the
environment's turns of a conversation, and scores what the model answered.

    data:
      source: {reasoning_gym: {task: basic_arithmetic, size: 2000}}   # which environment, its options

Every run has one: ``data.source`` names it; without one, the run's data files are the ``files``
environment (``data.train_files``, scored by ``data.reward`` or ``custom_reward_function``) and
the quickstart's ``train.task`` the ``synthetic`` one (``rlasync.envs.builtin``).

An environment is a class registered by name and built from its options
(``cls(seed=train.seed, **options)``) in every process that needs it: on the head, which draws
its rows (``rows``), and on each node that runs agent loops, which scores their trajectories
(``score``: sync or async, a ``RewardInput`` in, a score or a ``RewardOutput`` out, called
through ``compute_reward``, so a failure is a recorded 0.0, never a lost step). A row carries
what its score needs back (an index, a seed) as plain data: rows cross the wire.

    @register_environment("countdown_words")
    class CountdownWords(Environment):
        def __init__(self, *, seed: int, words: int = 3) -> None: ...
        def rows(self, split, n=None): ...
        def score(self, inp): ...            # or: async def converse(self, client, row): ...
        def interaction(self, row): ...      # optional: the user's turns between the model's

A package an environment needs and lacks is a ``MissingExtraError`` naming the extra that
installs it. Environments live above ``data`` and ``rewards`` (rows, and the reward contract)
and below the agent loops that run them.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from ..config.loader import ConfigError, registry_choice
from ..data import Row
from ..registry import Registry
from ..rewards import RewardInput, RewardOutput

Split = Literal["train", "val"]
"""Which rows: training rows, or held-out rows that validation scores (never trained on)."""


class Interaction(abc.ABC):
    """The environment's turns of one conversation (a simulated user, a game's referee): after
    each model turn without a tool call, the agent loop hands it the conversation, and it ends it
    or answers as the user (a turn the model is not trained on). One object per trajectory: it
    may keep what the conversation needs. From an environment (``Environment.interaction``) or
    the config (``agent.interaction``, built as ``cls(score, **options)``:
    ``rlasync.agents.interactions``)."""

    @abc.abstractmethod
    async def respond(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> tuple[bool, str, float]:
        """(end the conversation?, the user's next message, a reward for the model's last turn)."""


class EnvError(ConfigError):
    """``data.source`` names no registered environment, or options it does not take."""


class MissingExtraError(EnvError):
    """An environment needs a package that is not installed: the message names the extra."""


def import_extra(module: str, *, setting: str, package: str, extra: str) -> Any:
    """``module`` imported, or a ``MissingExtraError`` saying which setting needs which package,
    and the extra that installs it."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{setting} needs the {package} package: pip install 'rlasync[{extra}]'")
    return importlib.import_module(module)


class Environment(abc.ABC):
    """A source of rows and their scorer (see the module docstring). ``seed`` is the run's
    ``train.seed`` unless the options give their own.

    Two kinds: one whose rows our agent loops answer (``agent.default_loop``, or a row's
    ``agent_name``), scored by ``score``; and one that holds each trajectory's conversation itself
    (a game, a tool-using environment of another framework): its rows name the ``environment``
    loop, which hands ``converse`` an OpenAI client whose every call is recorded with its tokens,
    so the environment sees messages while the trajectory keeps the model's tokens exactly."""

    async def open(self) -> None:  # noqa: B027  (optional: most environments hold nothing)
        """Start what its conversations need on the node where they run (a server, a pool),
        before the first; ``close`` stops it."""

    async def close(self) -> None:  # noqa: B027
        """Stop what ``open`` started (the agent-loop worker's end)."""

    @abc.abstractmethod
    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        """``n`` rows of ``split`` (None: all the environment has of it), the same ones for the
        same options; held-out rows are never training rows. Each has ``messages`` and a unique
        ``uid``. Blocking (may generate)."""

    def score(self, inp: RewardInput) -> float | RewardOutput | Awaitable[float | RewardOutput]:
        """The reward of one finished trajectory of a row answered by our loops: ``inp.extra``
        holds the row's other fields, ``inp.ground_truth`` its ``ground_truth``. May raise: the
        caller records a 0.0."""
        raise NotImplementedError(f"{type(self).__name__} scores its conversations in converse, not here")

    async def converse(self, client: Any, row: Row) -> float | RewardOutput:
        """Hold one trajectory of ``row`` (whose ``agent_name`` is ``environment``) through
        ``client``, an ``openai.AsyncOpenAI``: each model turn is a call, the environment's turns
        are its own messages between them; its reward is returned. May raise: the trajectory
        then ends with termination ``error`` and reward 0."""
        raise NotImplementedError(f"{type(self).__name__} has rows our loops answer: it has no converse")

    score_timeout_s: float | None = None
    """How long one ``score`` may take when that is longer than a reward's default deadline (a
    judge's, a reward model's): the agent-loop worker waits that long (and a little more)."""

    def interaction(self, row: Row) -> Interaction | None:
        """The environment's turns of a trajectory of ``row`` answered by our loops (a loop that
        talks, such as ``tool``): a new ``Interaction``, or None (the default), which leaves the
        row's ``interaction_kwargs.name`` or ``agent.interaction`` to answer, if either does."""
        return None

    async def score_group(self, uids: list[str]) -> dict[str, RewardOutput]:
        """Rewards that look across a group: the trajectories ``uids`` (one prompt's copies,
        ``train.group_size`` of them, as ``converse`` or ``score`` finished them) scored together,
        each uid's replacing the reward it got alone (verifiers' group reward functions). Called
        by the agent-loop worker once a group's trajectories are all done; {} (the default):
        every trajectory keeps its own."""
        return {}


_ENVIRONMENTS = Registry[type[Environment]](
    "environment",
    taken="an environment named {name!r} is already registered ({old.__module__}.{old.__qualname__})",
)
_BUILT_IN = {
    "reasoning_gym": "rlasync.envs.reasoning_gym_env",
    "verifiers": "rlasync.envs.verifiers_env",
    "textarena": "rlasync.envs.textarena_env",
    "openenv": "rlasync.envs.openenv_env",
    "files": "rlasync.envs.builtin",
    "synthetic": "rlasync.envs.builtin",
}
"""The adapters' modules, imported when an environment not yet registered is named (each imports
its package only when built)."""


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: make the environment available as ``data.source: {<name>: {...}}``."""
    return _ENVIRONMENTS.decorator(name)


def registered_environments() -> list[str]:
    return sorted({*_ENVIRONMENTS.names(), *_BUILT_IN})


def source_options(spec: str | dict[str, Any]) -> dict[str, Any]:
    """``data.source`` as ``{name: ..., option: value}``: it may be written ``name``,
    ``{name: {options}}`` (one key) or ``{name: ..., option: value}``; ``{}`` when empty."""
    if isinstance(spec, dict) and len(spec) == 1 and "name" not in spec:
        ((name, options),) = spec.items()
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise EnvError(
                f"data.source.{name}: expected the environment's options as a mapping, got {type(options).__name__}"
            )
        return {"name": name, **options}
    return dict(spec) if isinstance(spec, dict) else {"name": spec} if spec else {}


def make_environment(spec: str | dict[str, Any], *, seed: int) -> Environment | None:
    """The environment ``data.source`` names, built (None when it names none). Options it does
    not take are an ``EnvError`` naming them."""
    options = source_options(spec)
    if not options:
        return None
    if options.get("name") not in _ENVIRONMENTS:  # the adapters: cheap to import (packages load when built)
        for module in dict.fromkeys(_BUILT_IN.values()):
            importlib.import_module(module)
    choice = registry_choice(
        options, "data.source", _ENVIRONMENTS.view(), "@rlasync.envs.register_environment", EnvError
    )
    assert choice is not None
    name, cls, options = choice
    if cls.score is Environment.score and cls.converse is Environment.converse:
        raise EnvError(f"data.source.{name}: {cls.__qualname__} defines neither score nor converse")
    options.setdefault("seed", seed)
    try:
        return cls(**options)
    except EnvError:
        raise
    except TypeError as exc:  # an option it does not take, or one it needs
        raise EnvError(f"data.source.{name}: {exc}") from None
