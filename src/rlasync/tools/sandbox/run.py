"""One program run in the sandbox: ``run_python`` and what it did (``PythonRun``).

A run goes in steps, each below: the command line (the interpreter in bubblewrap, or ``unshare``,
or a plain child; in a cgroup of its own), the start (the script as stdin, the output into a pipe
of ours), the wait (capped reading, the wall limit, the end with the script's main process), and
the cleanup (kill the tree, reap, remove the cgroup and the directory), which runs in ``finally``
as a shielded task: a call cancelled mid-run still leaves nothing behind.

Limits the child sets itself before the script runs (a bootstrap, not a ``preexec_fn``, which is
unsafe in a threaded parent): address space per process (``memory_bytes``: one allocation past it
is a ``MemoryError`` the script can catch; the cgroup is the limit for the whole tree), CPU
seconds (a backstop for the wall limit), file size (``max_file_bytes``), no core dumps, and in a
user namespace ``RLIMIT_NPROC`` (``max_processes``, counted per sandbox there). The run ends at
the wall-time limit, or as soon as the script's main process exits (what it left running is
killed, and what is still in the output pipe is read with a short deadline, so a descendant
holding the pipe cannot stall the call); at most ``max_output_bytes`` are read (the tree is
killed at the first byte past it); stdin is the script itself, then EOF; one thread per BLAS
library.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Collection

import msgspec

from .bwrap import HOST_PATH, NOBODY, bwrap_argv, sandbox_env
from .cgroups import REAP_TIMEOUT_S, Cgroups, RunCgroup
from .probe import machine

logger = logging.getLogger(__name__)

# Runs in the child before the script: limits first (they then hold for the script), then the
# script from stdin (no file in its working directory, no argv length limit), tracebacks without
# this bootstrap's frame and with the script's source lines.
_BOOTSTRAP = r"""
import os, resource, sys
def limit(kind, value):
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
memory, cpu, fsize, nproc = (int(x) for x in sys.argv[1:5])
limit(resource.RLIMIT_AS, memory)
limit(resource.RLIMIT_CPU, cpu)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_CORE, 0)
if nproc:
    limit(resource.RLIMIT_NPROC, nproc)
os.chdir(sys.argv[5])
os.environ.pop("PWD", None)  # bwrap sets it to its own start directory
source = sys.stdin.read()
sys.stdout.reconfigure(line_buffering=True)
import linecache, traceback
linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
sys.argv = ["<tool>"]
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
    sys.exit(1)
"""

_DRAIN_S = 1.0  # after the main process exited and the tree was killed: what is left in the pipe
_cleanups: set[asyncio.Task[None]] = set()  # strong references: the loop only keeps weak ones


class PythonRun(msgspec.Struct, kw_only=True):
    """What one sandboxed run did."""

    output: str
    """stdout and stderr interleaved, decoded as UTF-8 (invalid bytes replaced), at most the cap."""
    exit_code: int | None
    """The script's exit status (negative: killed by that signal; in a sandbox an exit status of
    128+N is read as signal N, as a shell does); None when it was killed by us."""
    timed_out: bool = False
    output_truncated: bool = False
    memory_limit: bool = False
    """The kernel killed a process of the run at the memory limit of the whole tree (cgroup)."""
    process_limit: bool = False
    """A fork or thread start failed at ``max_processes`` (cgroup)."""
    elapsed_s: float = 0.0


@dataclasses.dataclass
class _Run:
    """One run: the layers it uses, then what its steps acquire (the cleanup releases whatever is set)."""

    workdir: str
    bwrap: str | None  # the namespaces layer; None: unshare if there is one, else a plain child
    setpriv: str | None
    unshare: tuple[str, ...]
    cgroups: Cgroups | None  # the cgroup layer
    cgroup: RunCgroup | None = None
    proc: asyncio.subprocess.Process | None = None
    transport: asyncio.ReadTransport | None = None

    @property
    def wrapped(self) -> bool:
        """Whether the script's exit status comes through a wrapper (bwrap, unshare)."""
        return bool(self.bwrap or self.unshare)


async def run_python(
    code: str,
    *,
    wall_time_s: float,
    memory_bytes: int,
    max_output_bytes: int,
    max_file_bytes: int,
    max_processes: int = 64,
    network: bool = False,
    layers: Collection[str] | None = None,
) -> PythonRun:
    """Run ``code`` in a fresh sandbox under the limits (see ``rlasync.tools.sandbox``); never hangs.

    ``layers``: which of this machine's layers to use (default: every one it has).
    """
    start = time.perf_counter()
    found = machine()
    use = found.layers if layers is None else found.layers & set(layers)
    run = _Run(
        workdir=tempfile.mkdtemp(prefix="rlasync-python-"),  # one mkdir: cheap enough for the event loop
        bwrap=found.bwrap if "namespaces" in use else None,
        setpriv=found.setpriv,
        unshare=found.unshare,
        cgroups=found.cgroups if "cgroup" in use else None,
    )
    try:
        python = _python_argv(run, wall_time_s, memory_bytes, max_file_bytes, max_processes)
        argv = _sandbox_argv(run, python, memory_bytes, max_processes, network=network)
        proc, reader = await _start(run, argv, code)
        output, timed_out, truncated = await _wait(proc, run.cgroup, reader, wall_time_s, max_output_bytes)
        return PythonRun(
            output=output.decode("utf-8", "replace"),
            exit_code=None if timed_out or truncated else _exit_code(proc.returncode, run.wrapped),
            timed_out=timed_out,
            output_truncated=truncated,
            memory_limit=run.cgroup is not None and run.cgroup.oom_killed(),
            process_limit=run.cgroup is not None and run.cgroup.forks_refused(),
            elapsed_s=time.perf_counter() - start,
        )
    finally:
        # A second cancellation must not skip the cleanup: it runs as its own task.
        cleanup = asyncio.ensure_future(_cleanup(run))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)
        await asyncio.shield(cleanup)


def _python_argv(
    run: _Run, wall_time_s: float, memory_bytes: int, max_file_bytes: int, max_processes: int
) -> list[str]:
    """The interpreter with the bootstrap and its limits."""
    # RLIMIT_NPROC counts a user's processes: per sandbox in a user namespace, else it would
    # count the caller's own processes (a plain child) or every run's (root's "nobody").
    nproc = max_processes if run.bwrap and not run.setpriv else 0
    return [
        sys.executable,
        "-I",
        "-X",
        "utf8",
        "-c",
        _BOOTSTRAP,
        str(memory_bytes),
        str(math.ceil(wall_time_s) + 1),
        str(max_file_bytes),
        str(nproc),
        run.workdir,
    ]


def _sandbox_argv(
    run: _Run, python: list[str], memory_bytes: int, max_processes: int, *, network: bool
) -> list[str]:
    """``python`` in bubblewrap (else under ``unshare``, else as it is), in a new cgroup if there are."""
    if run.bwrap:
        if run.setpriv:
            os.chown(run.workdir, NOBODY, NOBODY)
        argv = bwrap_argv(run.bwrap, run.setpriv, run.workdir, network=network, tmpfs_bytes=memory_bytes)
        argv += python
    elif run.unshare:
        argv = [*run.unshare[:-3], *([] if network else ["--net"]), *run.unshare[-3:], *python]
    else:
        argv = python
    if run.cgroups:
        run.cgroup = run.cgroups.create(memory_bytes, max_processes)
        argv = run.cgroup.join_argv(argv)
    return argv


async def _start(
    run: _Run, argv: list[str], code: str
) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader]:
    """Start ``argv`` with ``code`` as its stdin: the process, and the reader of its output."""
    # The script is stdin (a memfd: no pipe to feed); the output is a pipe of ours, so that
    # waiting for the process never waits for a descendant that holds the pipe.
    script = read_fd = write_fd = -1
    try:
        script = os.memfd_create("rlasync-python-script", os.MFD_CLOEXEC)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        os.write(script, code.encode("utf-8", "replace"))  # a memfd write: memory only
        os.lseek(script, 0, os.SEEK_SET)
        reader = asyncio.StreamReader()
        pipe, read_fd = os.fdopen(read_fd, "rb", buffering=0), -1
        try:
            run.transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), pipe
            )
        except BaseException:
            pipe.close()
            raise
        run.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=script,
            stdout=write_fd,
            stderr=asyncio.subprocess.STDOUT,
            cwd=run.workdir if not run.bwrap else "/",
            env=sandbox_env(run.workdir) if not run.bwrap else {"PATH": HOST_PATH},
            start_new_session=True,
        )
        return run.proc, reader
    finally:
        for fd in (script, write_fd, read_fd):
            if fd >= 0:
                os.close(fd)


async def _wait(
    proc: asyncio.subprocess.Process,
    cgroup: RunCgroup | None,
    reader: asyncio.StreamReader,
    wall_time_s: float,
    max_output_bytes: int,
) -> tuple[bytearray, bool, bool]:
    """Read the output until the main process exits, the cap or the wall limit: (output, timed out, truncated)."""
    output, timed_out, truncated = bytearray(), False, False
    reading = asyncio.ensure_future(_read_capped(reader, output, max_output_bytes))
    exiting = asyncio.ensure_future(proc.wait())
    try:
        async with asyncio.timeout(wall_time_s):
            await asyncio.wait((reading, exiting), return_when=asyncio.FIRST_COMPLETED)
            truncated = reading.done() and reading.result()
            if not truncated:
                await exiting  # EOF may come first: a script that closed its output still runs
                await _kill_tree(proc, cgroup)  # the run ends with its main process
                try:
                    async with asyncio.timeout(_DRAIN_S):
                        truncated = await reading
                except TimeoutError:  # something out of our reach holds the pipe: stop reading
                    pass
    except TimeoutError:
        timed_out = True
    finally:
        reading.cancel()
        exiting.cancel()
    return output, timed_out, truncated


async def _read_capped(stream: asyncio.StreamReader, out: bytearray, cap: int) -> bool:
    """Read to EOF into ``out``; stop with True as soon as more than ``cap`` bytes came."""
    while chunk := await stream.read(65536):
        out += chunk
        if len(out) > cap:
            del out[cap:]
            return True
    return False


def _exit_code(returncode: int | None, wrapped: bool) -> int | None:
    if returncode is not None and wrapped and 128 < returncode < 128 + signal.NSIG:
        return 128 - returncode  # the wrapper reports a signal as 128+N, like a shell
    return returncode


async def _kill_tree(proc: asyncio.subprocess.Process | None, cgroup: RunCgroup | None) -> None:
    """SIGKILL the run's every process: its cgroup, its process group, and bwrap (whose death
    takes the sandbox's pid namespace with it)."""
    if proc is not None:
        if proc.returncode is None:  # not reaped yet: the pid is still ours
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or the pid reused by someone else's group
            pass
    if cgroup is not None:
        await cgroup.kill_all()


async def _cleanup(run: _Run) -> None:
    """Kill the tree, reap, close the pipe, remove the cgroup and the directory."""
    try:
        await _kill_tree(run.proc, run.cgroup)
        if run.proc is not None:
            try:
                async with asyncio.timeout(REAP_TIMEOUT_S):
                    await run.proc.wait()
            except TimeoutError:
                logger.warning(
                    "python tool: child %d did not exit %.0fs after SIGKILL", run.proc.pid, REAP_TIMEOUT_S
                )
    finally:
        if run.transport is not None:
            run.transport.close()
        if run.cgroup is not None:
            run.cgroup.remove()
        # rmtree may take long on a script's many files: in a thread, never on the loop.
        await asyncio.to_thread(shutil.rmtree, run.workdir, ignore_errors=True)
