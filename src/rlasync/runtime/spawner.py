"""Child node processes forked from a copy of this process, instead of started from nothing.

A node process imports torch (and the engines) before it joins; a child it starts the usual way
(``python -m rlasync.runtime.worker``) imports them all again: 2 s of CPU per trainer rank on a
small machine, while the others wait. So a node process, once its modules are imported and
before its event loop, sockets or threads exist, forks a *spawner*: a plain, single-threaded
copy of itself that only forks children on request. A child forked from it starts with every
module loaded and runs the worker's ``main``, as an exec'd one would.

    spawner = Spawner.start()                  # before the event loop (runtime.worker, rlasync node)
    use_spawner(spawner)
    proc = await start_node_process(...)       # forked from it now, exec'd when there is none

A process that can no longer fork a clean copy of itself, because threads or an event loop
already run in it (a test runner, a notebook, a script that embeds the runtime), *launches* one
instead: ``Spawner.launch(["rlasync.engines"])`` starts a new Python process that imports those
modules, then serves the same requests. A fork copies only the forking thread, so a lock another
thread held at that moment stays held in the copy for ever.

A child starts as an exec'd one would from the node at the moment it asks: with the node's
standard output and error (passed over the socket), working directory and environment.
Its children are the spawner's: it reaps them and reports each exit to the node, which sees a
``ForkedProcess`` (``pid``, ``returncode``, ``wait()``, signals) like an asyncio subprocess.
The spawner dies with its node (``PR_SET_PDEATHSIG``, and end of file on its socket), and its
children die with it (their parent), so nothing outlives the node. ``runtime.fork_children:
false`` turns it off.
"""

from __future__ import annotations

import array
import asyncio
import gc
import importlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

log = logging.getLogger(__name__)


class _Request(msgspec.Struct, frozen=True):
    id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str = ""  # the node's working directory when it asked ("": it has none; keep the spawner's)
    stdio: bool = False  # the node's stdout and stderr came with the request (SCM_RIGHTS)


# One request or report per datagram (a request carries file descriptors), up to this size: a
# request holds the node's whole environment, a few kB.
_MAX_MESSAGE = 1 << 20


class _Report(msgspec.Struct, frozen=True):
    id: int = 0  # the request a "started" report answers
    pid: int = 0
    code: int | None = None  # set: the process exited with it (-N: killed by signal N)
    error: str = ""


class ForkedProcess:
    """A child the spawner forked, seen as an ``asyncio.subprocess.Process`` is."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    def exited(self, code: int) -> None:
        """The spawner reaped it: it exited with ``code`` (-N: killed by signal N). Wakes ``wait``."""
        if self.returncode is None:
            self.returncode = code
            if not self._exited.get_loop().is_closed():  # a waiter from a loop that ended (a test's)
                self._exited.set_result(code)

    async def wait(self) -> int:
        return int(await asyncio.shield(self._exited))

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet, so the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Spawner:
    """The node's side of its spawner process."""

    def __init__(self, pid: int, sock: socket.socket, process: subprocess.Popen[bytes] | None = None) -> None:
        self.pid, self._sock = pid, sock
        self._process = process  # a launched spawner, reaped when it is gone; a forked one is the OS's
        self._next = 0
        self._asked: dict[int, asyncio.Future[_Report]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the node saw the start
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the reports
        self.alive = True

    @classmethod
    def start(cls) -> Spawner | None:
        """Fork the spawner; call before any event loop, socket or thread exists in this process.
        None where there is no fork."""
        if not hasattr(os, "fork"):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        node = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the spawner: it never returns
            ours.close()
            code = 1
            try:
                code = _serve(theirs, node)
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    @classmethod
    def launch(cls, preload_modules: Sequence[str] = ()) -> Spawner | None:
        """Start a spawner as a process of its own that imports ``preload_modules`` first: for a
        process that already runs threads or an event loop. None where there is no fork."""
        if not hasattr(os, "fork"):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHED, str(theirs.fileno()), str(os.getpid()), *preload_modules],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        return cls(process.pid, ours, process)

    def close(self) -> None:
        """End the spawner (end of file on its socket); children it forked die with it."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self.alive = False
        if self._process is not None:
            try:
                self._process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    async def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Fork a child that runs ``rlasync.runtime.worker.main(argv)`` with ``env`` as its
        environment. ``OSError`` if the spawner is gone."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the first loop, or a later one (a process may run several in turn)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.setblocking(False)
            loop.add_reader(self._sock.fileno(), self._on_readable)
            self._loop = loop
        if not self.alive:
            raise OSError("the spawner process is gone")
        self._next += 1
        asked = self._asked[self._next] = loop.create_future()
        stdio = _open_fds(1, 2)
        request = _Request(self._next, argv, env, cwd=_cwd(), stdio=bool(stdio))
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", stdio))] if stdio else []
        self._sock.sendmsg([msgspec.json.encode(request)], rights)
        report = await asked
        if report.error:
            raise OSError(f"the spawner could not fork: {report.error}")
        proc = self._children[report.pid] = ForkedProcess(report.pid)
        if report.pid in self._early:
            proc.exited(self._early.pop(report.pid))
        return proc

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        report = msgspec.json.decode(data, type=_Report)
        if report.code is None:
            future = self._asked.pop(report.id, None)
            if future is not None and not future.done():
                future.set_result(report)
        elif report.pid in self._children:
            self._children.pop(report.pid).exited(report.code)
        else:
            self._early[report.pid] = report.code

    def _gone(self) -> None:
        """The spawner died: its children died with it (they are its own)."""
        self.alive = False
        if self._process is not None:
            self._process.poll()  # reap it
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        for future in self._asked.values():
            if not future.done():
                future.set_result(_Report(error="the spawner process is gone"))
        for proc in self._children.values():
            proc.exited(-signal.SIGKILL)
        self._children.clear()


_spawner: Spawner | None = None


def use_spawner(spawner: Spawner | None) -> None:
    """Fork this process's children from ``spawner`` (see ``process.start_node_process``)."""
    global _spawner
    _spawner = spawner


def current_spawner() -> Spawner | None:
    return _spawner if _spawner is not None and _spawner.alive else None


# -- the spawner process ---------------------------------------------------------------------
def _serve(sock: socket.socket, node: int) -> int:
    """Fork children on request, reap them, report both; return when the node is gone."""
    from .process import set_death_signal

    set_death_signal(signal.SIGKILL)  # the node is gone: so is the spawner, and with it its children
    if os.getppid() != node:
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the node and its children
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    # Everything loaded so far (torch, transformers: millions of objects) out of the collector's
    # reach: a child's full collections would otherwise walk it all, pausing its event loop for
    # ~140 ms each on a small machine, and touch every page it shares with the spawner.
    gc.collect()
    gc.freeze()
    while True:
        try:
            readable: list[int] = select.select([sock.fileno(), wake_r], [], [], 1.0)[0]
        except InterruptedError:
            readable = []
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, code in _reap():
            _send(sock, _Report(pid=pid, code=code))
        if sock.fileno() not in readable:
            continue
        data, fds, flags, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        if not data:
            return 0
        request = msgspec.json.decode(data, type=_Request)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise OSError(f"a request over {_MAX_MESSAGE} bytes, or its file descriptors, was cut")
            pid = os.fork()
        except OSError as exc:
            _send(sock, _Report(id=request.id, error=str(exc)))
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            _child(request, fds)  # never returns
        for fd in fds:  # the child's now
            os.close(fd)
        _send(sock, _Report(id=request.id, pid=pid))


def _reap() -> list[tuple[int, int]]:
    exited: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return exited
        if pid == 0:
            return exited
        exited.append((pid, os.waitstatus_to_exitcode(status)))


def _send(sock: socket.socket, report: _Report) -> None:
    try:
        sock.send(msgspec.json.encode(report))
    except OSError:
        pass  # the node is gone; end of file on the next read ends the spawner


def _child(request: _Request, stdio: list[int]) -> None:
    """In a forked child: become ``python -m rlasync.runtime.worker ARGV`` and exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if request.stdio and len(stdio) == 2:  # the node's stdout and stderr, as an exec'd child's
            os.dup2(stdio[0], 1)
            os.dup2(stdio[1], 2)
        for fd in stdio:
            os.close(fd)
        if request.cwd:
            os.chdir(request.cwd)
        sys.argv = [sys.executable, "-m", "rlasync.runtime.worker", *request.argv]
        _name_process(sys.argv)  # before the environment changes: setproctitle finds its memory beside it
        os.environ.clear()
        os.environ.update(request.env)
        # The path the node had when it asked (as PYTHONPATH gives an exec'd child): actor classes
        # are imported by module name, from folders the node may have added since the fork.
        wanted = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = list(dict.fromkeys([*wanted, *sys.path]))
        for name in ("", "rlasync.events"):  # the worker configures logging under its own name;
            logger = logging.getLogger(name)  # milestones are printed by a launched node only
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True
        from .worker import main

        code = main(request.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _name_process(argv: list[str]) -> None:
    """Show the worker's command line in ``ps`` (as an exec'd child would), not the parent's."""
    try:
        import setproctitle
    except ImportError:  # an install without it: ps shows the parent's command line
        return
    setproctitle.setproctitle(" ".join(argv))


def _open_fds(*fds: int) -> list[int]:
    """``fds`` if every one is open (a daemon may have closed its stdout), else none."""
    try:
        for fd in fds:
            os.fstat(fd)
    except OSError:
        return []
    return list(fds)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed: the child keeps the spawner's
        return ""


def fork_children(config: Any) -> None:
    """Start this process's spawner when ``config.fork_children`` (a ``RuntimeConfig``) allows,
    after importing ``config.preload_modules`` so its children start with them loaded."""
    if not getattr(config, "fork_children", False) or current_spawner() is not None:
        return
    for module in config.preload_modules:
        importlib.import_module(module)
    use_spawner(Spawner.start())


def main(argv: list[str]) -> int:
    """A launched spawner (``Spawner.launch``): ``SOCKET_FD NODE_PID [MODULE ...]``."""
    fd, node, *modules = argv
    sock = socket.socket(fileno=int(fd))
    for module in modules:
        importlib.import_module(module)
    return _serve(sock, int(node))


# `python -c`, not `-m rlasync.runtime.spawner`: runpy would run this module a second time as
# __main__, beside the copy its package has already imported.
_LAUNCHED = (
    "import sys; from rlasync.runtime.spawner import main; from rlasync.runtime.process import exit_process; "
    "exit_process(main(sys.argv[1:]))"
)
