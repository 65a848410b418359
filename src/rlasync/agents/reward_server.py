"""A reward model on a node of its own: one ``RewardModelServer`` actor loads it where the config
says (``data.reward: {reward_model: {path: ..., node: 1}}``) and scores for every agent-loop
worker, so one set of weights serves the whole run and calls from all nodes share its batches.

    server = await cluster.spawn(RewardModelServer, {"path": "models/my-rm"}, node=1, name="reward-model")
    reward = RewardModel(path="models/my-rm", served_by=server)   # on any node: its calls go there

The run spawns it before the agent-loop workers (``rlasync.compose.cluster_fleet``) and hands
them its ref inside the reward's options. It loads the model as it starts, so a wrong folder
stops the run at start-up; a call that outlives ``timeout_s`` (or a lost node) is the caller's
recorded 0.0 (``reward/errors``), as for every reward.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..rewards import RewardInput, RewardModel
from ..runtime import Actor, endpoint


class RewardModelServer(Actor):
    """The reward model (``RewardModel`` options, ``node`` aside) behind one endpoint."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.model = RewardModel(
            **{k: v for k, v in options.items() if k not in ("name", "node", "served_by")}
        )

    async def on_start(self) -> None:
        await asyncio.to_thread(self.model.load)

    @endpoint
    async def score(self, messages: list[dict[str, Any]]) -> float:
        """The score of one conversation; concurrent calls, whichever node sent them, are batched."""
        out = await self.model(RewardInput(response_text="", messages=messages))
        return out.score

    @endpoint
    async def passes(self) -> int:
        """Forward passes made so far (each scores up to ``batch_size`` conversations)."""
        return self.model.passes
