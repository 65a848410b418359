"""``python -m rlasync`` forked by a spawner (``RLASYNC_FORK_COMMANDS``, what the test suite's
commands use): the process started stands in for the command, as an exec'd one would be it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until_sync

from rlasync.runtime.spawner import COMMANDS_ENV, Spawner
from rlasync.transport.auth import new_secret

RLASYNC = [sys.executable, "-X", "importtime", "-m", "rlasync"]


@pytest.fixture
def spawner_env() -> Iterator[dict[str, str]]:
    """An environment whose ``python -m rlasync`` is forked by a spawner of its own (the CLI loaded)."""
    folder = tempfile.mkdtemp(prefix="rlasync-commands-")  # short: a socket path
    where = str(Path(folder) / "socket")
    spawner = Spawner.launch(("rlasync.cli",), commands=where)
    assert spawner is not None
    yield {**os.environ, COMMANDS_ENV: where}
    spawner.close()
    shutil.rmtree(folder, ignore_errors=True)


def _imported_the_cli(stderr: str) -> bool:
    """Did the started process import the CLI itself (``-X importtime`` lists it)?"""
    return any(line.rstrip().endswith("| rlasync.cli") for line in stderr.splitlines())


def test_a_forked_command_says_and_exits_as_an_exec_d_one(spawner_env: dict[str, str]) -> None:
    exec_env = {k: v for k, v in spawner_env.items() if k != COMMANDS_ENV}
    for argv in (["version"], ["train", "/nonexistent.yaml"]):
        forked = subprocess.run(
            [*RLASYNC, *argv], env=spawner_env, capture_output=True, text=True, timeout=60
        )
        execd = subprocess.run([*RLASYNC, *argv], env=exec_env, capture_output=True, text=True, timeout=60)
        assert not _imported_the_cli(forked.stderr) and _imported_the_cli(execd.stderr)
        assert (forked.returncode, forked.stdout) == (execd.returncode, execd.stdout)
        said = [line for line in forked.stderr.splitlines() if not line.startswith("import time:")]
        assert said == [line for line in execd.stderr.splitlines() if not line.startswith("import time:")]


def test_without_a_spawner_listening_the_command_runs_itself(tmp_path: Path) -> None:
    env = {**os.environ, COMMANDS_ENV: str(tmp_path / "nobody-listens")}
    done = subprocess.run([*RLASYNC, "version"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() and _imported_the_cli(done.stderr)


def _command_pid(marker: str, caller: int) -> int | None:
    """The forked command's process: the one (not the caller) whose command line holds ``marker``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != caller:
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    return int(entry.name)
            except OSError:
                continue
    return None


def _alive(pid: int) -> bool:
    try:
        return "Z" not in (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_caller_reaches_the_command_and_killing_it_kills_the_command(
    spawner_env: dict[str, str], sig: signal.Signals
) -> None:
    folder = tempfile.mkdtemp(prefix="rlasync-node-")
    listen = f"ipc://{folder}/head"
    env = {**spawner_env, "RLASYNC_CLUSTER_SECRET": new_secret()}
    caller = subprocess.Popen(
        [sys.executable, "-m", "rlasync", "node", "--rank", "0", "--listen", listen],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_sync(lambda: Path(folder, "head").exists(), timeout_s=60, what="the head node listens")
        command = _command_pid(listen, caller.pid)
        assert command is not None and command != caller.pid
        caller.send_signal(sig)
        code = caller.wait(timeout=30)
        wait_until_sync(
            lambda: not _alive(command), timeout_s=10, what="the command has ended with its caller"
        )
        assert code == -sig if sig == signal.SIGKILL else code in (0, -sig), (
            caller.stderr.read() if caller.stderr else ""
        )
    finally:
        caller.kill()
        caller.wait()
        shutil.rmtree(folder, ignore_errors=True)
