"""``WorkThread``: the thread a trainer rank runs its model work on, one call after another.

Everything that touches the model or a collective runs there (torch.distributed wants one
thread per group, in order), while the rank's event loop keeps answering calls; each call's
result comes back as an asyncio future on the loop that submitted it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


class WorkThread:
    """One thread running submitted functions in order; results come back as asyncio futures."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # A daemon: a rank stuck in a collective must not keep its process from exiting.
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()
        self.busy = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put((fn, args, future, loop))
        return future

    def stop(self) -> None:
        self._queue.put(None)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, future, loop = item
            self.busy = True
            try:
                outcome, ok = fn(*args), True
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting call
                outcome, ok = exc, False
            finally:
                self.busy = False
            try:
                loop.call_soon_threadsafe(_settle, future, outcome, ok)
            except RuntimeError:  # the event loop closed meanwhile (the process is stopping)
                return


def _settle(future: asyncio.Future[Any], outcome: Any, ok: bool) -> None:
    if future.done():  # the call was cancelled (its caller timed out): nobody waits for this
        return
    if ok:
        future.set_result(outcome)
    else:
        future.set_exception(outcome)
