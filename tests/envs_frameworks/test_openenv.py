"""OpenEnv environments trained unchanged (``data.source.openenv``), in sync and fully async: an
echo server the run starts and stops itself, driven through OpenEnv's own client; an episode is
one trajectory, the sum of its steps' rewards (the server's) its reward."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlasync.envs import EnvError, make_environment

pytest.importorskip("openenv", reason="needs openenv-core: the envs tier, `make test-envs`")

from frameworks import run_yaml  # noqa: E402

pytestmark = pytest.mark.timeout(900)

ECHO_SERVER = '''\
"""An OpenEnv echo server: the observation repeats the last message; a step's reward is a tenth of
its length; an episode ends after three steps."""
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    message: str = Field(..., description="What to echo")


class EchoObservation(Observation):
    echoed_message: str = Field(default="")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "episode", step_count=0)
        return EchoObservation(echoed_message="Say something.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= 3
        return EchoObservation(echoed_message=action.message, done=done, reward=len(action.message) * 0.1)

    @property
    def state(self):
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=64)
'''

SOURCE = (
    "data:\n  source:\n    openenv: {app: 'echo_server:app', pythonpath: ['.'], action_field: message,"
    " observation_field: echoed_message, max_turns: 5}\n"
)


def _servers(cwd: Path) -> set[int]:
    """The echo servers running in ``cwd`` (another test's run in its own folder may have its own)."""
    out = subprocess.run(["pgrep", "-f", "uvicorn echo_server:app"], capture_output=True, text=True)
    found = set()
    for pid in map(int, out.stdout.split()):
        try:
            if Path(f"/proc/{pid}/cwd").resolve() == cwd.resolve():
                found.add(pid)
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_an_echo_server_started_by_the_run_rewards_each_episode(
    tmp_path: Path, nano_model_dir: Path, mode: str
) -> None:
    (tmp_path / "echo_server.py").write_text(ECHO_SERVER)
    run = run_yaml(tmp_path, SOURCE, model=nano_model_dir, mode=mode, prompts=2)
    for trace in run["traces"]:
        messages = trace["messages"]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(replies) == 3  # the server ends each episode after three steps
        assert messages[0]["content"] == "Say something." and messages[2]["content"] == replies[0]  # the echo
        assert trace["reward"] == pytest.approx(sum(len(r) * 0.1 for r in replies)), trace
    assert not _servers(tmp_path)  # the server the run started has stopped with it


def test_a_running_server_is_used_by_its_url_and_bad_settings_are_named(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    (tmp_path / "echo_server.py").write_text(ECHO_SERVER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "echo_server:app", "--port", str(port), "--log-level", "warning"],
        cwd=tmp_path,
    )
    try:
        source = f"data:\n  source:\n    openenv: {{url: 'http://127.0.0.1:{port}', observation_field: echoed_message}}\n"
        for _ in range(100):  # up within 10 s
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        run = run_yaml(tmp_path, source, model=nano_model_dir, mode="sync", prompts=2)
        assert all(r["reward"] > 0 for r in run["steps"])
    finally:
        server.terminate()
        server.wait(timeout=30)
    with pytest.raises(EnvError, match=r"give the server's url, or the app to start"):
        make_environment({"openenv": {}}, seed=0)
    with pytest.raises(EnvError, match=r"is not module:attr"):
        make_environment({"openenv": {"app": "echo_server"}}, seed=0)
