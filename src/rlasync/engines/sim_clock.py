"""Simulated time for the simulated engines (``engines.sim``): a clock scaled against the event
loop's, and an event loop whose clock jumps to the next timer whenever nothing is ready."""

from __future__ import annotations

import asyncio
from typing import Any


class SimClock:
    """Simulated time: one simulated second per ``scale`` seconds of the event loop's clock.

    On a normal event loop that clock is the wall clock, so the Python work of the schedulers
    themselves takes simulated time too: keep ``scale`` large enough that it is small (the
    benchmark checks that halving the scale leaves its results in place). On a
    ``VirtualTimeLoop`` the clock jumps to the next timer whenever nothing is ready to run, so
    Python work takes no simulated time at all and the result is exact at any scale.
    """

    def __init__(self, scale: float = 0.01) -> None:
        if scale <= 0:
            raise ValueError(f"scale is loop seconds per simulated second, > 0; got {scale}")
        self.scale = scale
        self._origin: float | None = None

    def now(self) -> float:
        loop_time = asyncio.get_running_loop().time()
        if self._origin is None:
            self._origin = loop_time
        return (loop_time - self._origin) / self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) * self.scale)

    def wall(self, seconds: float) -> float:
        """Simulated seconds as the event loop's seconds (for its timeouts)."""
        return seconds * self.scale


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when nothing is ready: it then jumps straight to the
    next timer. Discrete-event simulation on asyncio: code under test runs unchanged, and its
    CPU time costs no simulated time. Nothing may wait on threads or sockets meanwhile (a
    jump would pass them by); the simulated cluster waits on neither.

        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            runner.run(main())
    """

    virtual_time = True  # what code that would hand work to a thread asks (``Run.train_batch``)

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        selector = self._selector  # type: ignore[attr-defined]  # the selector the base loop polls with the time to its next timer
        real_select = selector.select

        def select(timeout: float | None = None) -> Any:
            ready = real_select(0)
            if ready or timeout == 0:
                return ready
            if timeout is None:  # no timer at all: only real I/O can wake us
                return real_select(None)
            self._now += timeout  # nothing to do until the next timer: be there now
            return []

        selector.select = select

    def time(self) -> float:
        return self._now


__all__ = ["SimClock", "VirtualTimeLoop"]
