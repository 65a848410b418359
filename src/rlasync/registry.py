"""``Registry[T]``: the things of one kind (agent loops, tools, samplers, rewards, ...) that a
config names, each registered under its name. Every registry in the package is one of these.

    _SAMPLERS = Registry[SamplerFactory]("sampler")

    @_SAMPLERS.decorator("uniform")
    class UniformSampler(Sampler): ...

    _SAMPLERS.get("uniform")      # UniformSampler
    _SAMPLERS.get("nope")         # KeyError: unknown sampler 'nope'; registered: uniform

- Registering a name again replaces its value. A registry made with ``taken`` (a message) is
  stricter: another value under a taken name raises ``ValueError(taken)``, unless ``same(old,
  new)`` (by default: the same class or function defined again, as when a module is re-imported)
  or the call says ``replace=True``.
- ``get`` of an unknown name raises ``error(unknown)``, the message listing the registered names.

The messages are ``str.format`` templates, given ``kind`` (the registry's kind, as messages
name it), ``name``, ``known`` (the registered names, sorted and joined with ", "), ``names``
(the same as a list) and, for ``taken``, ``old`` (the value registered now).

A leaf: imports nothing from rlasync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def same_definition(old: object, new: object) -> bool:
    """Whether ``new`` is ``old`` or defined at the same place (module and qualified name)."""
    where = _where(old)
    return old is new or (None not in where and where == _where(new))


def _where(value: object) -> tuple[str | None, str | None]:
    return getattr(value, "__module__", None), getattr(value, "__qualname__", None)


class Registry(Generic[T]):
    """Values of one kind by name (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        *,
        unknown: str = "unknown {kind} {name!r}; registered: {known}",
        error: Callable[[str], Exception] = KeyError,
        taken: str | None = None,
        same: Callable[[T, T], bool] = same_definition,
    ) -> None:
        self.kind = kind
        self._unknown, self._error, self._taken, self._same = unknown, error, taken, same
        self._entries: dict[str, T] = {}

    def register(self, name: str, value: T, *, replace: bool = False) -> T:
        old = self._entries.get(name)
        if old is not None and self._taken is not None and not replace and not self._same(old, value):
            raise ValueError(self._message(self._taken, name, old=old))
        self._entries[name] = value
        return value

    def decorator(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """``@registry.decorator(name)``: ``register(name, <the decorated class or function>)``."""
        return lambda value: self.register(name, value, replace=replace)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise self._error(self._message(self._unknown, name)) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def view(self) -> Mapping[str, T]:
        """A read-only mapping of the entries, live (for code that takes a plain mapping)."""
        return MappingProxyType(self._entries)

    def copy(self) -> Registry[T]:
        """Another registry with the same rules and entries (tests register into one)."""
        other = Registry[T](
            self.kind, unknown=self._unknown, error=self._error, taken=self._taken, same=self._same
        )
        other._entries = dict(self._entries)
        return other

    def _message(self, template: str, name: str, **more: Any) -> str:
        names = self.names()
        return template.format(kind=self.kind, name=name, known=", ".join(names), names=names, **more)
