"""How a node process takes SIGTERM, SIGINT or SIGUSR1: it defers to its head.

A scheduler ends a job by signalling every process of it at once: Slurm's ``scancel``, its time
limit and preemptions, ``torchrun`` stopping its workers, Kubernetes ending a pod. A node that
stopped on its own would take its engines and trainer ranks away before the head could finish
its step and save a checkpoint. So a node other than the head tells the head
(``Membership.interrupted``: the run stops as if the head had got the signal,
``rlasync.interrupts.from_node``) and keeps serving. It stops when the head ends the cluster,
or on its own once the time the head answered has passed (the run's
``train.interrupt_grace_s`` and a margin).

It stops at once on a second signal (more than ``SAME_DELIVERY_S`` after the first), when it is
the head, when it is not running (starting, already stopping), when the process that started
it is gone (a supervised child's death signal is a SIGTERM), and when the head cannot be asked
or stops no run on a signal (it answers 0: a plain cluster without ``rlasync train``).

    deferral = Deferral(lambda: node, stop_now, parent)
    deferral.install(loop)        # SIGINT, SIGTERM, SIGUSR1
    ...
    deferral.close()
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..interrupts import SAME_DELIVERY_S, SIGNALS

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0  # the head answers at once; one that does not is gone or hung


class Deferral:
    """A node process's signal handler: defer the first signal to the head, stop on the second.

    ``node``: the node this process runs now (None between two: rejoining); ``stop``: stop this
    process's node at once; ``parent``: the pid this process dies with (a supervised child)."""

    def __init__(self, node: Callable[[], Node | None], stop: Callable[[], None], parent: int | None) -> None:
        self._node, self._stop, self._parent = node, stop, parent
        self.count = 0  # signals taken (copies within SAME_DELIVERY_S not counted)
        self._last = -SAME_DELIVERY_S
        self._task: asyncio.Task[None] | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.arrived, sig)

    def arrived(self, sig: int) -> None:
        now = time.monotonic()
        if now - self._last < SAME_DELIVERY_S:
            return  # a forwarded copy of the one just taken
        self._last = now
        self.count += 1
        name = signal.Signals(sig).name
        node = self._node()
        why = self._stop_now(node)
        if why:  # only a second signal is news: the others come with a stop under way or due
            level = logging.WARNING if self.count > 1 else logging.INFO
            log.log(level, "%s: %s (%s): stopping", node.node_id if node else "this node", name, why)
            self._stop()
            return
        assert node is not None
        self._task = asyncio.get_running_loop().create_task(self._defer(node, name), name="rlasync-defer")

    def _stop_now(self, node: Node | None) -> str:
        """Why this signal stops the node at once ("": it defers to the head)."""
        if self.count > 1:
            return "a second signal"
        if self._parent is not None and os.getppid() != self._parent:
            return "the process that started it is gone"
        if node is None or node.is_head:
            return "no head to defer to"
        if not node.is_running:
            return "not running"
        return ""

    async def _defer(self, node: Node, name: str) -> None:
        try:
            keep_s = float(
                await node.membership.interrupted.options(timeout=ASK_TIMEOUT_S)(node.node_id, name)
            )
        except Exception as exc:  # lost, timed out, refused: whatever it was, a signalled node stops
            log.warning("%s got %s and could not tell the head (%s): stopping", node.node_id, name, exc)
            self._stop()
            return
        if keep_s <= 0:
            log.warning("%s got %s; its head stops no run on a signal: stopping", node.node_id, name)
            self._stop()
            return
        log.warning(
            "%s got %s: the head stops the run; serving until it does, %.0f s at most (a second signal stops this node now)",
            node.node_id,
            name,
            keep_s,
        )
        await asyncio.sleep(keep_s)
        log.warning(
            "%s: the head did not end the run within %.0f s of %s: stopping", node.node_id, keep_s, name
        )
        self._stop()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
