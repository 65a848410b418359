"""The ``openai`` agent loop: train an agent written against the OpenAI API, unchanged.

    # my_agents.py: plain OpenAI-client code
    async def solve(client: openai.AsyncOpenAI, row: dict) -> float | None:
        reply = await client.chat.completions.create(model="policy", messages=row["messages"])
        return 1.0 if reply.choices[0].message.content.strip() == row["answer"] else 0.0

    # the run's YAML
    agent: {default_loop: openai, openai_agent: my_agents:solve}

Each agent-loop worker starts one ``Endpoint`` on loopback (the loops' shared resource). A
trajectory's loop makes a key, hands the agent an ``openai.AsyncOpenAI`` with that key and the
endpoint's address, and awaits it; every call the agent makes is recorded with its tokens. The
calls become the trajectory (``rlasync.serving.recording``: calls that continue one another form
one multi-turn sample, environment tokens masked; others are samples of their own, in
``Trajectory.samples``, with the same reward). The agent's return value is the reward; None
scores the conversation (the last call's messages and reply) with the run's reward.

What the agent does not set in a call comes from the run: temperature, top_p, the turn's
token limit (``train.max_new_tokens``) and a seed per call (validation is greedy this way, and
a resumed run samples what the first did). An agent that raises ends its trajectory with
termination ``error`` (reward 0, the prompt alone), as a loop that raises does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .. import plugins
from ..agents.base import AgentLoop, Generator, register
from ..agents.trajectory import Trajectory
from ..config.agent import AgentConfig
from ..config.loader import ConfigError, import_object
from ..engines.types import SamplingParams
from ..rewards import RewardOutput
from .endpoint import Endpoint
from .recording import samples, trajectory_of

# The client logs every request at INFO: a line per call of every trajectory.
for _name in ("httpx", "httpx2", "openai"):
    logging.getLogger(_name).setLevel(logging.WARNING)

Agent = Callable[[Any, dict[str, Any]], Awaitable["float | RewardOutput | None"]]


@functools.cache
def load_agent(path: str) -> Agent:
    """The agent function at ``path`` (``module:function``, ``module.function``, or
    ``path/to/file.py:function``, imported as a plugin file is); a ``ConfigError`` naming
    ``agent.openai_agent`` if it cannot be imported or is not an async function."""
    import inspect

    try:
        import openai  # noqa: F401  (the agents' client)
    except ImportError:
        raise ConfigError(
            "agent.openai_agent: the openai loop hands agents an openai.AsyncOpenAI: pip install 'rlasync[openai]'"
        ) from None
    file, sep, name = path.rpartition(":")
    if sep and file.endswith(".py"):
        agent = getattr(plugins.load(file), name, None)
        if agent is None:
            raise ConfigError(f"agent.openai_agent: {file} defines no {name!r}")
    else:
        agent = import_object(path, "agent.openai_agent", ConfigError)
    if not inspect.iscoroutinefunction(agent):
        raise ConfigError(
            f"agent.openai_agent={path} is not an async function: write `async def agent(client, row) -> float | None`"
        )
    return agent


@register("openai")
class OpenAIAgentLoop(AgentLoop):
    shared: Endpoint | None
    uses_openai_agent = True
    """Its agent is ``agent.openai_agent`` (checked at start-up)."""

    @classmethod
    def shared_resource(
        cls, engine: Generator, tokenizer: Any, config: AgentConfig
    ) -> contextlib.AbstractAsyncContextManager[Any] | None:
        """The worker's endpoint: it listens from the first ``openai`` trajectory to the worker's end."""
        return Endpoint(engine, tokenizer, config.endpoint, recording=True, tool_parser=config.tool_parser)

    async def run(self, params: SamplingParams, **row: Any) -> Trajectory:
        endpoint = self.shared
        if endpoint is None:
            raise RuntimeError(
                "the openai loop runs on an agent-loop worker, which starts its endpoint; alone, set "
                "`loop.shared = endpoint` (an rlasync.serving.Endpoint with recording=True)"
            )
        agent = self.agent()
        key = endpoint.record(params, self.trajectory_id)
        client = endpoint.client(key, max_retries=2)  # a 429 from a full endpoint is retried with back-off
        try:
            reward = await agent(client, dict(row))
        finally:  # an agent that raised ends its trajectory with termination "error" (the worker's)
            calls = endpoint.recorded(key)
        if not calls:
            raise AgentCallError(
                f"the agent {getattr(agent, '__qualname__', agent)} made no call to the endpoint"
            )
        groups = samples(calls)
        made = [trajectory_of(group, response_length=self.config.response_length) for group in groups]
        # The sample holding the last call is the trajectory; the others ride along.
        main = next(i for i, group in enumerate(groups) if group[-1] is calls[-1])
        trajectory = made.pop(main)
        trajectory.samples = made
        if isinstance(reward, RewardOutput):  # an environment's, with its error if it failed
            if "error" in reward.metrics:
                trajectory.metrics.reward_error = str(reward.metrics["error"])
            reward = reward.score
        trajectory.reward = float(await self._reward(row, trajectory) if reward is None else reward)
        for sample in made:
            sample.reward = trajectory.reward
        return trajectory

    def agent(self) -> Agent:
        """What holds the conversation: ``agent.openai_agent``."""
        return load_agent(self.config.openai_agent)


@register("environment")
class EnvironmentLoop(OpenAIAgentLoop):
    """The rows of an environment that holds each conversation itself (``data.source``:
    verifiers, TextArena, OpenEnv): its ``converse`` is the agent, its return the reward."""

    uses_openai_agent = False

    def agent(self) -> Agent:
        if self.environment is None:
            raise RuntimeError(
                "the environment loop runs the rows of data.source's environment, which this loop was not given "
                "(a row with agent_name: environment in a run without data.source?)"
            )
        return self.environment.converse


class AgentCallError(RuntimeError):
    """An ``openai`` agent returned without calling the endpoint: there is nothing to train on."""
