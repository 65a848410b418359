"""User code a run imports first: ``plugins: [my_package.rl, ./my_plugin.py]`` in the config,
or ``rlasync train CONFIG --plugin ./my_plugin.py``.

A plugin is a module, by its dotted name (installed, or on ``PYTHONPATH``), or a Python file,
by its path. Importing it is all that happens: what it registers there (agent loops with
``rlasync.agents.register``, tools with ``rlasync.tools.register_tool``, rewards with
``rlasync.rewards.register_reward``, samplers with ``rlasync.data.register_sampler``, dataset
generators with ``rlasync.data.register_generator``, interactions with
``rlasync.agents.register_interaction``, trackers) is then a name the config can use.

    # my_plugin.py
    from rlasync.rewards import register_reward

    @register_reward("shorter_is_better")
    def shorter_is_better(inp):
        return 1.0 / (1 + len(inp.response_text))

Every process of a run imports the plugins before it starts work: the head, before the config's
names are looked up, and each node before it joins (``runtime.preload_modules``), so a loop or a
reward that runs next to a node's engine is registered there too. A file is imported under a
module name made from its absolute path (the same file is imported once per process); on other
hosts it must lie at the same path (a shared folder, or the same checkout).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from .config.loader import ConfigError


class PluginError(ConfigError):
    """A plugin could not be found or raised while it was imported; the message names it."""


def is_file(spec: str) -> bool:
    """A plugin given as a file path (``x.py``, or any name with a ``/``), not a module name."""
    return spec.endswith(".py") or "/" in spec


def resolved(specs: Iterable[str]) -> tuple[str, ...]:
    """``specs`` with file paths made absolute (against the working directory), each once: what
    travels to other processes, whose working directory may differ."""
    return tuple(dict.fromkeys(str(Path(s).expanduser().resolve()) if is_file(s) else s for s in specs))


def load(spec: str) -> ModuleType:
    """Import one plugin (a module name or a file path); importing it again returns the same module."""
    if is_file(spec):
        return _load_file(Path(spec).expanduser().resolve(), spec)
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (spec == exc.name or spec.startswith(exc.name + ".")):
            raise PluginError(
                f"plugin {spec!r}: no module named {exc.name!r} (install it, add its folder to PYTHONPATH, "
                "or give the file's path, e.g. ./my_plugin.py)"
            ) from None
        raise PluginError(f"plugin {spec!r} failed while importing: {_failure(exc)}") from exc
    except Exception as exc:
        raise PluginError(f"plugin {spec!r} failed while importing: {_failure(exc)}") from exc


def load_all(specs: Iterable[str]) -> list[ModuleType]:
    """Import every plugin, in order."""
    return [load(spec) for spec in specs]


def _load_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        shown = "" if str(path) == spec else f" {path}"
        raise PluginError(
            f"plugin {spec!r}: no such file{shown} (a relative path is taken from the directory rlasync runs in)"
        )
    digest = hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()
    name = f"rlasync_plugin_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        raise PluginError(f"plugin {spec!r}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = (
        module  # before running it: a class it defines must find its module (pickle, dataclasses)
    )
    try:
        found.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        raise PluginError(f"plugin {spec!r} failed while importing: {_failure(exc)}") from exc
    return module


def _failure(exc: BaseException) -> str:
    """The exception and the plugin line it came from (the last frame outside the import machinery)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
