"""The ``python`` tool: a script in the sandbox (``rlasync.tools.sandbox``), what it printed back.

A ``PythonTool`` with ``isolation="strict"`` (the default) refuses to start without every layer
of the sandbox (``SandboxUnavailable`` says which is missing and how to get it);
``isolation="weaker"`` warns once per process and runs with what there is (the sandbox's
docstring says what is then not isolated). At most ``max_concurrency`` scripts run at once per
tool instance, so a thousand trajectories calling python cannot start a thousand interpreters on
one node.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

from .base import Tool, ToolContext, ToolError, register_tool
from .sandbox import PythonRun, SandboxUnavailable, run_python
from .sandbox.probe import machine

logger = logging.getLogger(__name__)

Isolation = Literal["strict", "weaker"]

_warned_weaker = False


@register_tool
class PythonTool(Tool):
    """Runs a Python script in a sandbox and returns what it printed.

    A limit hit is an error result (``timeout``, ``output_limit``) showing the output so far; a
    script that fails (an exception, ``MemoryError`` at the memory limit, a non-zero exit) is a
    normal result: its traceback and ``[exit code N]`` are what the model learns from, and a
    process killed at the memory limit of the whole tree, or a fork refused at the process limit,
    is said in a last line. An instance belongs to one event loop (its concurrency semaphore):
    build one per worker.
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
        max_processes: int = 64,
        network: bool = False,
        isolation: Isolation = "strict",
    ) -> None:
        """
        Args:
            wall_time_s: Kill the script after this long (interpreter start included).
            memory_mb: Memory of all the script's processes together (a cgroup), and the
                address-space limit of each; importing numpy needs about 200.
            max_output_bytes: Read at most this much output; one byte more kills the script.
            max_file_mb: Largest file the script may write.
            max_concurrency: Scripts running at once per instance (default: the CPU count).
            max_processes: Processes and threads of one run together (the sandbox's own two included).
            network: Share the node's network (127.0.0.1 included); every other layer stays.
            isolation: ``strict`` raises ``SandboxUnavailable`` here when the machine lacks a
                layer of the sandbox (``sandbox_layers()``); ``weaker`` warns once and runs with
                the layers there are (see ``rlasync.tools.sandbox`` for what is then not isolated).

        Raises:
            SandboxUnavailable: ``isolation="strict"`` and a layer is missing.
        """
        checks = {
            "wall_time_s": wall_time_s > 0,
            "memory_mb": memory_mb >= 32,
            "max_output_bytes": max_output_bytes > 0,
            "max_file_mb": max_file_mb >= 0,
            "max_concurrency": max_concurrency is None or max_concurrency >= 1,
            "max_processes": max_processes >= 4,
            "network": isinstance(network, bool),
            "isolation": isolation in ("strict", "weaker"),
        }
        bad = [key for key, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"PythonTool: invalid {', '.join(bad)} (see the PythonTool docstring for valid values)"
            )
        self.wall_time_s, self.memory_mb, self.max_output_bytes = wall_time_s, memory_mb, max_output_bytes
        self.max_file_mb, self.max_processes, self.network, self.isolation = (
            max_file_mb,
            max_processes,
            network,
            isolation,
        )
        self._slots = asyncio.Semaphore(max_concurrency or os.cpu_count() or 1)
        missing = machine().missing
        if missing and isolation == "strict":
            raise SandboxUnavailable(missing)
        if missing:
            _warn_weaker(missing)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        async with self._slots:
            run = await run_python(
                arguments["code"],
                wall_time_s=self.wall_time_s,
                memory_bytes=self.memory_mb << 20,
                max_output_bytes=self.max_output_bytes,
                max_file_bytes=self.max_file_mb << 20,
                max_processes=self.max_processes,
                network=self.network,
            )
        return self.format(run)

    def format(self, run: PythonRun) -> str:
        """The text the model sees; a hit limit raises ``ToolError`` (with the output before it)."""
        if run.timed_out:
            tail = f" Output before the kill:\n{run.output}" if run.output else ""
            raise ToolError(
                f"timed out after {self.wall_time_s:g}s (wall-time limit); the script was killed.{tail}",
                kind="timeout",
            )
        if run.output_truncated:
            raise ToolError(
                f"output exceeded {self.max_output_bytes} bytes; the script was killed. "
                f"The first {self.max_output_bytes} bytes:\n{run.output}",
                kind="output_limit",
            )
        lines = [run.output.rstrip("\n")] if run.output.rstrip("\n") else []
        if run.exit_code is not None and run.exit_code != 0:
            lines.append(
                f"[exit code {run.exit_code}]"
                if run.exit_code > 0
                else f"[killed by signal {-run.exit_code}]"
            )
        if run.memory_limit:
            lines.append(f"[killed: memory limit of {self.memory_mb} MB for all its processes]")
        if run.process_limit:
            lines.append(f"[process limit of {self.max_processes} reached: a fork or thread start failed]")
        return "\n".join(lines) or "(no output)"


def _warn_weaker(missing: Mapping[str, str]) -> None:
    global _warned_weaker
    if _warned_weaker:
        return
    _warned_weaker = True
    lost = []
    if "namespaces" in missing:
        who = "root (everything on the node)" if os.geteuid() == 0 else "the node's user"
        kept = (
            "only the network and pid namespaces of `unshare`" if machine().unshare else "no namespace at all"
        )
        lost.append(f"scripts run as {who}, see the node's files and processes, and have {kept}")
    if "cgroup" in missing:
        lost.append(
            "memory is limited per process only (a script that forks can use more), and processes only in a user namespace"
        )
    logger.warning(
        "python tool: running with a weaker sandbox (isolation=weaker): %s. Missing: %s",
        "; ".join(lost),
        "; ".join(f"{layer} ({why})" for layer, why in missing.items()),
    )
