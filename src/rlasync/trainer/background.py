"""Work a checkpoint does while training goes on: in a thread that may run on any core.

    await in_background(write_files, folder)

A checkpoint's writes, checksums and fsyncs should not slow the steps that run meanwhile: a
trainer rank pinned to one core (``trainer.cpu_affinity``) would share it with them, so the
thread may use every core and takes time where the run leaves some idle. (At ``nice`` 19 it
was starved on a saturated machine: a checkpoint then waited seconds for the one before it,
and a one_step_off resume test ran 20% slower under load.) A fresh thread each time: a pool's
thread would keep the wider affinity for whatever it runs next.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a new thread free to use any core; its result (or error) as a future of this loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:  # this thread only (Linux)
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except (OSError, AttributeError):  # elsewhere: as the process is
            pass
        try:
            result: Any = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name=f"background-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return done
