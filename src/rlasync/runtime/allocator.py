"""The memory allocator a run's processes use (``runtime.allocator``).

glibc's malloc keeps the memory of freed blocks below its mapping threshold for reuse, and a
trainer frees many large temporaries a step: a LoRA step on SmolLM2-135M held 6.6 GB of RSS
under it for 3.4 GB in use, 3.5 GB under tcmalloc (``benchmarks/lora_bench.py``). tcmalloc and
jemalloc hand such memory back; tcmalloc's steps were also the fastest (full fine-tuning 16.1 s
against glibc's 17.8 s and jemalloc's 21.1 s), so ``auto`` prefers it. PyTorch's CPU tuning
guide and vLLM's CPU build recommend them for the same reason.

An allocator is chosen when a process starts, so a command that is not running under the one
its config names starts again under it (``run_under_allocator``, before anything heavy is
imported), and every process it starts (node processes, trainer ranks, forked or exec'd)
inherits it.

    env = allocator_env("auto")   # os.environ, LD_PRELOAD=libtcmalloc_minimal.so.4 ahead where installed
    run_under_allocator("auto")   # execs this command again under it, once; else returns
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..config.errors import ConfigError

LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
"""Each allocator's library names, as ``ctypes.util.find_library`` takes them, in preference."""
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
"""The Debian packages that install them."""
AUTO_ORDER = ("tcmalloc", "jemalloc")
"""``auto`` takes the first installed (tcmalloc's steps were the fastest of the three measured)."""
REEXEC_ENV = "RLASYNC_ALLOCATOR_REEXEC"
"""The allocator a command was started again under: if it still does not run under it (the
library would not load), it goes on as it is rather than starting again and again."""


_COMMAND = False
"""Whether this process is an ``rlasync`` command (``rlasync.__main__.run``), which may start
itself again; a command called inside another program (a test's runner) never does."""


def is_the_command() -> None:
    """Mark this process as the ``rlasync`` command itself (``rlasync.__main__.run``)."""
    global _COMMAND
    _COMMAND = True


class AllocatorError(ConfigError):
    """The allocator ``runtime.allocator`` names is not installed on this machine: a setting to
    change, so every command reports it as it reports a malformed config."""


@functools.cache
def _library(allocator: str) -> str | None:
    """The shared library's file name (``libtcmalloc_minimal.so.4``), or None where not installed."""
    for name in LIBRARIES[allocator]:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def resolve(setting: str) -> tuple[str, str] | None:
    """``runtime.allocator`` -> (allocator, its library), or None for glibc's malloc.

    ``auto``: the first of ``AUTO_ORDER`` that is installed, else glibc's; a named one that is
    not installed is an ``AllocatorError`` naming its package."""
    if setting == "glibc":
        return None
    if setting == "auto":
        for allocator in AUTO_ORDER:
            library = _library(allocator)
            if library:
                return allocator, library
        return None
    library = _library(setting)
    if library is None:
        raise AllocatorError(
            f"runtime.allocator={setting}: its library is not installed here "
            f"(apt-get install {PACKAGES[setting]}; or runtime.allocator=auto or glibc)"
        )
    return setting, library


def loaded() -> str | None:
    """The allocator this process runs under (its library is mapped), or None for glibc's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to tell, nothing preloaded
        return None
    return next((a for a, names in LIBRARIES.items() if any(f"lib{n}." in maps for n in names)), None)


def allocator_env(setting: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's by default) for a process about to be started under the allocator
    ``setting`` resolves to: it first in ``LD_PRELOAD``, the other allocators taken out, the rest
    of what was preloaded kept. glibc's adds nothing and takes out only what a start again under
    an allocator put there (``REEXEC_ENV`` set): an allocator the user preloaded stays."""
    out = dict(os.environ if env is None else env)
    chosen = resolve(setting)
    if chosen is None and REEXEC_ENV not in out:
        return out
    ours = {f"lib{name}." for names in LIBRARIES.values() for name in names}
    kept = [p for p in out.get("LD_PRELOAD", "").split() if not any(o in Path(p).name for o in ours)]
    preload = ([chosen[1]] if chosen is not None else []) + kept
    if preload:
        out["LD_PRELOAD"] = " ".join(preload)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def run_under_allocator(setting: str, extra_env: Mapping[str, str] | None = None) -> None:
    """Start this command again under the allocator ``setting`` names, unless it already runs
    under it (or glibc's is wanted, or it was started again once already, or this process is
    not the command but a program that called it): ``os.execve`` of
    ``python -m rlasync`` with the same arguments, standard streams and process id. Call it before
    torch is imported and before any thread starts. ``extra_env``: what the new process needs
    that this one read and cannot read again (a ticket taken from stdin)."""
    chosen = resolve(setting)
    if not _COMMAND or chosen is None or loaded() == chosen[0] or os.environ.get(REEXEC_ENV) == chosen[0]:
        return
    env = allocator_env(setting)
    env.update(extra_env or {})
    env[REEXEC_ENV] = chosen[0]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rlasync", *sys.argv[1:]], env)
