"""rlasync embedded in a script: the whole RL loop written by hand, no config file, no CLI.

    .venv/bin/python examples/embed.py [--steps 3] [--prompts 4] [--group 4]

What it does, each part the public API a script of yours would use:

1. Builds a tiny Qwen2-shaped model and its tokenizer in code (``rlasync.models``) and saves
   them as a Hugging Face folder (engines and trainer ranks load folders).
2. Starts a 2-node local cluster (this process is the head, one node process beside it) and
   spawns a custom actor (``Scoreboard``: a unary and a streaming endpoint) on the other node.
3. Hosts an ``EngineActor`` on each node and puts a ``Router`` in front of the two.
4. Each step rolls out ``prompts x group`` ``ToolAgentLoop`` trajectories at once (one loop
   object per trajectory), scored by a reward function of its own, ``partial_credit``.
5. Turns them into a ``TrainBatch`` with GRPO advantages, takes a step on a ``TrainerActor``
   (its rank in a process the head supervises) and pushes the new weights to both engines
   with a ``ParameterSynchronizer``.
6. Streams the best trajectories back from the scoreboard and shuts everything down cleanly.

The model is untrained (nothing here warm-starts it), so rewards are small: the point is the
plumbing. ``rlasync train`` composes these same parts from a config.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import rlasync
from rlasync.agents import ToolAgentLoop, Trajectory, collate
from rlasync.algorithms import grpo_advantages
from rlasync.config import AgentConfig, TrainerConfig, WeightsConfig
from rlasync.engines import EngineActor, EngineConfig, Router, SamplingParams
from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir
from rlasync.tools import build_tools
from rlasync.trainer import TrainBatch, TrainerActor
from rlasync.weights import ParameterSynchronizer

QUESTIONS = [
    ("What is 17+25?", "42"),
    ("What is 9*8?", "72"),
    ("What is 100-37?", "63"),
    ("What is 12*12?", "144"),
    ("What is 81/9?", "9"),
    ("What is 250+250?", "500"),
    ("What is 7*6?", "42"),
    ("What is 64-15?", "49"),
]


class Scoreboard(rlasync.Actor):
    """A custom actor: trajectories report here (unary), the best stream back (streaming)."""

    def __init__(self) -> None:
        self.rewards: dict[str, float] = {}

    @rlasync.endpoint
    async def record(self, trajectory_id: str, reward: float) -> int:
        self.rewards[trajectory_id] = reward
        return len(self.rewards)

    @rlasync.endpoint
    async def best(self, n: int) -> AsyncIterator[tuple[str, float]]:
        for trajectory_id, reward in sorted(self.rewards.items(), key=lambda kv: -kv[1])[:n]:
            yield trajectory_id, reward


def partial_credit(row: dict[str, Any], trajectory: Trajectory) -> float:
    """A reward of one's own. A loop calls ``reward_fn(row, trajectory)`` (sync or async) with
    the dataset row it ran and the finished trajectory: here, the share of the expected
    answer's characters that the final assistant message contains."""
    answers = [m for m in trajectory.messages if m.get("role") == "assistant"]
    final = str(answers[-1]["content"]) if answers else ""
    truth = str(row["ground_truth"])
    return sum(ch in final for ch in truth) / len(truth)


async def main(steps: int, prompts: int, group: int) -> None:
    with tempfile.TemporaryDirectory(prefix="rlasync-embed-") as tmp:
        model, tokenizer = build_tiny_lm(TinyLMConfig.preset("nano", seed=0))
        model_dir = save_pretrained_dir(model, tokenizer, Path(tmp) / "nano")

        async with rlasync.LocalCluster(nodes=2) as cluster:
            board = await cluster.spawn(Scoreboard, node=1, name="scoreboard")
            engines = [
                await cluster.spawn(
                    EngineActor, EngineConfig(model=str(model_dir)), node=n, name=f"engine-{n}"
                )
                for n in (0, 1)
            ]
            router = Router(engines)
            agent = AgentConfig(tools=["calculator"], max_assistant_turns=2, response_length=96)
            tools = build_tools(agent.tools)
            async with TrainerActor(TrainerConfig(world_size=1, lr=1e-3), node=cluster.head) as trainer:
                await trainer.start(model_dir, total_steps=steps)
                weights = ParameterSynchronizer(WeightsConfig(), trainer, engines)
                await weights.start()
                for step in range(1, steps + 1):
                    rows = [
                        {"messages": [{"role": "user", "content": q}], "ground_truth": a}
                        for q, a in QUESTIONS[:prompts]
                        for _ in range(group)
                    ]
                    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=step)
                    # One loop object per trajectory: a loop holds that trajectory's state.
                    loops = [
                        ToolAgentLoop(
                            router,
                            tokenizer,
                            agent,
                            tools=tools,
                            reward_fn=partial_credit,
                            trajectory_id=f"step{step}/{i}",
                        )
                        for i in range(len(rows))
                    ]
                    trajectories = list(
                        await asyncio.gather(*[loop.run(params, **row) for loop, row in zip(loops, rows)])
                    )
                    await asyncio.gather(
                        *[board.record(loop.trajectory_id, t.reward) for loop, t in zip(loops, trajectories)]
                    )
                    batch = collate(trajectories, tokenizer.pad_token_id)
                    metrics = await trainer.step(
                        TrainBatch.from_rollout(batch, grpo_advantages(batch.rewards, group))
                    )
                    report = await weights.sync(version=step)
                    print(
                        f"step {step}: reward {float(batch.rewards.mean()):.3f}, loss {metrics['loss']:.4f}, "
                        f"{len(trajectories)} trajectories, weights v{step} on {sorted(report.engines)}",
                        flush=True,
                    )
                weights.close()
            await router.close()
            async for trajectory_id, reward in board.best(3):
                print(f"best: {trajectory_id} reward {reward:.2f}")
    print("done: cluster, engines, trainer and weight sync closed")


if __name__ == "__main__":  # every node imports this script to find Scoreboard: start nothing at import
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="distinct questions per step")
    parser.add_argument("--group", type=int, default=4, help="trajectories per question (GRPO group)")
    args = parser.parse_args()
    rlasync.run(main(args.steps, args.prompts, args.group))
