"""Work a checkpoint does while training goes on: in a thread of the lowest CPU priority.

    await in_background(write_files, folder)

A checkpoint's writes, checksums and fsyncs must not slow the steps that run meanwhile (the
trainer's rank shares its core with them, the controller with the engine): the thread runs at
``nice`` 19 and may use any core, so it takes CPU time only where the run leaves some idle. A fresh thread each time: a
pool's thread would keep the low priority for whatever it runs next.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a new low-priority thread; its result (or error) as a future of this loop."""
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
        try:  # this thread only (Linux): the lowest priority, on any core (a rank pinned to one shares it with nothing)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
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
