"""``python -m rlasync`` commands forked by a spawner: how the test suite starts its commands.

A launched spawner (``Spawner.launch(..., commands=PATH)``) also listens on a Unix socket for
whole commands to fork. Where ``RLASYNC_FORK_COMMANDS`` names that socket, the command's process
asks the spawner for a copy of itself that runs the command (``run_command``), in the asking
process's working directory, environment, module path, standard streams, umask, CPUs and network
namespace, and stands in for it: signals sent to it are passed on, its exit code (or death by a
signal) is the command's, and killed, it takes the command with it. What differs from an exec'd
command: its process id and parent (its children are not the asking process's descendants), its
session, and the mount namespace (the spawner's). The test suite starts its commands so (each
would import torch and transformers again: ~5 s of CPU); a test about a command's process tree
unsets the variable.

The spawner's side is ``CommandDesk``, which the spawner reaches by name
(``spawner.COMMAND_DESK``); the command's side is ``run_command``, which ``rlasync.__main__``
imports only where the variable is set, and ``run_script`` for ``python SCRIPT``.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from .lifeline import set_death_signal
from .spawner import COMMANDS_ENV, MAX_MESSAGE, Report, adopt, open_fds, send_report, working_directory


class _Command(msgspec.Struct, frozen=True):
    """A command to fork, as the asking process would have run it: ``python -m MODULE ARGV``,
    where ``MODULE.ENTRY()`` runs it and ends the process; its stdin, stdout, stderr and network
    namespace come with it (SCM_RIGHTS)."""

    module: str  # or, where ``script`` is set, none: ``python SCRIPT ARGV``
    entry: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    path: list[str]  # its sys.path
    executable: str  # a spawner of another Python refuses
    umask: int
    cpus: list[int]
    script: str = ""


_COMMAND_FDS = 4  # stdin, stdout, stderr, network namespace
_COMMAND_START_S = 120.0  # a spawner still importing its modules answers late; then the command runs itself
_RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class CommandDesk:
    """The spawner's side (``spawner.Commands``): accepts callers on ``listener``, forks each
    one's command, tells it its command's exit, and kills the command if its caller goes away."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.callers: dict[int, socket.socket] = {}  # connection fd -> a command's caller
        self.running: dict[int, int] = {}  # a caller's connection fd -> its command's pid
        self.commanded: dict[int, socket.socket | None] = {}  # a command's pid -> its caller (None: gone)

    def fds(self) -> list[int]:
        return [self.listener.fileno(), *self.callers]

    def exited(self, pid: int, code: int) -> bool:
        if pid not in self.commanded:
            return False
        caller = self.commanded.pop(pid)
        if caller is not None:  # the command's exit is its caller's
            send_report(caller, Report(pid=pid, code=code))
            self.callers.pop(caller.fileno(), None)
            self.running.pop(caller.fileno(), None)
            caller.close()
        return True

    def serve(self, readable: list[int], close_copies: Callable[[], None]) -> None:
        """Accept a new caller, and handle those ready: fork a command, or kill one whose caller left."""
        callers, running = self.callers, self.running
        if self.listener.fileno() in readable:
            try:
                caller, _ = self.listener.accept()
                callers[caller.fileno()] = caller
            except OSError:
                pass
        for fd in [fd for fd in readable if fd in callers]:
            caller = callers[fd]
            if fd in running:  # a running command's caller sends nothing more: it went away
                if _gone(caller):
                    pid = running.pop(fd)
                    os.kill(pid, signal.SIGKILL)  # killed, the caller takes its command with it
                    self.commanded[pid] = None
                    callers.pop(fd).close()
                continue
            command_pid = _fork_command(caller, close_copies)
            if command_pid is None:
                callers.pop(fd).close()
            else:
                running[fd], self.commanded[command_pid] = command_pid, caller

    def close(self) -> None:
        """In a forked child: the desk's sockets are not its own."""
        for other in [self.listener, *self.callers.values()]:
            other.close()


def _fork_command(caller: socket.socket, close_copies: Any) -> int | None:
    """Read a command from ``caller`` and fork it; its pid, or None (told to the caller) if it
    cannot run here."""
    try:
        data, fds, flags, _ = socket.recv_fds(caller, MAX_MESSAGE, _COMMAND_FDS)
    except OSError:
        return None
    try:
        if not data:
            return None  # the caller went away before asking
        error = ""
        command = msgspec.json.decode(data, type=_Command)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != _COMMAND_FDS:
            error = "the command or its file descriptors were cut"
        elif command.executable != sys.executable:
            error = f"this spawner runs {sys.executable}, not {command.executable}"
        if error:
            send_report(caller, Report(error=error))
            return None
        if _gone(caller):  # it stopped waiting (and runs the command itself)
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            send_report(caller, Report(error=str(exc)))
            return None
        if pid == 0:
            close_copies()
            _command_child(command, fds)  # never returns
        send_report(caller, Report(pid=pid))
        return pid
    except msgspec.DecodeError as exc:
        send_report(caller, Report(error=f"not a command: {exc}"))
        return None
    finally:
        for fd in fds:  # the child's now (or nobody's)
            os.close(fd)


def _gone(caller: socket.socket) -> bool:
    """Has the caller closed its end (it exited, or was killed)?"""
    try:
        return not caller.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True


def _command_child(command: _Command, fds: list[int]) -> None:
    """In a forked child: become ``python -m rlasync ARGV`` as the caller would have run it."""
    code = 1
    try:
        os.setsid()  # a session of its own, as the caller's process group is not the spawner's
        set_death_signal(signal.SIGKILL)  # the spawner (the test session) ended: so does the command
        *streams, netns = fds
        _enter_network_namespace(netns)
        how = [command.script] if command.script else ["-m", command.module.removesuffix(".__main__")]
        title = [command.executable, *how, *command.argv]
        adopt(streams, command.cwd, command.env, command.path, title)
        os.umask(command.umask)
        if command.cpus:
            os.sched_setaffinity(0, command.cpus)
        _reopen_standard_streams()
        if command.script:
            _run_script(command.script, command.argv)
        module = importlib.import_module(command.module)
        sys.argv = [str(module.__file__), *command.argv]
        sys.modules["__main__"] = module  # as under `python -m` (click names the program by it)
        getattr(module, command.entry)()  # ends the process
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _enter_network_namespace(fd: int) -> None:
    """Join the caller's network namespace (``ip netns exec``), if it is not the spawner's."""
    if os.fstat(fd).st_ino == os.stat("/proc/self/ns/net").st_ino:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot join the caller's network namespace: {os.strerror(error)}")


_CLONE_NEWNET = 0x40000000


def _reopen_standard_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` anew on the caller's descriptors: buffered as an exec'd
    process's would be (line by line on a terminal, unbuffered under ``PYTHONUNBUFFERED``), not
    as the spawner's were."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        tty = os.isatty(fd)
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                binary,
                encoding=old.encoding,
                errors=old.errors,
                line_buffering=tty or name == "stderr",
                write_through=unbuffered or name == "stderr",
            ),
        )


def run_command(argv: list[str], *, module: str = "", entry: str = "", script: str = "") -> int | None:
    """Run ``python -m MODULE ARGV`` (``MODULE.ENTRY()`` runs it and ends the process), or
    ``python SCRIPT ARGV``, forked by the spawner listening at ``$RLASYNC_FORK_COMMANDS``, and
    stand in for it until it ends: signals this process gets are passed on, and killed, it
    takes the command with it. The command's exit code (-N: killed by signal N), or None if no
    spawner takes it (none listens, or it runs another Python): then run it here."""
    where = os.environ.get(COMMANDS_ENV)
    if not where:
        return None
    caller = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    opened: list[int] = []
    try:
        caller.settimeout(_COMMAND_START_S)
        caller.connect(where)
        fds = [fd if open_fds(fd) else _devnull(opened) for fd in (0, 1, 2)]
        fds.append(_opened(opened, "/proc/self/ns/net"))
        umask = os.umask(0)
        os.umask(umask)
        command = _Command(
            module=module,
            entry=entry,
            script=os.path.abspath(script) if script else "",
            argv=argv,
            env=dict(os.environ),
            cwd=working_directory(),
            path=list(sys.path),
            executable=sys.executable,
            umask=umask,
            cpus=sorted(os.sched_getaffinity(0)),
        )
        socket.send_fds(caller, [msgspec.json.encode(command)], fds)
        report = msgspec.json.decode(caller.recv(MAX_MESSAGE), type=Report)
    except (OSError, msgspec.DecodeError):  # none listens, or it did not answer in time
        caller.close()
        return None
    finally:
        for fd in opened:
            os.close(fd)
    if report.error:
        caller.close()
        return None
    pid = report.pid

    def relay(sig: int, _: Any) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in _RELAYED:
        signal.signal(sig, relay)
    caller.settimeout(None)  # the command runs as long as it runs; its end, or the spawner's, answers
    data = caller.recv(MAX_MESSAGE)
    caller.close()
    if not data:
        sys.stderr.write("rlasync: the spawner that ran this command ended before it\n")
        return 1
    code = msgspec.json.decode(data, type=Report).code
    if code is not None and code < 0:  # killed by a signal: so is this process, as the command was
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code is not None else 1


def run_script(argv: list[str]) -> None:
    """``python -c FORKED_SCRIPT SCRIPT ARG...``: ``python SCRIPT ARG...``, forked as
    ``run_command`` forks a command where a spawner serves them, else run here."""
    script, *args = argv
    code = run_command(args, script=script)
    if code is None:
        _run_script(script, args)
    sys.exit(code)


FORKED_SCRIPT = "import sys; from rlasync.runtime.forked_commands import run_script; run_script(sys.argv[1:])"
"""``[sys.executable, "-c", FORKED_SCRIPT, SCRIPT, *ARGS]`` runs ``python SCRIPT ARGS`` (``run_script``)."""


def _run_script(script: str, argv: list[str]) -> None:
    """Run ``script`` as ``python SCRIPT ARGV`` would, in this process, and end it."""
    import runpy

    from .process import exit_process

    sys.argv = [script, *argv]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *(p for p in sys.path if p)]  # as python SCRIPT
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
    exit_process(code)


def _devnull(opened: list[int]) -> int:
    return _opened(opened, os.devnull, os.O_RDWR)


def _opened(opened: list[int], path: str, flags: int = os.O_RDONLY) -> int:
    fd = os.open(path, flags)
    opened.append(fd)
    return fd
