"""Actors: classes whose ``@endpoint`` methods can be called from any node.

    class Counter(Actor):
        def __init__(self, start: int) -> None:
            self.value = start

        @endpoint
        async def add(self, n: int) -> int:
            self.value += n
            return self.value

        @endpoint
        async def count_to(self, n: int) -> AsyncIterator[int]:   # streaming endpoint
            for i in range(n):
                yield i

    counter = await node.spawn(Counter, 0, node=1, name="counter")
    await counter.add(2)                      # type-checks against Counter.add
    async for i in counter.count_to(3): ...

Endpoints of one actor run concurrently, like tasks on one event loop: an endpoint that
must not interleave with another takes an ``asyncio.Lock`` of its own.

Arguments and return values are checked against the endpoint's annotations on arrival
(``msgspec.convert``): a Struct parameter arrives as that Struct, a wrong type is refused
with an ``ActorError`` naming the parameter.
"""

from __future__ import annotations

import inspect
import logging
import typing
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

import msgspec

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
R_co = TypeVar("R_co", covariant=True)
T_co = TypeVar("T_co", covariant=True)

# Annotations that accept whatever arrives: no conversion, no check.
_ANYTHING = {Any, inspect.Parameter.empty}
# Plain types: a value of exactly this type passes as it is (the common case costs one type
# check); anything else goes through msgspec, which turns an int into a float and refuses the rest.
_PLAIN = {int, float, str, bool, bytes, dict, list, type(None), None}


class BoundEndpoint(Protocol[P, R_co]):
    """An endpoint reached through an actor ref: call it and await the answer."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def options(self, *, timeout: float | None = None) -> BoundEndpoint[P, R_co]: ...


class BoundStream(Protocol[P, T_co]):
    """A streaming endpoint reached through an actor ref: ``async for`` over its items."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T_co]: ...

    def options(self, *, timeout: float | None = None) -> BoundStream[P, T_co]: ...


class _EndpointBase:
    streaming = False

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self._arg_converters: (
            tuple[dict[str, Callable[[Any], Any]], list[str], Callable[[Any], Any] | None] | None
        ) = None
        self._result_converter: Callable[[Any], Any] | None | bool = False  # False: not computed yet

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        # On the actor itself an endpoint is an ordinary bound method (no runtime in between).
        return self.fn.__get__(obj, owner)

    # -- typed decoding of arguments and results --------------------------------------------
    def _hints(self) -> dict[str, Any]:
        try:
            return typing.get_type_hints(self.fn)
        except Exception as exc:  # an unresolvable forward reference: skip conversion, say so once
            log.warning(
                "endpoint %s: cannot resolve annotations (%s); values arrive undecoded", self.name, exc
            )
            return {}

    def convert_args(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Decode wire values into the annotated parameter types; raise ``TypeError`` naming the parameter."""
        if self._arg_converters is None:
            hints = self._hints()
            params = list(inspect.signature(self.fn).parameters.values())[1:]  # skip self
            by_name: dict[str, Callable[[Any], Any]] = {}
            positional: list[str] = []
            var_positional = None
            for p in params:
                conv = converter_for(hints.get(p.name, Any))
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    positional.append(p.name)
                if p.kind is p.VAR_POSITIONAL:
                    var_positional = conv
                elif conv is not None:
                    by_name[p.name] = conv
            self._arg_converters = (by_name, positional, var_positional)
        by_name, positional, var_positional = self._arg_converters
        if not by_name and var_positional is None:
            return args, kwargs
        name = "?"
        try:
            for i, value in enumerate(args):
                if i < len(positional):
                    name = positional[i]
                    conv = by_name.get(name)
                else:
                    name, conv = f"*args[{i - len(positional)}]", var_positional
                if conv is not None:
                    args[i] = conv(value)
            for name, value in kwargs.items():
                conv = by_name.get(name)
                if conv is not None:
                    kwargs[name] = conv(value)
        except msgspec.ValidationError as exc:
            raise TypeError(f"argument {name!r} of {self.name}: {exc}") from None
        return args, kwargs

    def result_converter(self) -> Callable[[Any], Any] | None:
        if self._result_converter is False:
            hint = self._hints().get("return", Any)
            if self.streaming:
                inner = typing.get_args(hint)
                hint = inner[0] if inner else Any
            self._result_converter = converter_for(hint)
        return self._result_converter  # type: ignore[return-value]


class Endpoint(_EndpointBase, Generic[P, R]):
    """An ``async def`` method callable from other nodes (made by ``@endpoint``)."""

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> BoundEndpoint[P, R]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return super().__get__(obj, owner)


class StreamEndpoint(_EndpointBase, Generic[P, T]):
    """An async-generator method whose items stream to the caller (made by ``@endpoint``)."""

    streaming = True

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> StreamEndpoint[P, T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> BoundStream[P, T]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return super().__get__(obj, owner)


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Endpoint[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> StreamEndpoint[P, T]: ...
def endpoint(fn: Callable[..., Any]) -> Any:
    """Mark an ``async def`` method (or an async generator, for streaming) as remotely callable."""
    if inspect.isasyncgenfunction(fn):
        return StreamEndpoint(fn)
    if inspect.iscoroutinefunction(fn):
        return Endpoint(fn)
    raise TypeError(
        f"@endpoint needs an `async def` method or an async generator; {fn.__qualname__} is neither "
        "(blocking work belongs in a thread: `await asyncio.to_thread(...)` inside an async endpoint)"
    )


def endpoints_of(cls: type) -> dict[str, _EndpointBase]:
    """The endpoints of an actor class (inherited ones included), by name; cached per class."""
    cached = cls.__dict__.get("_rlasync_endpoints")
    if cached is None:
        cached = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, _EndpointBase):
                    cached[name] = value
                elif name in cached:  # overridden by a plain attribute
                    del cached[name]
        type.__setattr__(cls, "_rlasync_endpoints", cached)
    return cached


class Actor:
    """Base class of actors. Subclass it, mark methods with ``@endpoint``, spawn it on a node.

    The hosting node sets ``self.node`` (what an actor may ask of it: ``host.Host``) and
    ``self.name`` before ``on_start`` runs.
    """

    node: Host
    name: str

    async def on_start(self) -> None:
        """Runs once on the hosting node after construction, before any call is served."""

    async def on_stop(self) -> None:
        """Runs once when the hosting node stops (not when it is killed)."""


def _passthrough(kind: type, value: Any) -> Any:
    # Values msgspec does not know (tensors, actor refs) were rebuilt by the codec already.
    if isinstance(value, kind):
        return value
    raise msgspec.ValidationError(f"Expected `{kind.__name__}`, got `{type(value).__name__}`")


def converter_for(hint: Any) -> Callable[[Any], Any] | None:
    """A function turning a decoded wire value into ``hint``, or None if nothing to do."""
    if hint in _ANYTHING or isinstance(hint, TypeVar):
        return None
    if hint in _PLAIN:
        kind = type(None) if hint is None else hint

        def check(value: Any) -> Any:
            if type(value) is kind:
                return value
            return msgspec.convert(value, kind)

        return check
    module = getattr(hint, "__module__", "")
    if module.startswith("torch") or getattr(hint, "__name__", "") == "ActorRef":
        return None
    if isinstance(hint, type) and issubclass(hint, Actor):  # a ref typed as its actor class
        return None

    def convert(value: Any) -> Any:
        return msgspec.convert(value, hint, dec_hook=_passthrough)

    return convert
