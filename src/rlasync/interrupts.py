"""How ``rlasync train`` stops on Ctrl-C (SIGINT), SIGTERM or SIGUSR1: cleanly, and always within
a deadline, however many of the run's processes the signal reached.

    interrupts = Interrupts(config.train)
    interrupts.hold()                 # start-up (imports, forks): a signal is remembered
    ...
    interrupts.install(main_task)     # inside the event loop: signals stop the run
    result = await train(config, stop=interrupts.stop)

- The first signal either cancels the run at once (its parts close on the way out), or, with
  ``train.checkpoint_on_interrupt`` (always for SIGUSR1, the warning a scheduler sends before a
  time limit: ``launch/slurm.sbatch``), sets ``stop``: the schedule finishes its step, saves a
  checkpoint and raises ``RunInterrupted``; a step still running after
  ``train.interrupt_grace_s`` is cancelled. A second signal cancels at once.
- A signal that reached the run's other processes is the same interrupt: each node relays it to
  the head (``from_node``) and keeps serving until the head ends the run (``runtime.signals``).
  So Slurm's ``scancel``, a time limit, a preemption or ``torchrun`` signalling every process at
  once ends as one interrupt, with its checkpoint. Signals within ``SAME_DELIVERY_S`` of each
  other are one delivery (``srun`` forwards what Slurm also sends each task), not a second one.
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
import time
from typing import Any

log = logging.getLogger(__name__)

HARD_STOP_AFTER_S = 5.0  # beyond the grace: the process ends even if something in it hangs
NODES_STOP_AFTER_S = 3.0  # beyond the grace: a node that relayed a signal stops on its own
CANCEL_GRACE_S = 20.0  # an interrupt without a checkpoint: the parts get this long to close
SAME_DELIVERY_S = 1.0  # signals closer than this are one delivery (a forwarded copy), not a second
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # what stops a run; SIGUSR1 with a checkpoint


_early = [0]  # signals held by ``hold_early``, before an ``Interrupts`` took over
_installed: list[Interrupts] = []  # the one acting in this process (``from_node`` reaches it)


def hold_early() -> None:
    """From the first instant of ``rlasync train``: count SIGINT/SIGTERM/SIGUSR1 (``Interrupts`` acts on them)."""
    for sig in SIGNALS:
        signal.signal(sig, lambda *_: _early.__setitem__(0, _early[0] + 1))


def from_node(node_id: str, signal_name: str) -> float:
    """A node of this process's run got ``signal_name``: the run stops as if this process had
    got it (a relay never counts as a second signal). Returns the seconds the node should keep
    serving (the head ends the run and releases it by then); 0 when nothing in this process
    stops a run on a signal (the node then stops at once)."""
    if not _installed:
        return 0.0
    return _installed[-1].relayed(node_id, signal_name)


class Interrupts:
    def __init__(self, train: Any) -> None:
        self.checkpoint = bool(train.checkpoint_on_interrupt)
        self.checkpoint_grace_s = float(train.interrupt_grace_s)
        self.stop = asyncio.Event()  # set: end the step in progress, checkpoint, stop
        self.count = _early[0]
        self._main: asyncio.Task[Any] | None = None
        self._watchdog: threading.Timer | None = None
        self._last_signal = -SAME_DELIVERY_S
        self._began: float | None = None  # when the interrupt began (monotonic)
        self._grace_s = CANCEL_GRACE_S  # of the interrupt that began

    def hold(self) -> None:
        """Until ``install``: a signal is counted, not acted on (start-up is not cut mid-import;
        ``count`` says whether to start at all)."""
        for sig in SIGNALS:
            signal.signal(sig, lambda *_: self._arrived())

    def install(self, main: asyncio.Task[Any]) -> None:
        """From now on signals stop ``main`` (the run's task); call it on the loop's thread."""
        loop = asyncio.get_running_loop()
        self._main = main
        loop.set_default_executor(_UnjoinedExecutor())
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._arrived, sig)
        _installed.append(self)
        if self.count:  # one came during start-up
            self._begin("a signal during start-up")

    def _arrived(self, sig: int = signal.SIGTERM) -> None:
        now = time.monotonic()
        if now - self._last_signal < SAME_DELIVERY_S:
            return  # a copy of the one just taken (srun forwards what Slurm sends every task)
        self._last_signal = now
        self.count += 1
        if self._main is None:
            return
        if self.count == 1:  # the first to this process (a node's relay may have begun it already)
            self._begin(signal.Signals(sig).name)
        else:
            self._cancel("interrupted")

    def relayed(self, node_id: str, signal_name: str) -> float:
        """``from_node`` (installed: the run is on): start the interrupt if none has begun; the
        seconds left to the node."""
        if self._began is None:
            log.warning("%s got %s: the run stops", node_id, signal_name)
        began = self._begin(signal_name)
        return max(0.0, began + self._grace_s + NODES_STOP_AFTER_S - time.monotonic())

    def _begin(self, signal_name: str) -> float:
        """Begin the interrupt ``signal_name`` asks for, unless one has begun; when it began."""
        if self._began is not None:
            return self._began
        self._began = time.monotonic()
        checkpoint = self.checkpoint or signal_name == "SIGUSR1"  # a time limit ahead: always
        self._grace_s = self.checkpoint_grace_s if checkpoint else CANCEL_GRACE_S
        self._arm_watchdog()
        if checkpoint:
            log.warning(
                "%s: finishing the step in progress to save a checkpoint (Ctrl-C again to stop at once)",
                signal_name,
            )
            self.stop.set()
            asyncio.get_running_loop().call_later(
                self._grace_s, self._cancel, "the step did not finish in train.interrupt_grace_s"
            )
        else:
            self._cancel("interrupted")
        return self._began

    def _cancel(self, why: str) -> None:
        if self._main is not None and not self._main.done():
            if why != "interrupted":
                log.warning("%s: stopping without a checkpoint", why)
            self._main.cancel()

    def _arm_watchdog(self) -> None:
        deadline = self._grace_s + HARD_STOP_AFTER_S

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
        if self in _installed:
            _installed.remove(self)
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
