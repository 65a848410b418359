"""Agent loops: one instance per trajectory (``LoopReuseError`` otherwise), picked by name from a registry.

    @register("my_loop")
    class MyLoop(AgentLoop):
        async def run(self, params: SamplingParams, **row: Any) -> Trajectory: ...

A dataset row picks its loop with an ``agent_name`` field, else ``agent.default_loop``.
Users register loops from their own modules: importing the module registers them.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..config.agent import AgentConfig
from ..engines.types import GenerateOutput, GenerateRequest, SamplingParams, TokenChunk
from ..envs.base import Interaction
from ..registry import Registry
from .template import ChatTurns
from .trajectory import Trajectory

if TYPE_CHECKING:
    from ..rewards import RewardFn as ScoreFn

RewardFn = Callable[[dict[str, Any], Trajectory], "float | Awaitable[float]"]
"""A loop's reward: ``reward_fn(row, trajectory)`` scores a finished trajectory given its
dataset row (sync or async). Checked when handed to a loop (``check_reward_fn``)."""


class LoopReuseError(RuntimeError):
    """One agent-loop object was asked for a second trajectory (a concurrent ``run``, or a
    ``run`` with another row). A loop holds one trajectory's state, which is how a cancelled
    ``run`` resumes: make a loop object per trajectory."""


class Generator(Protocol):
    """What a loop generates with: an ``Engine`` or a ``Router`` (which takes a session id)."""

    async def generate(self, request: GenerateRequest, **kwargs: Any) -> GenerateOutput: ...

    def generate_stream(self, request: GenerateRequest, **kwargs: Any) -> Any: ...


class AgentLoop(abc.ABC):
    shared: Any = None
    """What the loops of this class on one worker share (``shared_resource``); set by the worker."""
    environment: Any = None
    """The run's environment (an ``rlasync.envs.Environment``: ``data.source``, the data files'
    or the synthetic task's), opened on the worker; set by the worker (None outside a run)."""

    def __init__(
        self,
        engine: Generator,
        tokenizer: Any,
        config: AgentConfig | None = None,
        *,
        tools: dict[str, Any] | None = None,
        reward_fn: RewardFn | None = None,
        interaction: Interaction | None = None,
        trajectory_id: str = "",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.turns = ChatTurns(tokenizer)
        self.config = config or AgentConfig()
        self.tools = tools or {}
        self.reward_fn = check_reward_fn(reward_fn) if reward_fn is not None else None
        self.interaction = interaction
        self.trajectory_id = trajectory_id or f"traj-{id(self):x}"
        # A router takes a session id (every turn of this trajectory on one engine); an engine does not.
        self._session = {"session_id": self.trajectory_id} if takes_session(type(engine)) else {}

    @classmethod
    def shared_resource(
        cls, engine: Generator, tokenizer: Any, config: AgentConfig
    ) -> contextlib.AbstractAsyncContextManager[Any] | None:
        """A resource every loop of this class on one worker shares (the ``openai`` loop's HTTP
        endpoint): the worker enters it before the first such loop runs, hands what it yields
        to each loop as ``shared`` and exits it when the worker stops. None: none."""
        return None

    @abc.abstractmethod
    async def run(self, params: SamplingParams, **row: Any) -> Trajectory:
        """Roll out one trajectory for a dataset row (``messages``, and anything the reward reads)."""

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerateOutput]:
        """One model turn, as chunks (``agent.stream``) or whole (a turn cut short: finish
        reason "abort", with its tokens so far); sticky to one engine when the engine is a router.
        Whole is the default: a wake-up per token for every trajectory measured a quarter of the
        controller's time next to a tiny model's engine."""
        if self.config.stream:
            async for chunk in self.engine.generate_stream(request, **self._session):
                yield chunk
        else:
            yield await self.engine.generate(request, **self._session)

    async def _reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        if self.reward_fn is None:
            return 0.0
        try:
            value = self.reward_fn(row, trajectory)
            if inspect.isawaitable(value):
                value = await value
            return float(value)
        except (
            Exception,
            SystemExit,
        ) as exc:  # a reward bug (sys.exit too) is a recorded zero, not a lost trajectory, said once
            from ..rewards.registry import warn_once

            trajectory.metrics.reward_error = f"{type(exc).__name__}: {exc}"
            warn_once(self.reward_fn, trajectory.metrics.reward_error, exc)
            return 0.0


def check_reward_fn(fn: RewardFn) -> RewardFn:
    """``fn`` if a loop can call it as ``fn(row, trajectory)``; else a ``TypeError`` now, rather
    than a trajectory scored 0.0 by every call."""
    from ..rewards.registry import call_mismatch

    if not callable(fn):
        raise TypeError(f"reward_fn must be a function of (row, trajectory), got {type(fn).__name__}")
    mismatch = call_mismatch(fn, {}, None)
    if mismatch:
        raise TypeError(
            f"reward_fn {mismatch} cannot be called as reward_fn(row, trajectory): a loop passes the dataset row (a "
            "dict) and the finished Trajectory, and takes a float or an awaitable of one. A reward of RewardInput "
            "(rlasync.rewards) is handed to a loop as registered_reward(name)"
        )
    return fn


def registered_reward(
    name: str | dict[str, Any] | ScoreFn,
    *,
    ground_truth_key: str = "ground_truth",
    timeout_s: float | None = None,
) -> RewardFn:
    """A loop's ``reward_fn`` that scores with a reward from ``rlasync.rewards``: by name, built
    from a factory's options (``{llm_judge: {url: ...}}``, ``make_reward``), or the function
    itself (a ``RewardInput`` in: an environment's ``score``, a verl ``compute_score``), with
    ``timeout_s`` its deadline when it needs longer than the default.

    The reward reads the last assistant message, the whole conversation, the row's
    ``ground_truth_key`` field and the tool counts, and in ``extra`` the row's other fields
    (``uid``, a JSONL file's own columns: verl's ``extra_info``) with what the loop recorded in
    ``trajectory.extra`` over them; a reward that fails is a recorded zero. The name is checked
    now, so a typo fails at start-up instead of zeroing every reward.
    """
    from ..rewards import DEFAULT_TIMEOUT_S, RewardInput, compute_reward, make_reward

    reward = make_reward(name) if isinstance(name, str | dict) else name
    # A reward with a deadline of its own (a judge's, or ``timeout_s``: an environment's) gets
    # it, and a little more to report it.
    own = timeout_s if timeout_s is not None else float(getattr(reward, "timeout_s", 0.0))
    timeout_s = max(DEFAULT_TIMEOUT_S, own + 5.0)

    async def score(row: dict[str, Any], trajectory: Trajectory) -> float:
        answers = [m for m in trajectory.messages if m.get("role") == "assistant"]
        inp = RewardInput(
            response_text=str(answers[-1]["content"]) if answers else "",
            full_text="\n".join(str(m.get("content", "")) for m in trajectory.messages),
            messages=list(trajectory.messages),
            ground_truth=None if row.get(ground_truth_key) is None else str(row[ground_truth_key]),
            num_tool_calls=trajectory.metrics.tool_calls,
            tool_errors=trajectory.metrics.tool_errors,
            extra={
                **{k: v for k, v in row.items() if k not in ("messages", ground_truth_key)},
                **trajectory.extra,
            },
        )
        out = await compute_reward(reward, inp, timeout_s=timeout_s)
        if "error" in out.metrics:
            trajectory.metrics.reward_error = str(out.metrics["error"])
        return out.score

    return score


# The same class defined again (a module re-imported) replaces itself; another class may not.
_LOOPS = Registry[type[AgentLoop]](
    "agent loop",
    unknown="no agent loop named {name!r} (registered: {known}); register yours with @rlasync.agents.register",
    taken="an agent loop named {name!r} is already registered ({old.__module__}.{old.__qualname__})",
)


def register(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator: make the loop available as ``agent_name: <name>``."""
    return _LOOPS.decorator(name)


def get_loop(name: str) -> type[AgentLoop]:
    return _LOOPS.get(name)


@functools.cache
def takes_session(engine_type: type) -> bool:
    """Whether ``engine_type.generate`` takes a ``session_id`` (a ``Router`` does; an engine does not)."""
    try:
        return "session_id" in inspect.signature(engine_type.generate).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
