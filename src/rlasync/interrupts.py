"""How ``rlasync train`` stops on Ctrl-C (SIGINT) or SIGTERM: cleanly, and always within a deadline.

    interrupts = Interrupts(config.train)
    interrupts.hold()                 # start-up (imports, forks): a signal is remembered
    ...
    interrupts.install(main_task)     # inside the event loop: signals stop the run
    result = await train(config, stop=interrupts.stop)

- The first signal either cancels the run at once (its parts close on the way out), or, with
  ``train.checkpoint_on_interrupt``, sets ``stop``: the schedule finishes its step, saves a
  checkpoint and raises ``RunInterrupted``; a step still running after
  ``train.interrupt_grace_s`` is cancelled. A second signal cancels at once.
- A watchdog then ends the process, whatever it is doing, ``HARD_STOP_AFTER_S`` later than the
  run was given (its children follow: they die with their parent). A stop never waits on a
  thread still loading a model: the loop's default executor is not joined on the way out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

HARD_STOP_AFTER_S = 5.0  # beyond the grace: the process ends even if something in it hangs
CANCEL_GRACE_S = 20.0  # an interrupt without a checkpoint: the parts get this long to close


_early = [0]  # signals held by ``hold_early``, before an ``Interrupts`` took over


def hold_early() -> None:
    """From the first instant of ``rlasync train``: count SIGINT/SIGTERM (``Interrupts`` acts on them)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _early.__setitem__(0, _early[0] + 1))


class Interrupts:
    def __init__(self, train: Any) -> None:
        self.checkpoint = bool(train.checkpoint_on_interrupt)
        self.grace_s = float(train.interrupt_grace_s) if self.checkpoint else CANCEL_GRACE_S
        self.stop = asyncio.Event()  # set: end the step in progress, checkpoint, stop
        self.count = _early[0]
        self._main: asyncio.Task[Any] | None = None
        self._watchdog: threading.Timer | None = None

    def hold(self) -> None:
        """Until ``install``: a signal is counted, not acted on (start-up is not cut mid-import;
        ``count`` says whether to start at all)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._arrived())

    def install(self, main: asyncio.Task[Any]) -> None:
        """From now on signals stop ``main`` (the run's task); call it on the loop's thread."""
        loop = asyncio.get_running_loop()
        self._main = main
        loop.set_default_executor(_UnjoinedExecutor())
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._arrived)
        if self.count:  # one came during start-up
            self.count -= 1
            self._arrived()

    def _arrived(self) -> None:
        self.count += 1
        if self._main is None:
            return
        if self.count == 1:
            self._arm_watchdog()
            if self.checkpoint:
                log.warning(
                    "interrupted: finishing the step in progress to save a checkpoint (Ctrl-C again to stop at once)"
                )
                self.stop.set()
                asyncio.get_running_loop().call_later(
                    self.grace_s, self._cancel, "the step did not finish in train.interrupt_grace_s"
                )
                return
        self._cancel("interrupted")

    def _cancel(self, why: str) -> None:
        if self._main is not None and not self._main.done():
            if why != "interrupted":
                log.warning("%s: stopping without a checkpoint", why)
            self._main.cancel()

    def _arm_watchdog(self) -> None:
        deadline = self.grace_s + HARD_STOP_AFTER_S

        def hard_stop() -> None:
            sys.stderr.write(
                f"rlasync train: still running {deadline:.0f} s after the interrupt; exiting now (its processes stop with it)\n"
            )
            sys.stderr.flush()
            os._exit(130)

        self._watchdog = threading.Timer(deadline, hard_stop)
        self._watchdog.daemon = True
        self._watchdog.start()

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


def exit_now(code: int) -> None:
    """Leave without waiting for threads still busy (a model load an interrupt cut short): the
    run's parts are closed by now, and a non-daemon thread would hold the exit."""
    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _UnjoinedExecutor(concurrent.futures.ThreadPoolExecutor):
    """``asyncio.to_thread``'s pool, which the loop's shutdown does not wait for."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)
