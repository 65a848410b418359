"""Tool calls on the simulator, for planning agentic runs (``Profile.tools``).

The ``sim_tools`` agent loop is the ``tool`` loop (``agents.ToolAgentLoop``) whose model turns
call a tool a drawn number of times (``ToolCalls.calls``): the simulated engines' tokens are
not text, so the calls are decided by the trajectory's seed instead of parsed. Each call runs
through the real tool path (``run_tool_call``, the loop's ``tool_s``, the tool turn appended
as environment tokens) to ``simulated_call``, which takes a drawn time on the simulated clock
(``ToolCalls.latency_s``) and answers ``output_tokens`` tokens. So the schedules meet the gaps
an agentic workload leaves between its turns, and the context each turn grows by.

    profile = PROFILES["generic-8b-h100-agent"]
    measure(load_config("configs/quickstart_async.yaml"), profile, generation_gpus=24, trainer_gpus=8, steps=6, warmup=2)

``simulated_config`` selects the loop and configures the tool when the cluster's profile has
tool calls (``SimCluster.tools``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..agents import ToolAgentLoop, Trajectory, register
from ..agents.loops import turn_seed
from ..engines import SamplingParams
from ..tools import Tool, ToolCall, ToolContext, get_parser, register_tool
from ..tools.parsers.base import ParsedTurn
from .profiles import ToolCalls

LOOP = "sim_tools"


@register_tool
class SimulatedCall(Tool):
    """A tool call that takes ``ToolCalls.latency_s`` simulated seconds (``scale`` loop seconds
    each: the simulator's ``SimClock.scale``) and answers ``output_tokens`` tokens, made of
    ``token_block`` each as the simulated engines' are (one character apiece here)."""

    name = "simulated_call"
    timeout_s = None  # the simulated clock's: ``latency_cap_s`` bounds it

    def __init__(self, *, scale: float, token_block: int = 1, **workload: Any) -> None:
        self.scale, self.token_block = scale, token_block
        self.workload = ToolCalls(**workload)

    async def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        seed = turn_seed(0, context.trajectory_id, context.turn) or 0
        await asyncio.sleep(self.workload.latency_s(seed) * self.scale)
        return "x" * max(1, self.workload.output_tokens // self.token_block)


class _Calls:
    """The ``tool`` loop's parser for simulated turns: a call after each of the trajectory's
    first ``calls`` model turns, none after the last; the replies are formatted by ``parser``
    (``agent.tool_parser``'s), as a real run's are."""

    def __init__(self, parser: Any, loop: SimToolLoop, calls: int) -> None:
        self.parser, self.loop, self.calls = parser, loop, calls

    def parse(self, text: str) -> ParsedTurn:
        if self.loop.state.assistant_turns > self.calls:
            return ParsedTurn()
        return ParsedTurn(calls=[ToolCall(name=SimulatedCall.name, arguments={})])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


@register(LOOP)
class SimToolLoop(ToolAgentLoop):
    """Model turns separated by simulated tool calls (the module's docstring)."""

    async def run(self, params: SamplingParams, **row: Any) -> Trajectory:
        tool = self.tools.get(SimulatedCall.name)
        if not isinstance(tool, SimulatedCall):
            raise ValueError(
                f"the {LOOP} loop calls the {SimulatedCall.name} tool: set agent.tools to "
                f"{{'{SimulatedCall.name}': {{'scale': ...}}}} (rlasync.modes.sim.simulated_config does)"
            )
        # The trajectory's own draw, apart from its turns' (turn -1).
        calls = tool.workload.calls(turn_seed(params.seed or 0, self.trajectory_id, -1) or 0)
        parser = _Calls(get_parser(self.config.tool_parser), self, calls)
        with self._trajectory(row) as s:
            return await self._run(s, parser, params, row)


__all__ = ["LOOP", "SimToolLoop", "SimulatedCall"]
