"""Environments: where a run's rows come from and how they are scored (``data.source``).

``Environment`` is the protocol (rows, score); ``reasoning_gym`` adapts reasoning-gym's
procedural tasks. Register your own with ``@register_environment(name)`` in a plugin.
"""

from .base import (
    EnvError,
    Environment,
    MissingExtraError,
    Split,
    make_environment,
    register_environment,
    registered_environments,
    source_options,
)

__all__ = [
    "Environment",
    "EnvError",
    "MissingExtraError",
    "Split",
    "make_environment",
    "register_environment",
    "registered_environments",
    "source_options",
]
