"""End to end: the torch engine on a node process runs ToolAgentLoop with the calculator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlasync import LocalCluster, RuntimeConfig
from rlasync.agents import ToolAgentLoop
from rlasync.config import AgentConfig, EngineConfig
from rlasync.data import loop_reward, make_problems
from rlasync.engines import EngineActor, Router, SamplingParams
from rlasync.models import load_pretrained_dir
from rlasync.tools import build_tools

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.mark.timeout(600)
async def test_tool_agent_loop_with_the_calculator_over_node_processes(calc_model: Path) -> None:
    _, tok = load_pretrained_dir(calc_model)
    tools = build_tools(["calculator"])
    problems = make_problems("calc", 24, seed=0, split="val")
    config = RuntimeConfig(preload_modules=("rlasync.engines",))
    async with LocalCluster(nodes=3, config=config) as cluster:
        engines = [
            await cluster.spawn(EngineActor, EngineConfig(model=str(calc_model)), node=n, name=f"engine-{n}")
            for n in (1, 2)
        ]
        async with Router(engines) as router:
            loops = [
                ToolAgentLoop(
                    router,
                    tok,
                    AgentConfig(tools=["calculator"], max_assistant_turns=3),
                    tools=tools,
                    reward_fn=loop_reward("calc"),
                    trajectory_id=f"t{i}",
                )
                for i in range(len(problems))
            ]
            rows = [{"messages": p.messages, "problem": p} for p in problems]
            params = SamplingParams(temperature=0.0, max_new_tokens=64)  # greedy: the same answers every run
            trajectories = await asyncio.gather(*[loop.run(params, **row) for loop, row in zip(loops, rows)])
            assert {e.name for e in router.stats().engines} == {"engine-1", "engine-2"}
    schemas = [tool.schema() for tool in tools.values()]
    used_tool = [t for t in trajectories if t.metrics.tool_calls]
    assert len(used_tool) >= len(problems) // 2  # the warm-start calls the tool most of the time
    assert sum(t.reward for t in trajectories) >= len(problems) // 4  # and copies its result right often
    for t in used_tool:
        # What the model saw is what the trajectory holds, separators included. (Compared as
        # text: a sampled model may spell a word with other tokens than the tokenizer would.)
        text = tok.apply_chat_template(t.messages, tools=schemas, tokenize=False, add_generation_prompt=False)
        if t.termination == "stop":
            assert tok.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False) + "\n" == text
        tool_turn = t.messages[2]
        assert tool_turn["role"] == "tool" and (
            tool_turn["content"].lstrip("-").isdigit() or "error" in tool_turn["content"].lower()
        )
