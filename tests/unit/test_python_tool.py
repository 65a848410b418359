"""The python tool's sandbox: time, memory and output limits, a throwaway directory, no network,
and no process left behind (after a timeout, a cancellation, or a daemon the script started)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlasync.tools import PythonTool, ToolCall, ToolContext, ToolResult, network_isolation_available, run_tool_call

pytestmark = pytest.mark.timeout(60)


async def run(code: str, **settings: object) -> ToolResult:
    tool = PythonTool(**settings)  # type: ignore[arg-type]
    return await run_tool_call({"python": tool}, ToolCall("python", {"code": textwrap.dedent(code)}), ToolContext())


def lock_is_free(path: Path) -> bool:
    """Whether no process holds an exclusive flock on ``path`` (a lock dies with its last holder)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


async def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return False


# Takes an exclusive lock on LOCK (a file outside the sandbox), held for as long as the process
# lives, then writes its working directory there (so a non-empty file means "locked").
HOLD_LOCK = """
import fcntl, os
f = open({lock!r}, "a")
fcntl.flock(f, fcntl.LOCK_EX)
f.write(os.getcwd()); f.flush()
"""


def started(lock: Path) -> bool:
    return lock.stat().st_size > 0


@pytest.fixture
def lock(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "lock"
    path.touch()
    yield path


async def test_prints_its_result() -> None:
    result = await run("print(2+2)")
    assert (result.ok, result.text) == (True, "4")


async def test_errors_and_exit_codes_are_shown_like_a_terminal() -> None:
    result = await run("x = 1\n1/0")
    assert result.ok and result.text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert 'File "<tool>", line 2' in result.text and "1/0" in result.text  # the script's own line
    assert (await run("import sys; print('bye'); sys.exit(3)")).text == "bye\n[exit code 3]"
    assert (await run("pass")).text == "(no output)"
    assert "SyntaxError" in (await run("def (")).text
    assert "EOFError" in (await run("input()")).text  # stdin is empty, never the parent's


async def test_unicode_round_trips() -> None:
    assert (await run("print('héllo 世界 🙂')")).text == "héllo 世界 🙂"


async def test_wall_time_limit_kills_a_busy_loop_and_keeps_earlier_output() -> None:
    start = time.perf_counter()
    result = await run("print('started')\nwhile True: pass", wall_time_s=1.0)
    elapsed = time.perf_counter() - start
    assert not result.ok and result.error_kind == "timeout"
    assert result.text.startswith("error: timed out after 1s") and "started" in result.text
    assert 0.9 <= elapsed < 4.0, elapsed  # the limit (uvloop may fire a little early) plus the kill and cleanup, on a loaded machine


async def test_memory_limit_fails_an_allocation_cleanly() -> None:
    result = await run(
        """
        try:
            block = bytearray(2 * 1024**3)
        except MemoryError:
            print("no memory")
        print("still alive")
        """,
        memory_mb=256,
    )
    assert (result.ok, result.text) == (True, "no memory\nstill alive")
    uncaught = await run("block = bytearray(2 * 1024**3)", memory_mb=256)
    assert uncaught.ok and "MemoryError" in uncaught.text and uncaught.text.endswith("[exit code 1]")


@pytest.mark.parametrize(
    "code",
    [
        "print('x' * 10_000_000)",  # one write
        "while True: print('y' * 999)",  # endless, line by line
    ],
)
async def test_output_cap_cuts_and_kills(code: str) -> None:
    start = time.perf_counter()
    result = await run(code, max_output_bytes=4096, wall_time_s=30)
    assert not result.ok and result.error_kind == "output_limit"
    assert result.text.startswith("error: output exceeded 4096 bytes; the script was killed")
    assert 4096 <= len(result.text) < 4096 + 200
    assert time.perf_counter() - start < 10  # killed at the cap, long before the wall limit


async def test_each_run_gets_a_fresh_directory_that_is_removed_afterwards() -> None:
    code = """
        import os
        print(os.getcwd()); print(os.listdir(".")); print(os.environ["HOME"] == os.getcwd())
        open("left_behind.txt", "w").write("data")
        """
    first = (await run(code)).text.splitlines()
    second = (await run(code)).text.splitlines()
    assert first[1:] == second[1:] == ["[]", "True"]  # empty: the file of the first run is not there
    assert first[0] != second[0] and "rlasync-python-" in first[0]
    assert not os.path.exists(first[0]) and not os.path.exists(second[0])


async def test_environment_is_minimal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("RLASYNC_SECRET", "do-not-leak")
    result = await run("import os; print(sorted(k for k in os.environ if 'PROXY' in k.upper() or 'SECRET' in k))")
    assert result.text == "[]"


async def test_no_network_when_the_node_can_isolate() -> None:
    if not await network_isolation_available():
        pytest.skip("unshare --net does not work here: the tool runs without network isolation")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("connected")
        except OSError as e:
            print("blocked", e.errno)
        """
    try:
        isolated = await run(code)
        control = await run(code, network_isolation="off")  # proves the connection works without the namespace
    finally:
        server.close()
    assert isolated.text.startswith("blocked") and control.text == "connected"


async def test_required_isolation_fails_cleanly_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlasync.tools import builtin

    monkeypatch.setattr(builtin, "_sandbox", ())
    result = await run("print(1)", network_isolation="required")
    assert not result.ok and result.error_kind == "tool_error" and "cannot isolate the network" in result.text
    assert (await run("print(1)", network_isolation="auto")).text == "1"  # runs, unisolated


async def test_cancellation_kills_the_script_and_removes_its_directory(lock: Path) -> None:
    code = HOLD_LOCK.format(lock=str(lock)) + "import time\ntime.sleep(3600)\n"
    task = asyncio.create_task(run(code, wall_time_s=60))
    assert await wait_until(lambda: started(lock)), "the script never started"
    workdir = lock.read_text()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until(lambda: lock_is_free(lock), 5), "the script outlived the cancellation"
    assert await wait_until(lambda: not os.path.exists(workdir), 5)


async def test_timeout_kills_children_of_the_script(lock: Path) -> None:
    code = "import subprocess, sys\n"
    code += f"subprocess.Popen([sys.executable, '-c', {(HOLD_LOCK.format(lock=str(lock)) + 'import time; time.sleep(3600)')!r}])\n"
    code += "import time\ntime.sleep(3600)\n"
    result = await run(code, wall_time_s=2.0)
    assert result.error_kind == "timeout" and started(lock)
    assert await wait_until(lambda: lock_is_free(lock), 5), "a child of the script survived the timeout"


async def test_a_daemon_that_escaped_the_session_dies_with_the_sandbox(lock: Path) -> None:
    if not await network_isolation_available():
        pytest.skip("without a pid namespace a process that calls setsid can outlive the call (documented)")
    daemon = f"""
        import fcntl, os, time
        if os.fork() == 0:
            os.setsid()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1); os.dup2(devnull, 2)  # the tool sees EOF: the script looks finished
            f = open({str(lock)!r}, "a")
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write("held"); f.flush()
            time.sleep(3600)
        else:
            while os.path.getsize({str(lock)!r}) == 0:
                time.sleep(0.01)
            print("daemon started")
        """
    result = await run(daemon, wall_time_s=10)
    assert result.text == "daemon started"
    assert await wait_until(lambda: lock_is_free(lock), 5), "the daemon survived the call"


async def test_concurrency_is_bounded_per_tool() -> None:
    tool = PythonTool(max_concurrency=1)
    code = "import time; t = time.time(); time.sleep(0.5); print(t)"
    calls = [run_tool_call({"python": tool}, ToolCall("python", {"code": code}), ToolContext()) for _ in range(2)]
    starts = sorted(float(r.text) for r in await asyncio.gather(*calls))
    assert starts[1] - starts[0] >= 0.45  # the second waited for the first's slot
