"""``runtime.allocator``: which allocator a setting means here, and that a node command really
runs under it (the library mapped into its process) after starting itself again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlasync.runtime import allocator
from rlasync.runtime.allocator import AllocatorError, allocator_env, resolve
from rlasync.runtime.spawner import COMMANDS_ENV

ROOT = Path(__file__).parents[2]
INSTALLED = resolve("auto")


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Pretend only the allocators in the yielded set are installed."""
    present: set[str] = set()
    monkeypatch.setattr(
        allocator.ctypes.util, "find_library", lambda n: f"lib{n}.so.9" if n in present else None
    )
    allocator._library.cache_clear()
    yield present
    allocator._library.cache_clear()


def test_auto_takes_the_first_installed_and_glibc_takes_none(installed: set[str]) -> None:
    assert resolve("auto") is None and resolve("glibc") is None  # nothing installed: glibc's
    installed.add("jemalloc")
    allocator._library.cache_clear()
    assert resolve("auto") == ("jemalloc", "libjemalloc.so.9")
    installed.add("tcmalloc_minimal")
    allocator._library.cache_clear()
    assert resolve("auto") == ("tcmalloc", "libtcmalloc_minimal.so.9")
    assert resolve("jemalloc") == ("jemalloc", "libjemalloc.so.9") and resolve("glibc") is None


def test_a_named_allocator_not_installed_is_an_error_naming_its_package(installed: set[str]) -> None:
    with pytest.raises(AllocatorError, match="apt-get install libjemalloc2"):
        resolve("jemalloc")


def test_the_allocator_is_preloaded_ahead_of_what_was_there(installed: set[str]) -> None:
    installed.add("tcmalloc_minimal")
    env = allocator_env("auto", {"LD_PRELOAD": "libother.so", "A": "1"})
    assert env == {"LD_PRELOAD": "libtcmalloc_minimal.so.9 libother.so", "A": "1"}
    assert allocator_env("auto", env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not twice
    # glibc's: what the user preloaded stays; what a start again under tcmalloc put there goes.
    assert allocator_env("glibc", env) == env
    assert allocator_env("glibc", {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == {
        "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"
    }
    started_again = {**env, allocator.REEXEC_ENV: "tcmalloc"}
    assert allocator_env("glibc", started_again) == {
        "LD_PRELOAD": "libother.so",
        "A": "1",
        allocator.REEXEC_ENV: "tcmalloc",
    }
    installed.add("jemalloc")
    allocator._library.cache_clear()
    assert allocator_env("jemalloc", env)["LD_PRELOAD"] == "libjemalloc.so.9 libother.so"  # one at a time


def _listening(path: Path, process: subprocess.Popen[bytes], deadline_s: float) -> bool:
    """Whether the node listens at ``path`` (past the point where it starts itself again) by the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists():
            return True
        time.sleep(0.2)
    return path.exists()


@pytest.mark.skipif(
    INSTALLED is None, reason="needs tcmalloc or jemalloc (apt-get install libtcmalloc-minimal4)"
)
@pytest.mark.parametrize("setting", ["auto", "glibc"])
def test_a_node_command_runs_under_its_allocator(setting: str, tmp_path: Path) -> None:
    """``rlasync node`` started plainly (no allocator preloaded) starts itself again under the one
    its config names, same process id; ``glibc`` leaves it as it is."""
    unset = (
        "LD_PRELOAD",
        allocator.REEXEC_ENV,
        COMMANDS_ENV,
    )  # COMMANDS_ENV: not forked from the suite's spawner
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(ROOT / "src")
    command = [sys.executable, "-m", "rlasync", "node", "--rank", "0", "--listen", f"ipc://{tmp_path}/node"]
    node = subprocess.Popen(
        [*command, "--set", f"runtime.allocator={setting}"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert INSTALLED is not None
        library = INSTALLED[1].split(".so")[0]
        assert _listening(tmp_path / "node", node, 60), (
            f"the node did not listen within 60 s (exit {node.poll()})"
        )
        maps = Path(f"/proc/{node.pid}/maps").read_text()
        assert (library in maps) == (setting == "auto"), f"{library} mapped under runtime.allocator={setting}"
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(timeout=10)
