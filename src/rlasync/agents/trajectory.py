"""What an agent loop produces: one trajectory, token-exact, ready for training."""

from __future__ import annotations

from typing import Any

import msgspec


class TrajectoryMetrics(msgspec.Struct, kw_only=True):
    generation_s: float = 0.0  # time spent waiting for the engine
    tool_s: float = 0.0  # time spent running tools
    tool_calls: int = 0
    tool_errors: int = 0  # calls that failed: malformed, unknown tool, tool error, timeout
    aborts: int = 0  # model turns the engine aborted (pause, weight update) and the loop resumed
    interrupts: int = 0  # times the loop itself was interrupted and resumed
    reward_error: str = ""  # the reward function's exception, if it raised (the reward is then 0)
    error: str = (
        ""  # the engine's error, or the loop's exception, that ended the trajectory (termination "error")
    )
    turn_s: list[float] = []  # seconds of each engine request (a model turn, or a piece a pause cut off)
    # Tool calls by tool: its name if the row offered it, else "unknown"; "malformed": calls that
    # did not parse. Then the ones that failed, by the same names ("skipped": past the turn's cap).
    tools: dict[str, int] = {}
    tools_failed: dict[str, int] = {}


class Trajectory(msgspec.Struct, kw_only=True):
    """One rollout. ``response_ids`` holds every token after the prompt, the model's and the
    environment's, exactly as the model saw them; the mask says whose each token is."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1: a token the model generated (trained on); 0: a tool or user token (not trained on)."""
    logprobs: list[float]
    """Behaviour logprob of each response token under the sampling policy; 0.0 where the mask is 0."""
    versions: list[int]
    """Weight version that produced each response token; -1 where the mask is 0."""
    reward: float
    num_turns: int
    """Assistant turns plus tool/user turns, plus one for the prompt (verl's count)."""
    termination: str
    """Why it ended: ``stop`` (the model answered), ``response_length`` (the token budget),
    ``max_new_tokens`` (one turn hit the sampling limit), ``max_assistant_turns``,
    ``max_user_turns``, ``interaction`` (the simulated user ended it), ``aborted`` (the engine
    kept aborting the turn), ``error`` (the engine refused or lost the request, or the loop raised:
    ``metrics.error``)."""
    metrics: TrajectoryMetrics
    messages: list[dict[str, Any]] = []
    """The conversation as text (for rewards, logs and humans; never re-tokenised)."""
    extra: dict[str, Any] = {}
    samples: list[Trajectory] = []
    """More samples of this rollout, trained with its reward and advantage: the calls of an
    ``openai`` agent that did not continue the ones above (``rlasync.serving.recording``)."""
