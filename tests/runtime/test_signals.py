"""A termination signal to a node defers to its head (``runtime.signals``), and a signal the run's
processes all got at once is one interrupt (``rlasync.interrupts``): real node processes, real
signals. The whole run under ``scancel``'s signal: ``tests/modes/test_crash_resume.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from waiting import wait_until

from rlasync import Node, RuntimeConfig
from rlasync import interrupts as interrupts_module
from rlasync.interrupts import SIGNALS, Interrupts, from_node

RUNTIME = '{"heartbeat_interval_s": 0.2, "node_dead_after_s": 30}'
TRAIN = SimpleNamespace(checkpoint_on_interrupt=True, interrupt_grace_s=20.0)


@pytest.fixture(autouse=True)
def _handlers_kept():  # type: ignore[no-untyped-def]
    """This process's own handlers for the signals, back after each test (removing the loop's
    handlers leaves the default ones)."""
    kept = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


def _uninstall(loop: asyncio.AbstractEventLoop) -> None:
    for sig in SIGNALS:
        loop.remove_signal_handler(sig)


def _node_process(tmp_path, head: str) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    env = dict(os.environ, RLASYNC_RUNTIME_CONFIG=RUNTIME)
    worker = [sys.executable, "-m", "rlasync.runtime.worker"]
    return subprocess.Popen(
        [*worker, "--rank", "1", "--listen", f"ipc://{tmp_path}/n1.sock", "--head", head], env=env
    )


async def _joined(head: Node, proc: subprocess.Popen[bytes]) -> None:
    async def two() -> bool:
        assert proc.poll() is None, f"node-1 exited with {proc.returncode}"
        return len(await head.members()) == 2

    await wait_until(two, timeout_s=30, what="node-1 joined")


async def test_a_node_of_a_cluster_that_runs_no_training_stops_on_sigterm_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Nothing in the head's process stops a run on a signal (a script's own cluster): the head
    answers 0 and the node stops at once, as it always did."""
    config = RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=30)
    async with Node(0, f"ipc://{tmp_path}/head.sock", config=config) as head:
        proc = _node_process(tmp_path, head.address)
        try:
            await _joined(head, proc)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 15) == 0
        finally:
            proc.kill()


async def test_a_node_defers_a_signal_to_a_head_that_stops_its_run_and_stops_on_a_second(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With ``rlasync train``'s interrupts in the head's process, node-1's SIGTERM starts the run's
    interrupt there (its ``stop``, the checkpoint path) and node-1 keeps serving; a second
    signal, past the same delivery's window, stops it at once."""
    loop = asyncio.get_running_loop()
    config = RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=30)
    main = asyncio.ensure_future(asyncio.sleep(3600))  # the run's task
    interrupts = Interrupts(TRAIN)
    try:
        async with Node(0, f"ipc://{tmp_path}/head.sock", config=config) as head:
            interrupts.install(main)
            proc = _node_process(tmp_path, head.address)
            try:
                await _joined(head, proc)
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(interrupts.stop.wait(), 15)  # the run stops: with its checkpoint
                signalled = time.monotonic()
                await asyncio.sleep(1.5)  # past SAME_DELIVERY_S
                assert proc.poll() is None and not main.done()  # it serves on; the run is not cancelled
                assert interrupts.count == 0  # a relay is not this process's signal
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(proc.wait, 15) == 0
                assert time.monotonic() - signalled < 10
            finally:
                proc.kill()
    finally:
        interrupts.disarm()  # its watchdog would end this process
        main.cancel()
        _uninstall(loop)


async def test_signals_to_every_process_at_once_are_one_interrupt_and_a_later_one_cancels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's relay, this process's own signal and the copy ``srun`` forwards (within
    ``SAME_DELIVERY_S``) begin one interrupt; a signal after that window cancels the run."""
    monkeypatch.setattr(interrupts_module, "SAME_DELIVERY_S", 0.2)
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(asyncio.sleep(3600))
    interrupts = Interrupts(TRAIN)
    assert from_node("node-1", "SIGTERM") == 0.0  # nothing installed: the node stops at once
    try:
        interrupts.install(main)
        keep_s = from_node("node-1", "SIGTERM")
        assert interrupts.stop.is_set() and TRAIN.interrupt_grace_s < keep_s < TRAIN.interrupt_grace_s + 5
        os.kill(os.getpid(), signal.SIGTERM)  # its own, just after the relay
        os.kill(os.getpid(), signal.SIGTERM)  # srun's forwarded copy
        await asyncio.sleep(0.05)
        assert interrupts.count == 1 and not main.done()
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal
        await asyncio.sleep(0.05)
        assert main.cancelled()
    finally:
        interrupts.disarm()
        main.cancel()
        _uninstall(loop)


async def test_sigusr1_saves_a_checkpoint_even_without_checkpoint_on_interrupt() -> None:
    """The warning a scheduler sends before a time limit (``launch/slurm.sbatch``)."""
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(asyncio.sleep(3600))
    interrupts = Interrupts(SimpleNamespace(checkpoint_on_interrupt=False, interrupt_grace_s=20.0))
    try:
        interrupts.install(main)
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.sleep(0.05)
        assert interrupts.stop.is_set() and not main.done()
    finally:
        interrupts.disarm()
        main.cancel()
        _uninstall(loop)
