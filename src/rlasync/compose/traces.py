"""Rollout traces: what the model generated at step N, readable.

Every ``train.trace_every`` steps a run writes ``train.trace_samples`` of the step's trajectories
to ``<run_dir>/traces.jsonl``, one JSON object each: the step, the conversation as text (the
prompt's messages, each model turn, each tool result or user reply), the reward, why it ended,
its turns and tool calls, and the weight versions its model tokens came from (as
``[version, tokens]`` runs: a partial rollout shows two or more). ``rlasync show RUN_DIR
[--step N]`` prints them.

    lines = trace_lines(step=20, trajectories=batch, n=2)
    print(render(lines))
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

TRACES_FILE = "traces.jsonl"


def version_runs(versions: Sequence[int], mask: Sequence[int]) -> list[list[int]]:
    """``[[version, tokens], ...]`` over the model's tokens (mask 1), in order."""
    runs: list[list[int]] = []
    for version, own in zip(versions, mask):
        if not own:
            continue
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def trace_lines(step: int, trajectories: Sequence[Any], n: int) -> list[dict[str, Any]]:
    """``n`` of ``trajectories`` (drawn with the step as the seed: the same ones on a rerun), each
    a trace line."""
    picked = random.Random(step).sample(range(len(trajectories)), min(n, len(trajectories)))
    lines = []
    for index in sorted(picked):
        t = trajectories[index]
        lines.append(
            {
                "step": step,
                "index": index,
                "reward": t.reward,
                "termination": t.termination,
                "num_turns": t.num_turns,
                "model_tokens": int(sum(t.response_mask)),
                "versions": version_runs(t.versions, t.response_mask),
                "tool_calls": t.metrics.tool_calls,
                "tool_errors": t.metrics.tool_errors,
                "reward_error": t.metrics.reward_error,
                "messages": [
                    {"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in t.messages
                ],
            }
        )
    return lines


def read_traces(run_dir: str | Path, step: int | None = None) -> list[dict[str, Any]]:
    """The trace lines of step ``step`` (None: the last step traced) in ``run_dir``."""
    path = Path(run_dir) / TRACES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the run wrote no traces (train.trace_every=0, or it stopped before the first)"
        )
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = sorted({line["step"] for line in lines})
    if not steps:
        raise FileNotFoundError(f"{path} holds no traces yet")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise KeyError(f"no traces of step {step} in {path}; traced steps: {_ranges(steps)}")
    return [line for line in lines if line["step"] == chosen]


def render(lines: Iterable[dict[str, Any]]) -> str:
    """Trace lines as text a person reads: a header per trajectory, then its turns."""
    out = []
    for line in lines:
        versions = ", ".join(f"v{v} x{n}" for v, n in line["versions"]) or "none"
        out.append(
            f"=== step {line['step']}, trajectory {line['index']}: reward {line['reward']:.3f}, "
            f"ended by {line['termination']}, {line['num_turns']} turns, {line['tool_calls']} tool calls "
            f"({line['tool_errors']} failed), {line['model_tokens']} model tokens from {versions}"
        )
        if line.get("reward_error"):
            out.append(f"    reward error: {line['reward_error']}")
        for message in line["messages"]:
            text = message["content"].rstrip("\n").replace("\n", "\n" + " " * 12)
            out.append(f"{message['role']:>10}: {text}")
        out.append("")
    return "\n".join(out)


def _ranges(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f", ... {steps[-1]}" if len(steps) > 5 else "")


__all__ = ["TRACES_FILE", "read_traces", "render", "trace_lines", "version_runs"]
