"""Reward functions by name, and the one safe way to call them.

A reward function takes a ``RewardInput`` and returns a ``float`` or a ``RewardOutput``
(score plus metrics). It may be sync or async. ``@register_reward("name")`` makes it
available to configs and dataset rows by name; ``get_reward(name)`` looks it up (and fails
loudly on an unknown name, so resolve names at startup).

``compute_reward`` is what rollouts call. Its contract: it never raises for a reward's
failure. An exception, a timeout, or a result that is not a finite number becomes
``RewardOutput(score=0.0, metrics={"error": "Type: message"})`` and one warning per
(reward, error type) in the log, because one bad sample must not take down thousands of
concurrent trajectories. Cancellation of the caller still propagates.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from ..registry import Registry

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
"""Default deadline of one reward call (``compute_reward(timeout_s=...)``)."""


class RewardError(RuntimeError):
    """Every reward of a training batch failed (``train.fail_on_reward_errors``): the reward
    function is broken, or is not the one the rows need."""


class RewardInput(msgspec.Struct, frozen=True, kw_only=True):
    """What a reward function sees of one finished trajectory."""

    response_text: str
    """The final assistant answer text (the last assistant turn's content)."""
    full_text: str = ""
    """The whole generated conversation as text (every turn), for format rewards."""
    messages: list[dict[str, Any]] = []
    """The conversation as chat messages, the prompt's included (a judge reads the question)."""
    ground_truth: str | None = None
    """The expected answer, when the task has one."""
    num_tool_calls: int = 0
    """Tool calls the model made over the trajectory."""
    tool_errors: int = 0
    """Tool calls that failed (malformed call, unknown tool, tool raised or timed out)."""
    extra: dict[str, Any] = {}
    """Anything else the dataset row or the agent loop passes along."""


class RewardOutput(msgspec.Struct, kw_only=True):
    """A reward's score and its per-trajectory metrics (``error`` holds a failure)."""

    score: float
    metrics: dict[str, float | str] = {}


RewardResult = float | RewardOutput
RewardFn = Callable[[RewardInput], RewardResult | Awaitable[RewardResult]]
"""A reward function: sync or async, ``RewardInput`` in, score or ``RewardOutput`` out."""

F = TypeVar("F", bound=RewardFn)

# Refusing, by identity: another function under a taken name needs replace=True.
_REGISTRY = Registry[RewardFn](
    "reward",
    unknown="unknown reward {name!r}; registered: {names} "
    "(register your own with @rlasync.rewards.register_reward(name) in a module you import)",
    error=ValueError,
    taken="reward {name!r} is already registered ({old!r}); pass replace=True to override it",
    same=lambda old, new: old is new,
)
_warned: set[tuple[Any, str]] = set()  # (reward name or function, error type) already logged


def register_reward(name: str, *, replace: bool = False) -> Callable[[F], F]:
    """Decorator: register a reward function under ``name``.

    Registering another function under a taken name raises unless ``replace=True``
    (registering the same function again is a no-op, so re-imports are harmless).
    """

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}): {fn!r} is not callable")
        _check_signature(name, fn)
        _REGISTRY.register(name, fn, replace=replace)
        return fn

    return decorator


def call_mismatch(fn: Callable[..., Any], *args: Any) -> str:
    """Why ``fn(*args)`` would fail to bind, as ``"name(signature) (the error)"``; "" when it
    binds, or when ``fn`` shows no signature (a builtin: its first call tells)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    try:
        signature.bind(*args)
    except TypeError as exc:
        return f"{getattr(fn, '__qualname__', type(fn).__name__)}{signature} ({exc})"
    return ""


def _check_signature(name: str, fn: Callable[..., Any]) -> None:
    """A registered reward is called as ``fn(inp)``: say so now, not with a 0.0 per trajectory."""
    mismatch = call_mismatch(fn, RewardInput(response_text=""))
    if mismatch:
        raise TypeError(
            f"register_reward({name!r}): {mismatch} cannot be called as fn(inp): a registered reward takes one "
            "RewardInput and returns a float or a RewardOutput. A function of (row, trajectory) is an agent loop's "
            "reward_fn: hand it to the loop instead"
        )


def get_reward(name: str) -> RewardFn:
    """The reward function registered under ``name``."""
    return _REGISTRY.get(name)


RewardFactory = Callable[..., RewardFn]
"""What builds a reward from options: ``factory(**options)`` (the ``llm_judge``'s class)."""

_FACTORIES = Registry[RewardFactory]("reward factory")


def register_reward_factory(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: a reward built from the config's options, ``data.reward: {<name>: {...}}``."""
    return _FACTORIES.decorator(name)


def make_reward(spec: str | dict[str, Any]) -> RewardFn:
    """The reward a setting names: a registered reward by name, or ``{name: {options}}`` (or
    ``{name: ..., option: ...}``) of a reward factory, built. A wrong name or option is a
    ``ValueError`` naming it."""
    if isinstance(spec, str):
        return get_reward(spec)
    options = factory_options(spec)
    name = options.pop("name", None)
    if not isinstance(name, str) or name not in _FACTORIES:
        raise ValueError(
            f"data.reward: no reward factory named {name!r} (factories: {', '.join(_FACTORIES.names()) or 'none'}; "
            f"rewards by name: {', '.join(registered_rewards())})"
        )
    try:
        return _FACTORIES.get(name)(**options)
    except TypeError as exc:
        raise ValueError(f"data.reward.{name}: {exc}") from None


def factory_options(spec: dict[str, Any]) -> dict[str, Any]:
    """A factory's setting as ``{name: ..., option: value}``, written either way
    (``{llm_judge: {url: ...}}`` or ``{name: llm_judge, url: ...}``)."""
    options = dict(spec)
    if len(options) == 1 and "name" not in options and isinstance(next(iter(options.values())), dict | None):
        ((name, given),) = options.items()
        options = {"name": name, **(given or {})}
    return options


def registered_rewards() -> list[str]:
    """Names of all registered rewards, sorted."""
    return _REGISTRY.names()


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an async function, a partial of one, an object whose ``__call__`` is one)."""
    # partials of coroutine functions are recognised by inspect; callable objects by their __call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _as_output(result: object) -> RewardOutput:
    metrics: dict[str, float | str] = {}
    if isinstance(result, RewardOutput):
        score: object = result.score
        metrics = result.metrics
    elif isinstance(result, numbers.Real):  # float, int, bool, numpy scalars
        score = result
    else:
        raise TypeError(f"a reward must return a float or a RewardOutput, got {type(result).__name__}")
    if not isinstance(score, numbers.Real) or not math.isfinite(float(score)):
        raise ValueError(f"reward score must be a finite number, got {score!r}")
    return RewardOutput(score=float(score), metrics=metrics)


async def compute_reward(
    name_or_fn: str | RewardFn, inp: RewardInput, *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> RewardOutput:
    """Score ``inp`` with a reward (a registered name or the function itself); never raises for its failure.

    Sync functions run in a worker thread (``asyncio.to_thread``): a reward may parse, call
    sympy or read files, and the event loop is driving every other trajectory meanwhile.
    Async functions are awaited. Either way the call has ``timeout_s`` seconds (``None``: no
    deadline). A sync function cannot be stopped: past its deadline it is abandoned and its
    thread finishes in the background, so a reward that can hang should be async and own its
    subprocess.

    Any ``Exception`` (an unknown name included), ``SystemExit`` (a reward calling
    ``sys.exit`` must not stop the node), a timeout, or a score that is not a finite
    number gives ``score=0.0`` and ``metrics["error"] = "Type: message"``. ``CancelledError``
    (the caller cancelled) propagates.
    """
    label = (
        name_or_fn
        if isinstance(name_or_fn, str)
        else getattr(name_or_fn, "__name__", type(name_or_fn).__name__)
    )
    deadline = asyncio.timeout(timeout_s)
    try:
        fn = get_reward(name_or_fn) if isinstance(name_or_fn, str) else name_or_fn
        async with deadline:
            if is_async(fn):
                result = await fn(inp)  # type: ignore[misc]
            else:
                result = await asyncio.to_thread(fn, inp)
                if inspect.isawaitable(result):  # a plain function that returned a coroutine
                    result = await result
        return _as_output(result)
    except TimeoutError as e:
        if deadline.expired():
            error = f"TimeoutError: reward {label!r} took longer than timeout_s={timeout_s}"
        else:  # the reward raised TimeoutError itself
            error = f"TimeoutError: {e}"
        return _failed(label, error)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (the contract: a reward's failure is a recorded 0.0; sys.exit too)
        return _failed(label, f"{type(e).__name__}: {e}")


def _failed(label: str, error: str) -> RewardOutput:
    warn_once(label, error)
    return RewardOutput(score=0.0, metrics={"error": error})


def warn_once(reward: str | Callable[..., Any], error: str, exc: BaseException | None = None) -> None:
    """A failing reward in the log (``error``: "Type: message"; ``exc``: its traceback), once
    per reward (a registered name, or an agent loop's function) and error type: it may fail
    for thousands of trajectories. The hot path is one set lookup."""
    key = (
        reward if getattr(reward, "__hash__", None) else id(reward),
        error.split(":", 1)[0],
    )  # a dataclass reward is unhashable
    if key not in _warned:
        _warned.add(key)
        label = reward if isinstance(reward, str) else getattr(reward, "__qualname__", type(reward).__name__)
        log.warning(
            "reward %r failed (scored 0.0; further %s errors of it are not logged): %s",
            label,
            key[1],
            error,
            exc_info=exc,
        )
