"""What an agent-loop worker's trajectories did, counted for Prometheus (``rlasync_agent_*``):
trajectories by termination, turns, tool calls and failures by tool, and the seconds of each
engine request. ``LoopCounters.observe`` takes each finished trajectory (a few dictionary
updates); ``families`` renders them at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..metrics.timings import Timings
from .trajectory import Trajectory

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

MAX_TERMINATIONS = 32
"""Distinct termination reasons kept as label values; a loop that invents more is counted as
``other`` (labels must stay few)."""


class LoopCounters:
    """Counts of the trajectories one worker finished."""

    def __init__(self) -> None:
        self.terminations: dict[str, int] = {}
        self.turns = 0
        self.tools: dict[str, int] = {}
        self.tools_failed: dict[str, int] = {}
        self.reward_errors = 0
        self.turn_s = Timings()

    def offer(self, tools: Iterable[str]) -> None:
        """Count the offered tools' calls and failures from 0: a series that exists only after
        its first call has no rate() until its second scrape, and none at all while no call came."""
        for name in tools:
            self.tools.setdefault(name, 0)
            self.tools_failed.setdefault(name, 0)

    def observe(self, trajectory: Trajectory) -> None:
        why = trajectory.termination
        if why not in self.terminations and len(self.terminations) >= MAX_TERMINATIONS:
            why = "other"
        self.terminations[why] = self.terminations.get(why, 0) + 1
        self.turns += trajectory.num_turns
        metrics = trajectory.metrics
        for name, n in metrics.tools.items():
            self.tools[name] = self.tools.get(name, 0) + n
        for name, n in metrics.tools_failed.items():
            self.tools_failed[name] = self.tools_failed.get(name, 0) + n
        self.reward_errors += bool(metrics.reward_error)
        for seconds in metrics.turn_s:
            self.turn_s.observe(seconds)

    def families(self, worker: str) -> list[Metric]:
        """The counts as metric families, labelled ``worker`` (at a scrape: prometheus-client is
        imported only where metrics are on)."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        def by(name: str, doc: str, label: str, counts: dict[str, int]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["worker", label])
            for key, n in counts.items():
                family.add_metric([worker, key], n)
            return family

        def total(name: str, doc: str, n: int) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["worker"])
            family.add_metric([worker], n)
            return family

        turn_s = HistogramMetricFamily(
            "rlasync_agent_turn_seconds",
            "Seconds of each engine request of a model turn (a turn a weight sync cut counts per piece).",
            labels=["worker"],
        )
        turn_s.add_metric([worker], self.turn_s.buckets(), self.turn_s.sum)
        return [
            by(
                "rlasync_agent_trajectories",
                "Trajectories finished, by termination.",
                "termination",
                self.terminations,
            ),
            total("rlasync_agent_turns", "Turns of finished trajectories (verl's num_turns).", self.turns),
            by(
                "rlasync_agent_tool_calls",
                "Tool calls, by tool (malformed: calls that did not parse).",
                "tool",
                self.tools,
            ),
            by(
                "rlasync_agent_tool_failures",
                "Tool calls that failed, by tool (skipped: past agent.max_parallel_calls).",
                "tool",
                self.tools_failed,
            ),
            total("rlasync_agent_reward_errors", "Trajectories whose reward failed.", self.reward_errors),
            turn_s,
        ]


__all__ = ["MAX_TERMINATIONS", "LoopCounters"]
