"""Simulated users chosen in the config (``agent.interaction``): a registry and a built-in one.

    agent:
      default_loop: tool                  # the loop that talks with a simulated user
      interaction: {name: retry, max_attempts: 3}

After each model turn without a tool call, the loop hands the conversation to its trajectory's
interaction, which ends it or answers as the user (verl's ``BaseInteraction``; a turn of the
environment: not trained on). The trajectory's reward is the run's reward of its final answer.

An interaction class is built once per trajectory as ``cls(score, **options)``: ``score(messages,
row)`` is the run's reward of a conversation ending with the model's last turn (0.0 if the reward
fails), for interactions that judge; others may ignore it. Register your own:

    @register_interaction("hint")
    class Hint(Interaction):
        def __init__(self, score, *, hint: str = "Think about the last character first.") -> None:
            self.score, self.hint, self.given = score, hint, False

        async def respond(self, messages, row):
            right = await self.score(messages, row) >= 1.0
            done, self.given = right or self.given, True
            return done, "" if done else self.hint, float(right)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from ..config.loader import ConfigError, registry_choice
from ..registry import Registry
from .base import Interaction, RewardFn
from .trajectory import Trajectory, TrajectoryMetrics

Score = Callable[[list[dict[str, Any]], dict[str, Any]], Awaitable[float]]
"""``score(messages, row)``: the run's reward of the conversation so far."""


class InteractionError(ConfigError):
    """``agent.interaction`` names no registered interaction, or options it does not take."""


# An unknown name is registry_choice's InteractionError, so no ``unknown`` message here.
_INTERACTIONS = Registry[type[Interaction]](
    "interaction",
    taken="an interaction named {name!r} is already registered ({old.__module__}.{old.__qualname__})",
)


def register_interaction(name: str) -> Callable[[type[Interaction]], type[Interaction]]:
    """Class decorator: make the interaction available as ``agent.interaction: <name>``."""
    return _INTERACTIONS.decorator(name)


def registered_interactions() -> list[str]:
    return _INTERACTIONS.names()


def interaction_factory(spec: str | dict[str, Any], score: Score) -> Callable[[], Interaction] | None:
    """What makes each trajectory's interaction from ``agent.interaction`` (``name`` or ``{name:
    ..., option: value}``; "" or ``{}``: none). One is built now, so a wrong name or option is
    an ``InteractionError`` at start-up rather than a failed trajectory each time."""
    choice = registry_choice(
        spec,
        "agent.interaction",
        _INTERACTIONS.view(),
        "@rlasync.agents.register_interaction",
        InteractionError,
    )
    if choice is None:
        return None
    name, found, options = choice
    cls: Callable[..., Interaction] = found  # built as cls(score, **options)
    try:
        cls(score, **options)
    except (TypeError, ValueError) as exc:
        raise InteractionError(f"agent.interaction {name!r}: {exc}") from None
    return lambda: cls(score, **options)


class RowInteractions:
    """Each trajectory's simulated user from the config: the one its row's
    ``interaction_kwargs.name`` picks (verl's rows name theirs; built with no options unless
    ``agent.interaction`` is that one), else ``agent.interaction``'s, else none. A row naming
    one not registered gets one that raises: that trajectory ends with the error, the others run."""

    def __init__(self, configured: str | dict[str, Any], score: Score) -> None:
        self.configured, self.score = configured, score
        self._default = interaction_factory(configured, score)
        self._named: dict[str, Callable[[], Interaction]] = {}  # a row's interaction_kwargs.name -> its maker

    def for_row(self, row: dict[str, Any]) -> Interaction | None:
        kwargs = row.get("interaction_kwargs")
        name = kwargs.get("name") if isinstance(kwargs, dict) else None
        if not name:
            return self._default() if self._default else None
        if name not in self._named:
            configured = self.configured
            configured_name = configured.get("name") if isinstance(configured, dict) else configured
            try:
                made = interaction_factory(configured if name == configured_name else name, self.score)
            except InteractionError as exc:
                error = InteractionError(f"a row's interaction_kwargs.name={name!r}: {exc}")
                made = functools.partial(_Refused, error)
            assert made is not None  # a name was given
            self._named[name] = made
        return self._named[name]()


class _Refused(Interaction):
    """The interaction of a row that names none registered: its trajectory ends with the error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def respond(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> tuple[bool, str, float]:
        raise self.error


def conversation_score(reward_fn: RewardFn | None) -> Score:
    """``score(messages, row)`` from a loop's reward: the reward of a trajectory holding just the
    conversation (what rewards read: its last assistant message). A failing reward scores 0.0."""

    async def score(messages: list[dict[str, Any]], row: dict[str, Any]) -> float:
        if reward_fn is None:
            return 0.0
        conversation = Trajectory(
            prompt_ids=[],
            response_ids=[],
            response_mask=[],
            logprobs=[],
            versions=[],
            reward=0.0,
            num_turns=0,
            termination="",
            metrics=TrajectoryMetrics(),
            messages=messages,
        )
        try:
            value = reward_fn(row, conversation)
            return float(await value if inspect.isawaitable(value) else value)
        except Exception:  # the loop's own reward of the final answer records the error
            return 0.0

    return score


@register_interaction("retry")
class RetryInteraction(Interaction):
    """A user who checks each answer: a wrong one is answered with ``feedback`` and the model
    tries again, up to ``max_attempts`` answers in all (verl's GSM8K interaction). Right (its
    score at least ``pass_reward``) or out of attempts, the conversation ends; the trajectory is
    rewarded on its final answer, so a model that corrects itself earns the reward."""

    def __init__(
        self,
        score: Score,
        *,
        max_attempts: int = 3,
        feedback: str = "Your answer is wrong. Try again.",
        pass_reward: float = 1.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.score, self.max_attempts, self.feedback, self.pass_reward = (
            score,
            max_attempts,
            feedback,
            pass_reward,
        )

    async def respond(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> tuple[bool, str, float]:
        value = await self.score(messages, row)
        # Counted from the conversation, not kept: a trajectory resumed from a checkpoint goes on
        # with a new interaction object.
        attempts = 1 + sum(m.get("role") == "user" and m.get("content") == self.feedback for m in messages)
        if value >= self.pass_reward or attempts >= self.max_attempts:
            return True, "", value
        return False, self.feedback, value
