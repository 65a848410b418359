"""Built-in tools: ``calculator`` (safe integer arithmetic) and ``python`` (a script in a sandbox).

The python sandbox, layer by layer, and what each layer is for:

- A child process (``python -I``: no user site-packages, ``PYTHON*`` variables ignored) in its own
  session, so one ``killpg`` reaches it and everything it forked without ``setsid``.
- When the node may create namespaces (root, or unprivileged user namespaces: probed once per
  process), the child runs under ``unshare --net --pid --fork --kill-child``: a network
  namespace with no interfaces (no network at all, loopback included), and a pid namespace whose
  init is the script, so when it dies the kernel kills every process it left behind, even
  those that escaped the session. Without namespaces (``network_isolation="auto"`` logs a
  warning once) the network is reachable and a process that called ``setsid`` can outlive the
  call; ``network_isolation="required"`` makes the tool fail instead.
- Resource limits set by the child itself before the script runs (a bootstrap, not a
  ``preexec_fn``, which is unsafe in a threaded parent): address space (``memory_mb``: an
  allocation past it is a ``MemoryError`` in the script), CPU seconds (a backstop for the wall
  limit), file size (``max_file_mb``) and no core dumps.
- A wall-time limit on the whole run, an output cap (at most ``max_output_bytes`` are read; the
  process is killed at the first byte past it), a fresh temporary working directory (also HOME
  and TMPDIR) removed afterwards, a minimal environment (no proxies, no credentials), stdin
  empty, one thread per BLAS library.
- At most ``max_concurrency`` scripts at once per tool instance, so a thousand trajectories
  calling python cannot start a thousand interpreters on one node.
- Cleanup (kill the group, reap the child, remove the directory) runs in ``finally`` as a
  shielded task: a call cancelled mid-run still leaves nothing behind.

Not isolated: the file system (a script can read what the node's user can, and write outside
its directory; run nodes as an unprivileged user to protect the host), and the number of
processes when the node runs as root (``RLIMIT_NPROC`` does not apply to root; the wall limit
and the pid namespace bound a fork bomb's lifetime, not its size).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Literal

import msgspec

from rlasync.data.synthetic import CALCULATOR, calculator

from .base import Tool, ToolContext, ToolError, register_tool

logger = logging.getLogger(__name__)

NetworkIsolation = Literal["auto", "required", "off"]


@register_tool
class CalculatorTool(Tool):
    """The calc task's calculator (``rlasync.data.synthetic.calculator``: an AST walk, no eval)."""

    name = "calculator"
    description = ""  # the calc task's schema has none (prompt tokens cost a tiny model): keep them identical
    parameters = CALCULATOR["function"]["parameters"]
    timeout_s = 1.0

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        result = calculator(arguments["expression"])  # at most 64 characters: microseconds, fine on the loop
        if result.startswith("error: "):
            raise ToolError(result.removeprefix("error: "))  # same text as the calc task's, counted as an error
        return result


# -- python ----------------------------------------------------------------------------------
# Runs in the child before the script: limits first (they then hold for the script), then the
# script from stdin (no file in its working directory, no argv length limit), tracebacks without
# this bootstrap's frame and with the script's source lines.
_BOOTSTRAP = r"""
import resource, sys
def limit(kind, value):
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
memory, cpu, fsize = (int(x) for x in sys.argv[1:4])
limit(resource.RLIMIT_AS, memory)
limit(resource.RLIMIT_CPU, cpu)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_CORE, 0)
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

_SANDBOXES: tuple[tuple[str, ...], ...] = (
    ("unshare", "--net", "--pid", "--fork", "--kill-child"),  # root (CAP_SYS_ADMIN)
    ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),  # unprivileged user namespaces
)
_PROBE_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 5.0
_sandbox: tuple[str, ...] | None = None  # the probe's answer for this process; () when none works
_warned_no_sandbox = False
_cleanups: set[asyncio.Task[None]] = set()  # strong references: the loop only keeps weak ones


async def sandbox_prefix() -> tuple[str, ...]:
    """The command prefix that isolates a child here (probed once per process), () when none works."""
    global _sandbox
    if _sandbox is None:
        _sandbox = await _probe()
    return _sandbox


async def network_isolation_available() -> bool:
    return bool(await sandbox_prefix())


async def _probe() -> tuple[str, ...]:
    if shutil.which("unshare") is None:
        return ()
    for prefix in _SANDBOXES:
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-I", "-c", "pass",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                if await proc.wait() == 0:
                    return prefix
        except TimeoutError:
            pass
        finally:
            await _reap(proc)
    return ()


class PythonRun(msgspec.Struct, kw_only=True):
    """What one sandboxed run did."""

    output: str
    """stdout and stderr interleaved, decoded as UTF-8 (invalid bytes replaced), at most the cap."""
    exit_code: int | None
    """The child's exit status (negative: killed by that signal); None when it was killed by us."""
    timed_out: bool = False
    output_truncated: bool = False
    elapsed_s: float = 0.0


def _env(workdir: str) -> dict[str, str]:
    # Built from scratch: nothing of the node's environment (proxies, tokens, CUDA devices) leaks.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }  # fmt: skip


async def run_python(
    code: str,
    *,
    wall_time_s: float,
    memory_bytes: int,
    max_output_bytes: int,
    max_file_bytes: int,
    prefix: tuple[str, ...] = (),
) -> PythonRun:
    """Run ``code`` in a fresh child under the limits (see the module docstring); never hangs."""
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="rlasync-python-")  # one mkdir: cheap enough for the event loop
    proc: asyncio.subprocess.Process | None = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-I", "-X", "utf8", "-c", _BOOTSTRAP,
            str(memory_bytes), str(math.ceil(wall_time_s) + 1), str(max_file_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=workdir, env=_env(workdir), start_new_session=True,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        output, timed_out, truncated = bytearray(), False, False
        try:
            async with asyncio.timeout(wall_time_s):
                try:
                    proc.stdin.write(code.encode("utf-8", "replace"))
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the child died before reading its script: its output says why
                truncated = await _read_capped(proc.stdout, output, max_output_bytes)
                if not truncated:
                    await proc.wait()
        except TimeoutError:
            timed_out = True
        return PythonRun(
            output=output.decode("utf-8", "replace"),
            exit_code=None if timed_out or truncated else proc.returncode,
            timed_out=timed_out, output_truncated=truncated, elapsed_s=time.perf_counter() - start,
        )  # fmt: skip
    finally:
        # A second cancellation must not skip the cleanup: it runs as its own task.
        cleanup = asyncio.ensure_future(_cleanup(proc, workdir))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)
        await asyncio.shield(cleanup)


async def _read_capped(stream: asyncio.StreamReader, out: bytearray, cap: int) -> bool:
    """Read to EOF into ``out``; stop with True as soon as more than ``cap`` bytes came."""
    while chunk := await stream.read(65536):
        out += chunk
        if len(out) > cap:
            del out[cap:]
            return True
    return False


async def _cleanup(proc: asyncio.subprocess.Process | None, workdir: str) -> None:
    if proc is not None:
        await _reap(proc)
    # rmtree may take long on a script's many files: in a thread, never on the loop.
    await asyncio.to_thread(shutil.rmtree, workdir, ignore_errors=True)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill the child's process group (always: a forked grandchild may outlive the leader) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # the group leader is gone and its pid reused by someone else's group
        pass
    try:
        async with asyncio.timeout(_REAP_TIMEOUT_S):
            await proc.wait()
    except TimeoutError:
        logger.warning("python tool: child %d did not exit %.0fs after SIGKILL", proc.pid, _REAP_TIMEOUT_S)


@register_tool
class PythonTool(Tool):
    """Runs a Python script in a sandboxed child process and returns what it printed.

    A limit hit is an error result (``timeout``, ``output_limit``) showing the output so far; a
    script that fails (an exception, ``MemoryError`` at the memory limit, a non-zero exit) is a
    normal result: its traceback and ``[exit code N]`` are what the model learns from. An
    instance belongs to one event loop (its concurrency semaphore): build one per worker.
    """

    name = "python"
    description = (
        "Run a Python 3 script and return what it prints (stdout and stderr). Every call starts fresh: "
        "no variables, files or network carry over; print the results you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source to run."}},
        "required": ["code"],
    }
    timeout_s = None  # the run has its own wall limit; time spent waiting for a free slot must not count

    def __init__(
        self,
        *,
        wall_time_s: float = 10.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 65536,
        max_file_mb: int = 64,
        max_concurrency: int | None = None,
        network_isolation: NetworkIsolation = "auto",
    ) -> None:
        """
        Args:
            wall_time_s: Kill the script after this long (interpreter start included).
            memory_mb: Address-space limit of the script's process; importing numpy needs about 200.
            max_output_bytes: Read at most this much output; one byte more kills the script.
            max_file_mb: Largest file the script may write.
            max_concurrency: Scripts running at once per instance (default: the CPU count).
            network_isolation: ``auto`` isolates when the node can and warns once when it cannot;
                ``required`` fails every call when it cannot; ``off`` never isolates.
        """
        checks = {
            "wall_time_s": wall_time_s > 0, "memory_mb": memory_mb >= 32, "max_output_bytes": max_output_bytes > 0,
            "max_file_mb": max_file_mb >= 0, "max_concurrency": max_concurrency is None or max_concurrency >= 1,
            "network_isolation": network_isolation in ("auto", "required", "off"),
        }  # fmt: skip
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"PythonTool: invalid {', '.join(bad)} (see the PythonTool docstring for valid values)")
        self.wall_time_s, self.memory_mb, self.max_output_bytes = wall_time_s, memory_mb, max_output_bytes
        self.max_file_mb, self.network_isolation = max_file_mb, network_isolation
        self._slots = asyncio.Semaphore(max_concurrency or os.cpu_count() or 1)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        prefix = await self._prefix()
        async with self._slots:
            run = await run_python(
                arguments["code"], wall_time_s=self.wall_time_s, memory_bytes=self.memory_mb << 20,
                max_output_bytes=self.max_output_bytes, max_file_bytes=self.max_file_mb << 20, prefix=prefix,
            )  # fmt: skip
        return self.format(run)

    async def _prefix(self) -> tuple[str, ...]:
        global _warned_no_sandbox
        if self.network_isolation == "off":
            return ()
        prefix = await sandbox_prefix()
        if not prefix and self.network_isolation == "required":
            raise ToolError("python is unavailable: this node cannot isolate the network (needs `unshare --net`)")
        if not prefix and not _warned_no_sandbox:
            _warned_no_sandbox = True
            logger.warning(
                "python tool: `unshare --net --pid` does not work here; scripts run with network access and "
                "can leave processes behind (run the node as root or enable user namespaces)"
            )
        return prefix

    def format(self, run: PythonRun) -> str:
        """The text the model sees; a hit limit raises ``ToolError`` (with the output before it)."""
        if run.timed_out:
            tail = f" Output before the kill:\n{run.output}" if run.output else ""
            raise ToolError(f"timed out after {self.wall_time_s:g}s (wall-time limit); the script was killed.{tail}", kind="timeout")
        if run.output_truncated:
            raise ToolError(
                f"output exceeded {self.max_output_bytes} bytes; the script was killed. "
                f"The first {self.max_output_bytes} bytes:\n{run.output}",
                kind="output_limit",
            )
        text = run.output.rstrip("\n")
        if run.exit_code is not None and run.exit_code != 0:
            status = f"exit code {run.exit_code}" if run.exit_code > 0 else f"killed by signal {-run.exit_code}"
            text = f"{text}\n[{status}]" if text else f"[{status}]"
        return text or "(no output)"
