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

A launched spawner can also fork whole ``python -m rlasync`` commands (``commands=PATH``, a
Unix socket, where ``RLASYNC_FORK_COMMANDS`` names it): the test suite's way to start its
commands, in ``runtime.forked_commands``, which this module reaches only by name.
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
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from ..plugins import load as load_plugin
from .allocator import allocator_env
from .lifeline import set_death_signal

log = logging.getLogger(__name__)


class _Request(msgspec.Struct, frozen=True):
    id: int
    entry: str  # what the child runs: "module:function", called with ``argv``
    argv: list[str]
    env: dict[str, str]
    cwd: str = ""  # the node's working directory when it asked ("": it has none; keep the spawner's)
    stdio: bool = False  # the node's stdout and stderr came with the request (SCM_RIGHTS)


# One request or report per datagram (a request carries file descriptors), up to this size: a
# request holds the node's whole environment, a few kB.
MAX_MESSAGE = 1 << 20


COMMANDS_ENV = "RLASYNC_FORK_COMMANDS"
"""Set to a spawner's command socket: ``python -m rlasync`` runs forked from it (``runtime.forked_commands``)."""

COMMAND_DESK = "rlasync.runtime.forked_commands:CommandDesk"
"""What serves the commands on a launched spawner's command socket (``CommandDesk``), by name."""


class Report(msgspec.Struct, frozen=True):
    """What the spawner tells whoever asked it: a child started (``pid``), or exited (``code``)."""

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
        self._asked: dict[int, asyncio.Future[Report]] = {}
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
    def launch(
        cls, preload_modules: Sequence[str] = (), *, commands: str = "", allocator: str = "glibc"
    ) -> Spawner | None:
        """Start a spawner as a process of its own that imports ``preload_modules`` first: for a
        process that already runs threads or an event loop. ``commands``: a path where it also
        listens for ``python -m rlasync`` commands to fork (``forked_commands``; set
        ``RLASYNC_FORK_COMMANDS`` to it). ``allocator``: the ``runtime.allocator`` it and its
        children run under. None where there is no fork."""
        if not hasattr(os, "fork"):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener = None
        if commands:  # listening from now: a command asking while the spawner imports waits for it
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(commands)
            listener.listen(64)
        env = {**allocator_env(allocator), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop(COMMANDS_ENV, None)
        fds = [theirs.fileno()] + ([listener.fileno()] if listener is not None else [])
        argv = [str(theirs.fileno()), str(os.getpid()), str(fds[1] if listener else -1), *preload_modules]
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHED, *argv],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        if listener is not None:
            listener.close()
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

    async def spawn(self, entry: str, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Fork a child that runs ``entry`` (``"module:function"``, as ``python -m module``:
        ``function(argv)``) with ``env`` as its environment. ``OSError`` if the spawner is gone."""
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
        stdio = open_fds(1, 2)
        request = _Request(self._next, entry, argv, env, cwd=working_directory(), stdio=bool(stdio))
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
            data = self._sock.recv(MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        report = msgspec.json.decode(data, type=Report)
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
                future.set_result(Report(error="the spawner process is gone"))
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
class Commands(Protocol):
    """What a launched spawner asks of the desk that serves its command socket
    (``runtime.forked_commands.CommandDesk``): the descriptors to wait on, and its share of
    each round: the exits of its commands, and the callers ready."""

    def fds(self) -> list[int]: ...

    def exited(self, pid: int, code: int) -> bool:
        """``pid`` exited with ``code``: tell its caller if it ran a command (False: not one)."""
        ...

    def serve(self, readable: list[int], close_copies: Callable[[], None]) -> None: ...

    def close(self) -> None: ...


def _serve(sock: socket.socket, node: int, commands: Commands | None = None) -> int:
    """Fork children on request (the node's on ``sock``, commands on ``commands``), reap them,
    report both; return when the node is gone."""
    set_death_signal(signal.SIGKILL)  # the node is gone: so is the spawner, and with it its children
    if os.getppid() != node:
        return 0
    # Ctrl-C, SIGTERM and SIGUSR1 are for the node and its children: a scheduler signals every
    # process of a job at once, and the children must outlive the node's own stop in order
    # (runtime.signals). The spawner dies with its node, not on a signal.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    # Everything loaded so far (torch, transformers: millions of objects) out of the collector's
    # reach: a child's full collections would otherwise walk it all, pausing its event loop for
    # ~140 ms each on a small machine, and touch every page it shares with the spawner.
    gc.collect()
    gc.freeze()

    def close_copies() -> None:  # in a child: the spawner's sockets are not its own
        os.close(wake_r)
        os.close(wake_w)
        sock.close()
        if commands is not None:
            commands.close()

    while True:
        listening = commands.fds() if commands is not None else []
        try:
            readable: list[int] = select.select([sock.fileno(), wake_r, *listening], [], [], 1.0)[0]
        except InterruptedError:
            readable = []
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, code in _reap():
            if commands is None or not commands.exited(pid, code):
                send_report(sock, Report(pid=pid, code=code))
        if commands is not None:
            commands.serve(readable, close_copies)
        if sock.fileno() not in readable:
            continue
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        if not data:
            return 0
        request = msgspec.json.decode(data, type=_Request)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise OSError(f"a request over {MAX_MESSAGE} bytes, or its file descriptors, was cut")
            pid = os.fork()
        except OSError as exc:
            send_report(sock, Report(id=request.id, error=str(exc)))
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            close_copies()
            _child(request, fds)  # never returns
        for fd in fds:  # the child's now
            os.close(fd)
        send_report(sock, Report(id=request.id, pid=pid))


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


def send_report(sock: socket.socket, report: Report) -> None:
    try:
        sock.send(msgspec.json.encode(report))
    except OSError:
        pass  # the node is gone; end of file on the next read ends the spawner


def _child(request: _Request, stdio: list[int]) -> None:
    """In a forked child: become ``python -m MODULE ARGV`` (its ``entry``, ``MODULE:FUNCTION``)
    and exit with its code."""
    code = 1
    try:
        if not (request.stdio and len(stdio) == 2):  # no streams of the node's: the spawner's
            for fd in stdio:
                os.close(fd)
            stdio = []
        sys.argv = [sys.executable, "-m", request.entry.partition(":")[0], *request.argv]
        adopt([os.open(os.devnull, os.O_RDONLY), *stdio], request.cwd, request.env, sys.path, sys.argv)
        code = named(request.entry)(request.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def adopt(streams: list[int], cwd: str, env: dict[str, str], path: list[str], title: list[str]) -> None:
    """In a forked child: take the asking process's standard streams (stdin, then stdout and
    stderr if given), working directory, environment and module path, and default signals; show
    ``title`` as its command line."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):  # ignored ones would pass through exec
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in set(streams) - {0, 1, 2}:
        os.close(fd)
    if cwd:
        os.chdir(cwd)
    _name_process(title)  # before the environment changes: setproctitle finds its memory beside it
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from this environment (TMPDIR), not the spawner's
    # The path the asker had (as PYTHONPATH gives an exec'd child): actor classes are imported by
    # module name, from folders it may have added since the fork.
    wanted = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = list(dict.fromkeys([*wanted, *path]))
    for name in ("", "rlasync.events"):  # the worker configures logging under its own name;
        logger = logging.getLogger(name)  # milestones are printed by a launched node only
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


def _name_process(argv: list[str]) -> None:
    """Show the worker's command line in ``ps`` (as an exec'd child would), not the parent's."""
    try:
        import setproctitle
    except ImportError:  # an install without it: ps shows the parent's command line
        return
    setproctitle.setproctitle(" ".join(argv))


def open_fds(*fds: int) -> list[int]:
    """``fds`` if every one is open (a daemon may have closed its stdout), else none."""
    try:
        for fd in fds:
            os.fstat(fd)
    except OSError:
        return []
    return list(fds)


def working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed: the child keeps the spawner's
        return ""


def named(entry: str) -> Any:
    """The object ``"module:name"`` names, its module imported now. The spawner reaches what its
    children run by name: the worker imports the node, which starts processes through here."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def fork_children(config: Any) -> None:
    """Start this process's spawner when ``config.fork_children`` (a ``RuntimeConfig``) allows,
    after importing ``config.preload_modules`` so its children start with them loaded."""
    if not getattr(config, "fork_children", False) or current_spawner() is not None:
        return
    for module in config.preload_modules:
        load_plugin(module)
    use_spawner(Spawner.start())


def main(argv: list[str]) -> int:
    """A launched spawner (``Spawner.launch``): ``SOCKET_FD NODE_PID COMMANDS_FD [MODULE ...]``
    (``COMMANDS_FD`` -1: no commands)."""
    fd, node, listener, *modules = argv
    sock = socket.socket(fileno=int(fd))
    commands = None
    if int(listener) >= 0:
        commands = named(COMMAND_DESK)(socket.socket(fileno=int(listener)))
    for module in modules:
        load_plugin(module)
    return _serve(sock, int(node), commands)


# `python -c`, not `-m rlasync.runtime.spawner`: runpy would run this module a second time as
# __main__, beside the copy its package has already imported.
_LAUNCHED = (
    "import sys; from rlasync.runtime.spawner import main; from rlasync.runtime.process import exit_process; "
    "exit_process(main(sys.argv[1:]))"
)
