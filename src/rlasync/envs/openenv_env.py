"""OpenEnv environments: a server's episode is one trajectory's conversation, its rewards the reward.

    data:
      source:
        openenv:
          app: my_env.server.app:app       # started by the run on each agent-loop node ...
          # url: http://10.0.0.7:8000      # ... or a server already running
          action_field: message            # the model's reply becomes the action {message: reply}
          observation_field: echoed_message   # what the model reads (default: the observation as JSON)
          max_turns: 8

Each row is an episode: ``reset`` (with ``reset_args``), then turn by turn the observation is a
user message, the model's reply the action, ``step`` the environment's answer, until it says
``done`` or ``max_turns`` pass. The episode's reward is the sum of its steps' rewards (``reward:
last``: the last step's). The episodes run through OpenEnv's own client (``GenericEnvClient``: a
WebSocket session each), every call within ``timeout_s``.

With ``app``, each node that runs agent loops starts the server (uvicorn, on a free loopback
port, ``cwd`` and ``PYTHONPATH`` as given) when its worker starts and stops it when it ends; the
server must take as many sessions at once as the node runs trajectories (OpenEnv's
``create_app(..., max_concurrent_envs=N)``). Needs ``pip install 'rlasync[envs-frameworks]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Literal

from ..data import Row
from ..rewards import RewardOutput
from .base import EnvError, Environment, Split, import_extra, register_environment

MODEL = "policy"
VAL_EPISODES = 1_000_000_007
"""Held-out episodes are numbered from here (their ``reset`` gets ``seed`` when ``seeded``)."""


@register_environment("openenv")
class OpenEnv(Environment):
    """An OpenEnv server's episodes (see the module docstring)."""

    def __init__(
        self,
        *,
        seed: int,
        url: str = "",
        app: str = "",
        cwd: str = "",
        pythonpath: list[str] | None = None,
        action_field: str = "message",
        observation_field: str = "",
        reset_args: dict[str, Any] | None = None,
        seeded: bool = False,
        max_turns: int = 8,
        reward: Literal["sum", "last"] = "sum",
        size: int = 10000,
        system_prompt: str = "",
        timeout_s: float = 60.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        where = "data.source.openenv"
        if bool(url) == bool(app):
            raise EnvError(f"{where}: give the server's url, or the app to start (module:attr), one of them")
        if reward not in ("sum", "last"):
            raise EnvError(f"{where}.reward: sum or last, got {reward!r}")
        if app and ":" not in app:
            raise EnvError(f"{where}.app: {app!r} is not module:attr (e.g. my_env.server.app:app)")
        self.openenv = import_extra(
            "openenv", setting="data.source.openenv", package="openenv-core", extra="envs-frameworks"
        )
        self.url, self.app, self.cwd = url.rstrip("/"), app, cwd or os.getcwd()
        self.pythonpath = [os.path.abspath(os.path.join(self.cwd, p)) for p in pythonpath or []]
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_args, self.seeded = dict(reset_args or {}), seeded
        self.seed, self.max_turns, self.reward, self.size = int(seed), max_turns, reward, size
        self.system_prompt, self.timeout_s, self.start_timeout_s = system_prompt, timeout_s, start_timeout_s
        self._server: subprocess.Popen[bytes] | None = None

    async def open(self) -> None:
        if not self.app:
            return
        port = _free_port()
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([*self.pythonpath, os.environ.get("PYTHONPATH", "")])
        )
        self._server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                self.app,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is the run's to handle, not the server's
        )
        self.url = f"http://127.0.0.1:{port}"
        await self._wait_listening(port)

    async def _wait_listening(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        while loop.time() < deadline:
            assert self._server is not None
            if self._server.poll() is not None:
                raise EnvError(
                    f"data.source.openenv.app={self.app}: the server exited with {self._server.returncode} while "
                    "starting (its output is above)"
                )
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            await asyncio.sleep(0.1)
        await self.close()
        raise EnvError(
            f"data.source.openenv.app={self.app}: not listening after start_timeout_s={self.start_timeout_s} s"
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None or server.poll() is not None:
            return
        os.killpg(server.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(server.wait), 10.0)
        except TimeoutError:
            os.killpg(server.pid, signal.SIGKILL)
            await asyncio.to_thread(server.wait)

    def rows(self, split: Split, n: int | None = None) -> list[Row]:
        n = self.size if n is None else n
        first = self.seed * 1_000_003 + (VAL_EPISODES if split == "val" else 0)
        return [
            {
                "messages": [{"role": "user", "content": f"OpenEnv episode {first + i}"}],
                "uid": f"openenv:{split}:{i}",
                "agent_name": "environment",
                "openenv_episode": first + i,
                "kind": split,
            }
            for i in range(n)
        ]

    async def converse(self, client: Any, row: Row) -> RewardOutput:
        reset_args = dict(self.reset_args, **({"seed": int(row["openenv_episode"])} if self.seeded else {}))
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        rewards: list[float] = []
        env = self.openenv.GenericEnvClient(base_url=self.url)
        try:
            async with asyncio.timeout(self.timeout_s):
                await env.connect()
                result = await env.reset(**reset_args)
            while not result.done and len(rewards) < self.max_turns:
                messages.append({"role": "user", "content": self._text(result.observation)})
                reply = await client.chat.completions.create(model=MODEL, messages=messages)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                async with asyncio.timeout(self.timeout_s):
                    result = await env.step({self.action_field: text})
                rewards.append(float(result.reward or 0.0))
        finally:
            with contextlib.suppress(
                Exception
            ):  # the session may already be gone; the episode's outcome stands
                async with asyncio.timeout(self.timeout_s):
                    await env.close()
        score = (sum(rewards) if self.reward == "sum" else rewards[-1]) if rewards else 0.0
        return RewardOutput(
            score=score, metrics={"env_turns": float(len(rewards)), "done": float(bool(result.done))}
        )

    def _text(self, observation: dict[str, Any]) -> str:
        """What the model reads of an observation: ``observation_field``, or all of it but the
        fields every observation has (reward, done, metadata) as JSON."""
        if self.observation_field:
            if self.observation_field not in observation:
                raise KeyError(
                    f"data.source.openenv.observation_field={self.observation_field!r}: the observation has "
                    f"{sorted(observation)}"
                )
            return str(observation[self.observation_field])
        return json.dumps({k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
