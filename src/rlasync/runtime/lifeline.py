"""A child process's lifeline to the process that started it: it dies with its parent.

A node started as another's child (a supervised process, a local cluster's node) is told
its parent's pid through its environment (``PARENT_ENV``). On Linux the kernel sends it
SIGTERM when the parent exits (``PR_SET_PDEATHSIG``), and it also checks its parent every
second (``watch_parent``), so a parent killed with SIGKILL leaves no orphan behind, on any
system. A spawner and the commands it forks hold the same line, with SIGKILL.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

PARENT_ENV = "RLASYNC_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def parent_from_env() -> int | None:
    """The pid this process must die with, if a node started it as its child."""
    raw = os.environ.get(PARENT_ENV)
    return int(raw) if raw and raw.isdigit() else None


def set_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: watch_parent still notices
            log.debug("prctl(PR_SET_PDEATHSIG) is unavailable; polling the parent instead")


def die_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGTERM when the parent exits (Linux); False if the parent is gone already."""
    set_death_signal(signal.SIGTERM)
    return os.getppid() == parent  # checked after prctl: a parent that died just before is seen here


async def watch_parent(parent: int, on_gone: Callable[[], None], period_s: float = 1.0) -> None:
    """Call ``on_gone`` once the parent process has exited (its child is then re-parented)."""
    while os.getppid() == parent:
        await asyncio.sleep(period_s)
    log.warning("the node process that started this one (pid %d) is gone; stopping", parent)
    on_gone()
