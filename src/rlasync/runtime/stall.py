"""Reports an event loop blocked past ``runtime.loop_stall_warn_s``, naming the code that holds it.

Blocking code in a coroutine (a script building a model inside ``async def main()``, a
synchronous HTTP call, ``time.sleep``) holds up every call, timer and reply on that loop. The
cluster survives it (liveness comes from libzmq's heartbeats, not from the loop), but the user
should hear of it: a thread, which needs no loop, watches a timestamp the loop refreshes a few
times a second; once the loop has not refreshed it for ``warn_after`` seconds, the thread reads
the loop thread's stack and logs one WARNING naming the task and the line that block it. When
the loop runs again, one INFO line says for how long it was held.

One watchdog per loop, however many nodes share it (``watch``/``unwatch`` count them).
``off_loop`` is how our own blocking work stays off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/rlasync
_LIBRARIES = tuple(
    {os.path.abspath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


class LoopWatchdog:
    """Watches one event loop from a thread of its own (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, warn_after: float, setting: str) -> None:
        self.loop = loop
        self.warn_after = warn_after
        self.setting = setting  # named in the warning, so the reader knows what to raise
        self.period = min(warn_after / 4, 0.25)
        self._last = time.monotonic()
        self._loop_thread = threading.get_ident()  # made on the loop's thread (``watch``)
        self._stop = threading.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="rlasync-loop-watchdog", daemon=True)

    def start(self) -> None:
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)

    def _tick(self) -> None:
        self._last = time.monotonic()
        self._timer = self.loop.call_later(self.period, self._tick)

    def _watch(self) -> None:
        reported = 0.0  # monotonic time the stall being reported began (0: none)
        while not self._stop.wait(self.period):
            if not self.loop.is_running():  # stopped between runs (a test's, a script's): not blocked
                self._last, reported = time.monotonic(), 0.0
                continue
            last = self._last
            held = time.monotonic() - last
            if held > self.warn_after and reported != last:
                reported = last
                holder = self._holder()
                if holder is None:
                    # No code of the loop's own ran: it waited for the interpreter (another thread
                    # holding the GIL, as torch does while it loads) or for a core (a loaded
                    # machine). News, not a fault of the code on the loop.
                    log.info(
                        "the event loop got no turn for %.1fs (another thread held the interpreter: %s; or "
                        "the machine is busy)",
                        held,
                        self._others(),
                    )
                    continue
                log.warning(
                    "the event loop has been blocked for %.1fs by %s: calls, timers and replies on it wait "
                    "meanwhile; move blocking work to `await asyncio.to_thread(...)` (warned after %s=%g)",
                    held,
                    holder,
                    self.setting,
                    self.warn_after,
                )
            elif reported and reported != last:  # the loop ran again since the stall reported
                log.info("the event loop runs again; it was blocked for about %.1fs", last - reported)
                reported = 0.0

    def _holder(self) -> str | None:
        """The running task and the line that blocks, as a reader can find them; None when the
        loop's thread is in the loop's own code (waiting for the interpreter or a core)."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return None
        stack = traceback.extract_stack(frame)
        try:
            task = asyncio.current_task(self.loop)
        except RuntimeError:
            task = None
        own = [f for f in stack if not _library(f.filename)]
        if _in_the_loop(stack[-1].filename):  # between callbacks, or waiting in select()
            return None
        where = own[-1] if own else stack[-1]
        text = f"{where.name}() at {where.filename}:{where.lineno}"
        if where.line:
            text += f" (`{where.line.strip()}`)"
        if own and stack[-1] is not where:
            inner = stack[-1]
            text += f", inside {inner.name}() at {inner.filename}:{inner.lineno}"
        return f"task {task.get_name()!r}, {text}" if task is not None else text

    def _others(self) -> str:
        """Where every other thread (but this one) is, innermost frame first."""
        names = {t.ident: t.name for t in threading.enumerate()}
        spots = []
        for ident, frame in sys._current_frames().items():
            if ident in (self._loop_thread, threading.get_ident()):
                continue
            inner = traceback.extract_stack(frame)[-1]
            spots.append(f"{names.get(ident, ident)!s} in {inner.name}() at {inner.filename}:{inner.lineno}")
        return "; ".join(spots) or "none found"


def _in_the_loop(filename: str) -> bool:
    """The event loop's own Python code: asyncio's (its selector's too), or the runner around
    uvloop's, whose loop is C."""
    return (
        os.sep + "asyncio" + os.sep in filename
        or "uvloop" in filename
        or os.path.basename(filename) == "selectors.py"
    )


def _library(filename: str) -> bool:
    """Code of Python, installed packages or rlasync itself: not where a user's blocking call is."""
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARIES) or path.startswith(_PACKAGE) or filename.startswith("<")


_WATCHED: dict[asyncio.AbstractEventLoop, tuple[LoopWatchdog, int]] = {}


def watch(
    loop: asyncio.AbstractEventLoop, warn_after: float, setting: str = "runtime.loop_stall_warn_s"
) -> None:
    """Watch ``loop`` (from its own thread); once per loop, however many nodes call it."""
    dog, users = _WATCHED.get(loop, (None, 0))
    if dog is None:
        dog = LoopWatchdog(loop, warn_after, setting)
        dog.start()
    _WATCHED[loop] = (dog, users + 1)


def unwatch(loop: asyncio.AbstractEventLoop) -> None:
    """One user of ``loop``'s watchdog is done; the last stops it."""
    dog, users = _WATCHED.get(loop, (None, 0))
    if dog is None:
        return
    if users > 1:
        _WATCHED[loop] = (dog, users - 1)
        return
    del _WATCHED[loop]
    dog.stop()


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` in a worker thread: work that would hold the loop (a step's collating over
    every token it trains on, building an environment that imports a package) and with it every
    call, timer and reply on it. Inline on a virtual-time loop (``engines.sim``), whose clock
    would jump past a thread."""
    if getattr(asyncio.get_running_loop(), "virtual_time", False):
        return work(*args)
    return await asyncio.to_thread(work, *args)
