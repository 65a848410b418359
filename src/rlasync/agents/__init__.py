"""Agent loops: how one trajectory is rolled out (single turn, tools, simulated users:
``agent.interaction``, ``register_interaction``).

    loop = get_loop(row.get("agent_name", config.default_loop))(router, tokenizer, config, tools=tools)
    trajectory = await loop.run(SamplingParams(temperature=1.0, seed=7), **row)

A loop object rolls out one trajectory (its state is how a cancelled ``run`` resumes): make one
per trajectory; a second concurrent ``run``, or a ``run`` with another row, raises ``LoopReuseError``.
"""

from .base import AgentLoop, Interaction, LoopReuseError, RewardFn, get_loop, register, registered_reward
from .batch import RolloutBatch, collate
from .interactions import InteractionError, RetryInteraction, register_interaction, registered_interactions
from .loops import LoopState, ResumableLoop, SingleTurnAgentLoop, ToolAgentLoop
from .manager import AgentLoopManager, NoWorkerError
from .template import ChatTurns, TemplateError
from .trajectory import Trajectory, TrajectoryMetrics
from .worker import AgentLoopWorker, AgentWorkerSpec

__all__ = [
    "AgentLoop",
    "AgentLoopManager",
    "AgentLoopWorker",
    "AgentWorkerSpec",
    "ChatTurns",
    "Interaction",
    "InteractionError",
    "LoopReuseError",
    "LoopState",
    "NoWorkerError",
    "ResumableLoop",
    "RetryInteraction",
    "RewardFn",
    "RolloutBatch",
    "SingleTurnAgentLoop",
    "TemplateError",
    "ToolAgentLoop",
    "Trajectory",
    "TrajectoryMetrics",
    "collate",
    "get_loop",
    "register",
    "register_interaction",
    "registered_interactions",
    "registered_reward",
]
