"""What the endpoint records of one trajectory's calls, and how the calls become trajectories.

The rule (AReaL's and prime-rl's): a call whose prompt begins, token for token, with an earlier
call's prompt and completion continues that call's conversation. The tokens between (the tool
results and user messages the client added, and the chat template's separators) are the
environment's: kept in the trajectory, masked out of the loss. A call that continues none
starts a sample of its own; every sample of a trajectory shares its reward.

The endpoint makes the rule hold for a client that sends the conversation back as it received
it: the prompt of such a call is the earlier call's tokens, exactly as the model produced them,
and the template's rendering of the new messages only (never the model's text tokenised again).
What breaks it: a client that edits or drops earlier turns (a summarising memory, a sliding
window), changes the ``tools`` list, or continues a completion that ended without the end of
turn (``max_tokens`` or a ``stop`` string reached). Each such call is its own sample.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..agents.trajectory import Trajectory, TrajectoryMetrics
from ..engines.types import SamplingParams


class Call(msgspec.Struct, kw_only=True):
    """One choice of one request, as generated."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the API's: stop, length, tool_calls
    generation_s: float = 0.0
    aborts: int = 0  # times a weight sync cut it and it went on
    messages: list[dict[str, Any]] = []  # chat: the conversation sent and the reply
    tool_calls: int = 0


class _Turn(msgspec.Struct, frozen=True):
    """A conversation the endpoint answered, as the client will send it back: its messages
    (compared as ``said``), the tools offered, and every token of it (prompt and completion,
    the completion ending with the end of turn)."""

    said: tuple[Any, ...]
    tools: str
    ids: tuple[int, ...]


class Recording:
    """The calls made with one trajectory's key, in the order they finished."""

    def __init__(self, key: str, params: SamplingParams, trajectory_id: str) -> None:
        self.key = key
        self.trajectory_id = trajectory_id
        self.params = params  # the run's sampling: what a request does not name
        self.calls: list[Call] = []
        self.requests = 0  # requests made (their ids and seeds)
        self._turns: list[_Turn] = []
        self._aside: Recording | None = None

    def aside(self) -> Recording:
        """Where this trajectory's calls sent with ``X-Rlasync-Train: false`` go: answered with
        the run's sampling (seeds of their own) and continued token for token among themselves,
        but never the trajectory's (``Endpoint.recorded`` returns this one's calls only)."""
        if self._aside is None:
            self._aside = Recording(self.key + "~aside", self.params, self.trajectory_id + "~aside")
        return self._aside

    def remember(self, messages: list[dict[str, Any]], tools: Any, ids: list[int]) -> None:
        """``messages`` (the conversation with the reply) will come back: its tokens are ``ids``."""
        self._turns.append(_Turn(said(messages), _tools_key(tools), tuple(ids)))

    def continued(
        self, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[list[int], list[dict[str, Any]]] | None:
        """The tokens of the longest answered conversation that ``messages`` continue, and the
        messages after it (tool or user turns only); None if they continue none."""
        sent, key = said(messages), _tools_key(tools)
        for turn in sorted(self._turns, key=lambda t: -len(t.said)):
            n = len(turn.said)
            if turn.tools == key and len(sent) > n and sent[:n] == turn.said:
                rest = messages[n:]
                if all(m.get("role") in ("tool", "user") for m in rest):
                    return list(turn.ids), rest
        return None


def said(messages: list[dict[str, Any]]) -> tuple[Any, ...]:
    """Messages as compared for continuation: role, text, and tool calls by name and decoded
    arguments (a client may send ``content: null`` for ``""``, or re-serialise arguments)."""
    return tuple(
        (m.get("role"), text_of(m.get("content")), _calls_key(m.get("tool_calls"))) for m in messages
    )


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


def _calls_key(calls: Any) -> tuple[Any, ...]:
    if not calls:
        return ()
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return tuple(out)


def _tools_key(tools: Any) -> str:
    return json.dumps(tools or [], sort_keys=True)


def samples(calls: list[Call]) -> list[list[Call]]:
    """The calls grouped by the rule above, each group in order; a call continues the group with
    the most tokens that its prompt begins with."""
    groups: list[tuple[list[int], list[Call]]] = []
    for call in calls:
        best = None
        for i, (tokens, _) in enumerate(groups):
            if len(call.prompt_ids) >= len(tokens) and call.prompt_ids[: len(tokens)] == tokens:
                if best is None or len(tokens) > len(groups[best][0]):
                    best = i
        if best is None:
            groups.append((list(call.prompt_ids) + call.completion_ids, [call]))
        else:
            groups[best] = (list(call.prompt_ids) + call.completion_ids, [*groups[best][1], call])
    return [group for _, group in groups]


def trajectory_of(calls: list[Call], *, response_length: int) -> Trajectory:
    """One sample: the first call's prompt, then every completion (trained on) with the
    environment's tokens between (not trained on); cut at ``response_length`` tokens."""
    first = calls[0]
    prompt = list(first.prompt_ids)
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    metrics = TrajectoryMetrics()
    for call in calls:
        between = call.prompt_ids[len(prompt) + len(ids) :]
        ids += between
        mask += [0] * len(between)
        logprobs += [0.0] * len(between)
        versions += [-1] * len(between)
        ids += call.completion_ids
        mask += [1] * len(call.completion_ids)
        logprobs += call.logprobs
        versions += call.versions
        metrics.generation_s += call.generation_s
        metrics.turn_s.append(call.generation_s)
        metrics.aborts += call.aborts
        metrics.tool_calls += call.tool_calls
    termination = {"length": "max_new_tokens"}.get(calls[-1].finish_reason, "stop")
    if len(ids) > response_length:
        ids, mask = ids[:response_length], mask[:response_length]
        logprobs, versions = logprobs[:response_length], versions[:response_length]
        termination = "response_length"
    return Trajectory(
        prompt_ids=prompt,
        response_ids=ids,
        response_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=0.0,
        num_turns=2 * len(calls),  # the prompt, each reply, and the turns the client added between
        termination=termination,
        metrics=metrics,
        messages=list(calls[-1].messages),
    )
