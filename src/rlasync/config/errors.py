"""``ConfigError``, the one error of a bad config: a leaf, so every config module can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the dotted path."""
