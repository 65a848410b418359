"""What a run writes of itself: ``metrics.jsonl`` (a line a step, ``StepRecord`` flat), the
step's rollout traces (``traces.jsonl``, ``train.trace_every``), the trackers beside them
(``train.trackers``), the summary (``summary.json``), and the run's families on the head's
``/metrics`` with the Prometheus targets file naming every node's."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import Config, ConfigError
from ..metrics import Rollouts, StepRecord
from ..metrics.trackers import Tracker, TrackerUnavailable, open_trackers
from .result import TrainResult
from .traces import TRACES_FILE, trace_lines

if TYPE_CHECKING:
    from .telemetry import RunMetrics

OnStep = (
    Callable[[dict[str, Any]], None] | None
)  # a schedule's ``on_step``: each line of metrics.jsonl as it is written


def open_metrics(path: Path, *, upto: int | None) -> Any:
    """``metrics.jsonl`` (or ``traces.jsonl``) for writing: fresh, or (resuming) its lines up to
    step ``upto`` kept."""
    if upto is None or not path.is_file():
        return path.open("w")
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= upto
    ]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def write_record(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


class Recorder:
    """The run's records, from ``open`` (``export``: the head's ``/metrics``, as soon as the
    head is up) until the run's closers close them. Between two records it gathers what the next
    says of the rollouts trained on (``trained``, ``sampled``)."""

    metrics: Any  # the open metrics.jsonl

    def __init__(self, config: Config) -> None:
        self.config = config
        self.run_dir = Path(config.train.run_dir)
        self.trackers: list[Tracker] = []  # train.trackers beside metrics.jsonl, opened by ``open``
        self.traces: Any = None  # the open traces.jsonl (train.trace_every)
        self._traceable: list[Any] = []  # the last training batch's trajectories
        self._trained: list[Any] = []  # every trajectory trained on since the last record (rollout/*)
        self._penalties: list[float] = []  # their overlong penalties (train.overlong_buffer)
        self._sampling: dict[str, int] = {}  # the last step's dynamic sampling (train.dynamic_sampling)
        self.telemetry: RunMetrics | None = None  # the run's /metrics families (runtime.metrics_port)
        self._unlist_targets: Callable[[], None] | None = None  # the run out of Prometheus's discovery

    async def open(self, closers: list[Callable[[], Any]], *, resumed_at: int | None) -> None:
        """``metrics.jsonl``, ``traces.jsonl`` and the trackers, each registered in ``closers``;
        ``resumed_at``: the step a resumed run goes on from (its lines after it are dropped)."""
        self.metrics = open_metrics(self.run_dir / "metrics.jsonl", upto=resumed_at)
        closers.append(self.metrics.close)
        if self.config.train.trace_every:
            self.traces = open_metrics(self.run_dir / TRACES_FILE, upto=resumed_at)
            closers.append(self.traces.close)
        # In a thread: W&B starts a service process (seconds the nodes' heartbeats cannot spare).
        await asyncio.to_thread(self._open_trackers, closers, resumed_at=resumed_at)

    def _open_trackers(self, closers: list[Callable[[], Any]], *, resumed_at: int | None) -> None:
        """``train.trackers`` (``metrics.jsonl`` is written here, whatever the list says)."""
        cfg = self.config.train
        try:
            self.trackers = open_trackers(
                cfg.trackers,
                self.run_dir,
                msgspec.to_builtins(self.config),
                project=cfg.wandb_project,
                resumed_at=resumed_at,
            )
        except TrackerUnavailable as exc:
            raise ConfigError(str(exc)) from None
        for tracker in self.trackers:  # closed in a thread too: W&B flushes for seconds
            closers.append(functools.partial(asyncio.to_thread, tracker.close))

    async def export(self, head: Any, router: Callable[[], Any], closers: list[Callable[[], Any]]) -> None:
        """The run's families on the head's ``/metrics`` (``compose.telemetry``) with the
        router's (``router()``), and the targets file naming every node's, rewritten as nodes
        join."""
        from ..engines.telemetry import router_families
        from .telemetry import RunMetrics, remove_targets, write_targets

        telemetry = self.telemetry = RunMetrics()

        def families() -> list[Any]:
            serving = router()  # None until the engines have started
            return telemetry.families() + (router_families("head", serving.stats()) if serving else [])

        closers.append(head.metrics.add(families))
        targets = {m.node_id: m for m in await head.members()}
        write_targets(self.run_dir, targets.values())

        def joined(info: Any) -> None:
            targets[info.node_id] = info
            write_targets(self.run_dir, targets.values())

        def unlist() -> None:
            head.join_listeners.remove(joined)  # first: a node joining now must not list the run again
            remove_targets(self.run_dir)

        head.join_listeners.append(joined)
        self._unlist_targets = unlist

    def unlist(self) -> None:
        """The run out of Prometheus's discovery (once): a scrape of a process already stopped
        would count it down."""
        if self._unlist_targets is not None:
            self._unlist_targets()
            self._unlist_targets = None

    def trained(self, trajectories: list[Any], penalties: list[float]) -> None:
        """A training batch of these trajectories (``penalties``: their overlong penalties): in
        the next record (``rollout/*``), and the step's traces."""
        self._traceable = trajectories  # the step's, for traces.jsonl (``write``)
        self._trained += trajectories
        self._penalties += penalties

    def sampled(self, stats: dict[str, int]) -> None:
        """The dynamic sampling (``with_signal``) of the batch this step trains: in its record."""
        self._sampling = stats

    def write(self, record: StepRecord, on_step: OnStep = None) -> None:
        """One line of ``metrics.jsonl`` (flat), the trackers' too, the step's traces when due;
        then handed to ``on_step`` (progress lines, tests)."""
        if record.rollouts is None and self._trained:
            penalty = sum(self._penalties) / len(self._penalties) if self._penalties else None
            record.rollouts = Rollouts.of(self._trained, overlong_penalty=penalty, **self._sampling)
        self._trained, self._penalties, self._sampling = [], [], {}
        if self.telemetry is not None:
            self.telemetry.observe(record)
        line = record.as_dict()
        write_record(self.metrics, line)
        for tracker in self.trackers:
            tracker.log(line)
        every = self.config.train.trace_every
        if self.traces is not None and self._traceable and every and record.step % every == 0:
            for trace in trace_lines(record.step, self._traceable, self.config.train.trace_samples):
                write_record(self.traces, trace)
            self._traceable = []
        if on_step is not None:
            on_step(line)

    def finish(self, result: TrainResult) -> None:
        """The run's result as its summary: ``<run_dir>/summary.json`` and every tracker's."""
        summary = msgspec.to_builtins(result)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        for tracker in self.trackers:
            tracker.finish(summary)
