"""The tool-parser registry: ``@register_parser(name)`` on a class, ``get_parser(name)`` its one instance."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ...registry import Registry
from .base import ToolParser

P = TypeVar("P", bound=type[ToolParser])
_PARSERS = Registry[type[ToolParser]](
    "tool parser",
    unknown="unknown tool parser '{name}'; registered: {known}",
    taken="parser name '{name}' is taken by {old.__module__}.{old.__qualname__}",
)
_INSTANCES: dict[str, ToolParser] = {}  # parsers are stateless: one shared instance per name


def register_parser(name: str) -> Callable[[P], P]:
    """Class decorator: ``@register_parser("hermes")`` makes the parser available to ``get_parser``."""

    def decorate(cls: P) -> P:
        _PARSERS.register(name, cls)
        cls.name = name
        _INSTANCES.pop(name, None)  # a class registered again: the next get_parser builds it
        return cls

    return decorate


def get_parser(name: str) -> ToolParser:
    """The shared instance of the parser registered under ``name``."""
    if name not in _INSTANCES:
        _INSTANCES[name] = _PARSERS.get(name)()
    return _INSTANCES[name]


def registered_parsers() -> list[str]:
    return _PARSERS.names()
