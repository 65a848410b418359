"""A run's Prometheus families on the head (``rlasync_train_*``, ``rlasync_trainer_*``,
``rlasync_weight_*``, ``rlasync_queue_*``, ``rlasync_sampler``, the head's router), and the
Prometheus targets file naming every node's ``/metrics``.

``RunMetrics.observe`` takes each step's record as the run writes it (``Run.write``): the
trainer's loss, gradient norm and learning rate, the step's times, the weight sync, the sample
queue and the staleness of what was trained. Between steps, the families repeat the last step's
values; counters and histograms add up over the run.

``write_targets`` writes the run's targets in Prometheus's ``file_sd`` format, one per node
process, to ``<run_dir>/prometheus_targets.json`` and to the run's entry in discovery,
``prometheus_targets/<run>.json`` beside the run's folder (``runs/prometheus_targets/`` for
``runs/<run>``: ``launch/monitoring/prometheus.yml`` reads every file there, as ``file_sd``
takes a wildcard in the file name only). A run rewrites both when a node joins (a rejoining node
is a new process with a new port); a node that died stays listed until its rank joins again, so
``up`` says it is down. ``remove_targets`` takes the run out of discovery when it ends, cleanly
or by Ctrl-C, before its processes stop, so a finished run is not left listed as down nodes
(Prometheus applies discovery changes up to ~5 s late: a scrape in between may still find a
process gone, ``up`` 0 for a moment, before the run's series end). A head that is killed
(SIGKILL, a lost machine) leaves its entry, and its targets show as down until the file is
deleted or a run of the same name ends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..metrics import StepRecord
from ..metrics.timings import Timings

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

TARGETS_FILE = "prometheus_targets.json"
DISCOVERY_DIR = "prometheus_targets"
"""The folder, beside a run's folder, holding one ``<run>.json`` per running run."""
# Staleness buckets always exported, 0..8 versions behind: a bucket that first appears mid-run
# would have a shorter rate() window than its neighbours, and the cumulative rates
# histogram_quantile reads would not be monotonic.
STALENESS_BUCKETS = 9

# The trainer's metrics shown as gauges, by the name the record carries (``train/<name>``).
_TRAINER_GAUGES = {
    "loss": ("rlasync_trainer_loss", "Policy loss of the last step."),
    "grad_norm": ("rlasync_trainer_grad_norm", "Gradient norm of the last step, before clipping."),
    "lr": ("rlasync_trainer_learning_rate", "Learning rate of the last step."),
    "entropy": ("rlasync_trainer_entropy", "Mean token entropy of the policy in the last step."),
}
# Step-record fields shown as gauges (the last step's value).
_STEP_GAUGES = {
    "reward": ("rlasync_train_reward", "Mean reward of the last training batch."),
    "val_accuracy": ("rlasync_train_val_accuracy", "Held-out accuracy at the last validation."),
    "trainer_idle_ratio": (
        "rlasync_trainer_idle_ratio",
        "Share of the last step the trainer waited for samples.",
    ),
    "rollouter_idle_ratio": ("rlasync_rollouter_idle_ratio", "Share of the last step generation stood idle."),
}


class RunMetrics:
    """What a run's step records say, as Prometheus families."""

    def __init__(self) -> None:
        self.last: StepRecord | None = None
        self.steps = 0
        self.tokens = 0
        self.val_accuracy: float | None = None
        self.step_s = Timings()
        self.train_s = Timings()
        self.rollout_s = Timings()
        self.sync_s = Timings()
        self.pause_s = Timings()
        self.relay_s = Timings()
        self.engine_idle_s = 0.0
        self.reprefill_tokens = 0
        self.all_paused = 0
        self.staleness: list[int] = []  # samples trained, by versions behind (index)

    def observe(self, record: StepRecord) -> None:
        self.last = record
        if record.val_accuracy is not None:
            self.val_accuracy = record.val_accuracy
        if record.step == 0:  # the starting weights' validation: no training happened
            return
        self.steps += 1
        self.tokens += record.response_tokens or 0
        for timings, value in (
            (self.step_s, record.step_s),
            (self.train_s, record.train_s),
            (self.rollout_s, record.rollout_s),
        ):
            if value is not None:
                timings.observe(value)
        if record.weights is not None:
            sync = record.weights.sync_s if record.weights.sync_s is not None else record.weights.transfer_s
            if sync is not None:
                self.sync_s.observe(sync)
            if record.weights.pause_s is not None:
                self.pause_s.observe(record.weights.pause_s)
            if record.weights.relay_s is not None:
                self.relay_s.observe(record.weights.relay_s)
            self.engine_idle_s += record.weights.engine_idle_s or 0.0
            self.reprefill_tokens += record.weights.reprefill_tokens or 0
            self.all_paused += record.weights.all_paused or 0
        if record.staleness is not None:
            hist = record.staleness.sample_hist
            self.staleness += [0] * (len(hist) - len(self.staleness))
            for behind, n in enumerate(hist):
                self.staleness[behind] += n

    def families(self) -> list[Metric]:
        """At a scrape (prometheus-client is imported only where metrics are on)."""
        from prometheus_client.core import HistogramMetricFamily

        from ..metrics.exporter import counter, gauge, gauges, histogram

        out: list[Metric] = [
            counter("rlasync_train_steps_total", "Training steps done.", self.steps),
            counter("rlasync_trainer_tokens_total", "Model tokens trained on.", self.tokens),
            histogram("rlasync_train_step_seconds", "Seconds of each step, end to end.", self.step_s),
            histogram(
                "rlasync_trainer_step_seconds", "Seconds the trainer took for each step.", self.train_s
            ),
            histogram(
                "rlasync_train_rollout_seconds",
                "Seconds each step generated (asynchronous schedules: waited for samples).",
                self.rollout_s,
            ),
            histogram("rlasync_weight_sync_seconds", "Seconds of each weight sync.", self.sync_s),
            histogram(
                "rlasync_weight_pause_seconds",
                "Seconds generation was paused for each weight sync.",
                self.pause_s,
            ),
            histogram(
                "rlasync_weight_relay_seconds",
                "Seconds the trainer took to put each version in its relay (all it waits for).",
                self.relay_s,
            ),
            counter(
                "rlasync_weight_engine_idle_seconds_total",
                "Decoding seconds the engines lost to weight versions, summed over engines.",
                self.engine_idle_s,
            ),
            counter(
                "rlasync_weight_reprefill_tokens_total",
                "Tokens of turns cut by weight versions, prefilled again.",
                self.reprefill_tokens,
            ),
            counter(
                "rlasync_weight_all_paused_total",
                "Weight versions for which every engine was paused at one instant.",
                self.all_paused,
            ),
        ]
        staleness = HistogramMetricFamily(
            "rlasync_sample_staleness",
            "Samples trained, by how many weight versions their oldest token lagged the trainer.",
        )
        # One bucket per whole number of versions, so bucket ``le=k`` holds exactly the samples
        # ``k`` behind and ceil(histogram_quantile(...)) is the exact quantile (the dashboard's).
        counts = self.staleness + [0] * (STALENESS_BUCKETS - len(self.staleness))
        cumulative, total = [], 0
        for behind, n in enumerate(counts):
            total += n
            cumulative.append((repr(float(behind)), float(total)))
        staleness.add_metric(
            [], [*cumulative, ("+Inf", float(total))], sum(i * n for i, n in enumerate(self.staleness))
        )
        out.append(staleness)
        record = self.last
        if record is None:
            return out
        out.append(gauge("rlasync_train_step", "The last step written.", record.step))
        version = record.queue.version if record.queue is not None else record.step
        out.append(gauge("rlasync_weight_version", "Weight version the trainer last published.", version))
        served = record.queue.served_version if record.queue is not None else None
        out.append(
            gauge(
                "rlasync_weight_served_version",
                "The oldest weight version the engines serve (admissions count from it).",
                version if served is None else served,  # the schedules that wait for every engine
            )
        )
        weights = record.weights
        if weights is not None and weights.live_versions is not None:
            out.append(
                gauge(
                    "rlasync_weight_live_versions",
                    "Distinct versions the engines serve.",
                    weights.live_versions,
                )
            )
        if weights is not None and weights.engines_behind is not None:
            out.append(
                gauge(
                    "rlasync_weight_engines_behind",
                    "Engines serving an older version than the last one published.",
                    weights.engines_behind,
                )
            )
        for key, (name, doc) in _TRAINER_GAUGES.items():
            if key in record.train:
                out.append(gauge(name, doc, record.train[key]))
        values = {"val_accuracy": self.val_accuracy, "reward": record.reward}
        for key, (name, doc) in _STEP_GAUGES.items():
            value = values.get(key, getattr(record, key))
            if value is not None:
                out.append(gauge(name, doc, value))
        if record.sampler:
            out.append(
                gauges(
                    "rlasync_sampler",
                    "What the data sampler knows after the last step (sampler/<stat> in metrics.jsonl).",
                    "stat",
                    record.sampler,
                )
            )
        if record.queue is not None:
            q = record.queue
            out += [
                counter("rlasync_queue_admitted_total", "Samples admitted to generation.", q.admitted),
                counter("rlasync_queue_consumed_total", "Samples the trainer took.", q.consumed),
                gauge("rlasync_queue_ready", "Samples generated and waiting for the trainer.", q.ready),
                gauge("rlasync_queue_in_flight", "Samples being generated.", q.in_flight),
                gauge("rlasync_queue_capacity", "Samples the queue holds at most.", q.capacity),
            ]
        if record.stamp is not None:
            s = record.stamp
            out += [
                gauge("rlasync_cluster_engines", "Engines in rotation.", s.engines),
                counter(
                    "rlasync_rows_retried_total",
                    "Rows rolled out again after their worker was lost.",
                    s.rows_retried,
                ),
                counter(
                    "rlasync_node_rejoins_total",
                    "Lost nodes that joined again and got their roles back.",
                    s.rejoins,
                ),
                counter("rlasync_reward_errors_total", "Trajectories whose reward failed.", s.reward_errors),
            ]
        return out


def write_targets(run_dir: Path, members: Iterable[Any]) -> Path:
    """Every member (a ``NodeInfo``) with ``/metrics`` as a ``file_sd`` target, labelled with the
    run's folder name (``run``; the samples carry their own ``node`` and ``role``), into
    ``<run_dir>/prometheus_targets.json`` and the run's discovery entry (``discovery_file``).
    Each is written whole, then renamed: Prometheus never reads half a file. Returns the first."""
    run = run_dir.resolve().name
    groups = [
        {"targets": [m.metrics], "labels": {"run": run}}
        for m in sorted(members, key=lambda m: m.node_id)
        if m.metrics
    ]
    text = json.dumps(groups, indent=1) + "\n"
    entry = discovery_file(run_dir)
    entry.parent.mkdir(exist_ok=True)
    for path in (run_dir / TARGETS_FILE, entry):
        # The temporary name does not end in .json: discovery's glob never matches it.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return run_dir / TARGETS_FILE


def discovery_file(run_dir: Path) -> Path:
    """``<run_dir>/../prometheus_targets/<run>.json``: the run's entry in discovery, listed
    while the run runs."""
    run_dir = run_dir.resolve()
    return run_dir.parent / DISCOVERY_DIR / f"{run_dir.name}.json"


def remove_targets(run_dir: Path) -> None:
    """Take the run out of discovery: Prometheus stops scraping its nodes (its series end)
    instead of finding them down. ``<run_dir>/prometheus_targets.json`` stays, as a record."""
    discovery_file(run_dir).unlink(missing_ok=True)


__all__ = [
    "DISCOVERY_DIR",
    "TARGETS_FILE",
    "RunMetrics",
    "discovery_file",
    "remove_targets",
    "write_targets",
]
