"""Environments: where a run's rows come from and how they are scored (``data.source``).

``Environment`` is the protocol (rows, the environment's turns, score); every run has one:
``data.source``'s (the adapters: ``reasoning_gym``, ``verifiers``, ``textarena``, ``openenv``),
else ``files`` (the data files) or ``synthetic`` (``train.task``). Register your own with
``@register_environment(name)`` in a plugin.
"""

from .base import (
    EnvError,
    Environment,
    Interaction,
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
    "Interaction",
    "MissingExtraError",
    "Split",
    "make_environment",
    "register_environment",
    "registered_environments",
    "source_options",
]
