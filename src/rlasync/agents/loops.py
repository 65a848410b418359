"""The built-in loops: ``single_turn`` and ``tool`` (multi-turn with tool calls and a simulated user).

``ToolAgentLoop`` is an explicit state machine::

    PENDING -> GENERATING -> PROCESSING_TOOLS -> GENERATING -> ... -> TERMINATED
                          -> INTERACTING      -> GENERATING

Its whole state is a ``LoopState`` (a msgspec Struct), updated as tokens arrive. Cancel the
task running ``run`` at any point (mid-generation, mid-tool-call) and call ``run`` again
later: it resumes from the state. A turn cut mid-generation continues from its partial
tokens with the same seed; on the torch engine, whose seeded sampling is keyed by token
position, the result is the trajectory an uninterrupted run would have produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from ..engines.protocol import EngineError, EngineLostError
from ..engines.types import GenerateRequest, SamplingParams
from ..runtime import ActorError
from ..tools.base import ToolCall
from ..tools.parsers import MAX_NAME_CHARS, clean_text
from .base import AgentLoop, LoopReuseError, register
from .trajectory import Trajectory, TrajectoryMetrics

MAX_ENGINE_ABORTS = 64  # a turn the engine keeps aborting (it is paused again and again) gives up
PARSE_INLINE_CHARS = 65536  # a model turn longer than this is parsed in a thread, off the event loop


class LoopState(msgspec.Struct, kw_only=True):
    """Everything a trajectory in progress is: enough to resume it anywhere."""

    state: str = "PENDING"  # PENDING, GENERATING, PROCESSING_TOOLS, INTERACTING, TERMINATED
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    response_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    messages: list[dict[str, Any]] = []
    assistant_turns: int = 0
    user_turns: int = 0
    # The model turn being generated: its tokens so far (kept across interruptions).
    partial_ids: list[int] = []
    partial_logprobs: list[float] = []
    partial_versions: list[int] = []
    # The tool calls of the last model turn, until their responses are appended.
    pending_calls: list[ToolCall] = []
    pending_errors: list[str] = []
    pending_dropped: int = 0  # calls past the parser's per-turn cap: counted, never read
    termination: str = ""
    turn_scores: list[float] = []
    metrics: TrajectoryMetrics = msgspec.field(default_factory=TrajectoryMetrics)


def _preview(messages: list[dict[str, Any]]) -> str:
    text = str(messages[-1].get("content", "")) if messages else ""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def turn_seed(seed: int | None, trajectory_id: str, turn: int) -> int | None:
    """The seed of one model turn: the run's seed, the trajectory and the turn all matter
    (one seed for every trajectory would draw the same random numbers for all of them)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{trajectory_id}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class ResumableLoop(AgentLoop):
    """A loop whose whole state is a ``LoopState``: cancelled and run again it goes on, and a
    state saved in a checkpoint goes on in another process (``resume_from``). The built-in
    loops are; subclass it (``run`` inside ``with self._trajectory(row) as s:``) for yours to be."""

    state: LoopState
    _prompt: list[dict[str, Any]]  # the messages of the row this loop's trajectory started from
    _running = False

    @contextlib.contextmanager
    def _trajectory(self, row: dict[str, Any]) -> Iterator[LoopState]:
        """The state of ``run``'s trajectory: started from ``row``, or resumed (``run`` again with
        the same row, after a cancellation). A loop object holds one trajectory: a second
        concurrent ``run``, or one with another row, raises ``LoopReuseError`` instead of
        returning the first trajectory as if it were the second's."""
        name = f"{type(self).__name__} {self.trajectory_id!r}"
        if self._running:
            raise LoopReuseError(
                f"{name} is already running a trajectory: one loop object rolls out one trajectory; make a loop per trajectory"
            )
        if not hasattr(self, "state") or self.state.state == "PENDING":
            self._start(row)
        elif list(row.get("messages") or []) != self._prompt:
            raise LoopReuseError(
                f"{name} rolled out the trajectory of another row ({_preview(self._prompt)}): one loop object rolls out one "
                "trajectory (`run` again with the same row resumes it); make a loop per trajectory"
            )
        elif self.state.state != "TERMINATED":
            self.state.metrics.interrupts += 1  # resumed: the state says where
        self._running = True
        try:
            yield self.state
        finally:
            self._running = False

    def resume_from(self, state: LoopState, row: dict[str, Any]) -> None:
        """Take over a trajectory saved elsewhere (a checkpoint's ``LoopState`` of ``row``):
        ``run`` with the same row then goes on from it, as after a cancellation. A turn cut
        mid-generation continues from its tokens; a state saved during tool calls runs them
        again; a finished one is scored again."""
        if self._running:
            raise LoopReuseError(
                f"{type(self).__name__} {self.trajectory_id!r} is running: resume a trajectory in a fresh loop"
            )
        self._prompt = [dict(m) for m in row.get("messages") or []]
        self.state = state

    def _start(self, row: dict[str, Any]) -> None:
        messages = list(row.get("messages") or [])
        if not messages:
            raise ValueError("a dataset row for an agent loop needs `messages` (the prompt as chat messages)")
        schemas = [tool.schema() for tool in self.tools.values()] or row.get("tools")
        self._prompt = [dict(m) for m in messages]
        self.state = LoopState(
            state="GENERATING", prompt_ids=self.turns.prompt_ids(messages, schemas), messages=messages
        )

    def _budget(self) -> int:
        s = self.state
        return self.config.response_length - len(s.response_ids) - len(s.partial_ids)

    async def _generate_turn(self, params: SamplingParams) -> str | None:
        """GENERATING: stream one model turn into the state; its finish reason (None if the
        engine kept aborting it)."""
        s = self.state
        while True:
            # The turn's own limit counts the tokens it already has (from before an interruption).
            budget = min(self._budget(), params.max_new_tokens - len(s.partial_ids))
            if budget <= 0:
                return "length"
            seed = turn_seed(params.seed, self.trajectory_id, s.assistant_turns)
            turn_params = msgspec.structs.replace(params, max_new_tokens=budget, seed=seed)
            request = GenerateRequest(
                # Unique per attempt: a resumed turn must not reuse the id of a request the engine
                # may not have finished aborting yet.
                request_id=f"{self.trajectory_id}.{s.assistant_turns}.{len(s.partial_ids)}.{s.metrics.aborts}-{s.metrics.interrupts}",
                prompt_ids=s.prompt_ids + s.response_ids + s.partial_ids,
                params=turn_params,
            )
            started = time.perf_counter()
            finish = None
            try:
                async for chunk in self._generate(request):
                    s.partial_ids += chunk.token_ids
                    s.partial_logprobs += chunk.logprobs
                    s.partial_versions += chunk.versions
                    finish = chunk.finish_reason
            except EngineLostError:  # its engine died mid-turn: go on from the partial turn elsewhere
                finish = "abort"
            except (
                EngineError,
                ActorError,
            ) as exc:  # this request failed: the trajectory ends, the batch goes on
                s.metrics.error = f"{type(exc).__name__}: {exc}"
                return "error"
            finally:
                took = time.perf_counter() - started
                s.metrics.generation_s += took
                s.metrics.turn_s.append(took)
            if finish != "abort":
                return finish
            # The engine ended the turn (a pause for a weight update) or died: go on from its partial.
            s.metrics.aborts += 1
            if s.metrics.aborts >= MAX_ENGINE_ABORTS:
                return None

    def _close_turn(self) -> str:
        """Move the finished model turn into the response; its text."""
        s = self.state
        s.response_ids += s.partial_ids
        s.response_mask += [1] * len(s.partial_ids)
        s.logprobs += s.partial_logprobs
        s.versions += s.partial_versions
        text: str = self.tokenizer.decode(s.partial_ids, skip_special_tokens=False)
        text = text.removesuffix(self.turns.turn_end)
        s.partial_ids, s.partial_logprobs, s.partial_versions = [], [], []
        s.assistant_turns += 1
        s.messages.append({"role": "assistant", "content": text})
        return text

    def _append_environment(self, messages: list[dict[str, Any]], ids: list[int] | None = None) -> bool:
        """Append tool/user turns (mask 0; ``ids``, else the chat template's rendering of
        ``messages``); False if they do not fit the token budget."""
        s = self.state
        ids = self.turns.after_model_turn(messages) if ids is None else ids
        if len(s.response_ids) + len(ids) >= self.config.response_length:
            return False
        s.response_ids += ids
        s.response_mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)
        s.versions += [-1] * len(ids)
        s.messages += messages
        s.user_turns += 1
        return True

    def trajectory(self, *, handover: bool = False) -> Trajectory:
        """The trajectory as the state holds it: its finished turns (not a turn being
        generated), its termination so far, reward 0. A copy, unless ``handover`` (the loop has
        ended and its state never grows again): then the state's own token lists. Those were
        made when the loop started and have long left the garbage collector's young
        generations; copies made at the end land there together, and a burst of trajectories
        finishing at once leaves a young collection ~1 M list elements to walk (20-90 ms of a
        held loop at 512 simulated GPUs)."""
        s = self.state
        own: Any = (lambda tokens: tokens) if handover else list
        return Trajectory(
            prompt_ids=own(s.prompt_ids),
            response_ids=own(s.response_ids),
            response_mask=own(s.response_mask),
            logprobs=own(s.logprobs),
            versions=own(s.versions),
            reward=0.0,
            num_turns=s.assistant_turns + s.user_turns + 1,
            termination=s.termination,
            metrics=s.metrics,
            messages=list(s.messages),
            extra={"turn_scores": list(s.turn_scores)},
        )

    async def _finish(self, row: dict[str, Any]) -> Trajectory:
        self.state.state = "TERMINATED"
        trajectory = self.trajectory(handover=True)
        trajectory.reward = await self._reward(row, trajectory)
        return trajectory


@register("single_turn")
class SingleTurnAgentLoop(ResumableLoop):
    """One model turn for the prompt."""

    async def run(self, params: SamplingParams, **row: Any) -> Trajectory:
        with self._trajectory(row) as s:
            if s.state == "GENERATING":
                finish = await self._generate_turn(params)
                self._close_turn()
                if finish is None:
                    s.termination = "aborted"
                elif finish == "error":
                    s.termination = "error"
                elif finish == "length":
                    s.termination = "response_length" if self._budget() <= 0 else "max_new_tokens"
                else:
                    s.termination = "stop"
            return await self._finish(row)


@register("tool")
class ToolAgentLoop(ResumableLoop):
    """Model turns and tool calls, until the model answers without calling a tool (or a budget
    ends it). Knobs: ``AgentConfig`` (``agent.*``)."""

    async def run(self, params: SamplingParams, **row: Any) -> Trajectory:
        from ..tools import get_parser

        parser = get_parser(self.config.tool_parser)
        with self._trajectory(row) as s:
            return await self._run(s, parser, params, row)

    async def _run(
        self, s: LoopState, parser: Any, params: SamplingParams, row: dict[str, Any]
    ) -> Trajectory:
        cfg = self.config
        while s.state != "TERMINATED":
            if s.state == "GENERATING":
                finish = await self._generate_turn(params)
                text = self._close_turn()
                if finish is None:
                    s.termination = "aborted"
                elif finish == "error":
                    s.termination = "error"
                elif finish == "length":  # cut by the token budget, or by params.max_new_tokens
                    s.termination = "response_length" if self._budget() <= 0 else "max_new_tokens"
                elif cfg.max_assistant_turns and s.assistant_turns >= cfg.max_assistant_turns:
                    s.termination = "max_assistant_turns"
                else:
                    # Parsing is linear, but a long turn is parsed off the event loop's thread.
                    parsed = (
                        await asyncio.to_thread(parser.parse, text)
                        if len(text) > PARSE_INLINE_CHARS
                        else parser.parse(text)
                    )
                    if parsed.calls or parsed.errors or parsed.dropped:
                        s.pending_calls, s.pending_errors, s.pending_dropped = (
                            list(parsed.calls),
                            list(parsed.errors),
                            parsed.dropped,
                        )
                        s.state = "PROCESSING_TOOLS"
                        continue
                    if self.interaction is not None:
                        s.state = "INTERACTING"
                        continue
                    s.termination = "stop"
                break
            elif s.state == "PROCESSING_TOOLS":
                if cfg.max_user_turns and s.user_turns >= cfg.max_user_turns:
                    s.termination = "max_user_turns"
                    break
                messages, ids = await self._run_tools(parser, row.get("tools_kwargs") or {})
                s.pending_calls, s.pending_errors, s.pending_dropped = [], [], 0
                if not self._append_environment(messages, ids):
                    s.termination = "response_length"
                    break
                s.state = "GENERATING"
            elif s.state == "INTERACTING":
                if cfg.max_user_turns and s.user_turns >= cfg.max_user_turns:
                    s.termination = "max_user_turns"
                    break
                assert self.interaction is not None
                done, reply, score = await self.interaction.respond(list(s.messages), row)
                s.turn_scores.append(score)
                if done:
                    s.termination = "interaction"
                    break
                if not self._append_environment([{"role": "user", "content": clean_text(str(reply))}]):
                    s.termination = "response_length"
                    break
                s.state = "GENERATING"
        return await self._finish(row)

    async def _run_tools(
        self, parser: Any, tools_kwargs: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[int]]:
        """PROCESSING_TOOLS: run the pending calls (at most ``max_parallel_calls``, together);
        every failure becomes a message the model reads. The ids of the environment's turn.
        ``tools_kwargs``: the row's, by tool name (each call's context carries its tool's).

        However the model misbehaves, the turn stays small: at most ``max_parallel_calls`` call
        results and as many parse errors, then one line counting the rest, each message cut to
        ``max_tool_response_length``; every text in it is tokenised as plain text."""
        from ..tools import HarmonyParser, ToolContext, error_result, run_tool_call, truncate_text

        s = self.state
        cfg = self.config
        calls = s.pending_calls[: cfg.max_parallel_calls]
        context = ToolContext(trajectory_id=self.trajectory_id, turn=s.assistant_turns)
        started = time.perf_counter()
        try:
            results = list(
                await asyncio.gather(
                    *[
                        run_tool_call(
                            self.tools,
                            call,
                            dataclasses.replace(context, tool_kwargs=tools_kwargs.get(call.name) or {}),
                            max_response_chars=cfg.max_tool_response_length,
                            truncate_side=cfg.tool_response_truncate_side,
                        )
                        for call in calls
                    ]
                )
            )
        finally:
            s.metrics.tool_s += time.perf_counter() - started
        failed = sum(1 for r in results if not r.ok)
        shown = s.pending_errors[: cfg.max_parallel_calls]
        results += [error_result("parse_error", message) for message in shown]
        skipped = len(s.pending_calls) - len(calls)
        unanswered = len(s.pending_errors) - len(shown) + s.pending_dropped
        if skipped or unanswered:
            results.append(error_result("parse_error", _not_run(cfg.max_parallel_calls, skipped, unanswered)))
        for r in results:  # environment text: valid, bounded, and named within bounds
            r.text = truncate_text(
                clean_text(r.text), cfg.max_tool_response_length, cfg.tool_response_truncate_side
            )[0]
            r.name = clean_text(r.name[:MAX_NAME_CHARS])
        s.metrics.tool_calls += len(calls)
        s.metrics.tool_errors += failed + len(s.pending_errors) + s.pending_dropped + skipped
        for call, result in zip(calls, results):  # by tool, named only if offered (bounded labels)
            name = call.name if call.name in self.tools else "unknown"
            _count(s.metrics.tools, name)
            if not result.ok:
                _count(s.metrics.tools_failed, name)
        if malformed := len(s.pending_errors) + s.pending_dropped:
            _count(s.metrics.tools, "malformed", malformed)
            _count(s.metrics.tools_failed, "malformed", malformed)
        if skipped:
            _count(s.metrics.tools_failed, "skipped", skipped)
        messages = parser.format_responses(results)
        if isinstance(parser, HarmonyParser):  # chat templates do not know harmony: its own text
            return messages, self.turns.encode_pieces(parser.response_pieces(results))
        return messages, self.turns.after_model_turn(messages)


def _count(counts: dict[str, int], name: str, n: int = 1) -> None:
    counts[name] = counts.get(name, 0) + n


def _not_run(limit: int, skipped: int, unanswered: int) -> str:
    """The one message for the calls of a turn that were neither run nor answered."""
    said = []
    if skipped:
        said.append(f"only {limit} tool call(s) per turn are run; {skipped} were skipped")
    if unanswered:
        said.append(f"{unanswered} more malformed or excess call(s) were not read")
    return "; ".join(said)
