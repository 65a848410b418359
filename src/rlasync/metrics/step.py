"""A training step's record: one line of ``metrics.jsonl``, typed.

``StepRecord`` holds what every schedule writes (a field left ``None`` is not written); its
groups (``Weights``, ``Staleness``, ``Processing``, ``QueueStats``, ``Stamp``) are structs of
their own, and ``train`` is the trainer's metrics by name. ``as_dict`` renders the flat record
that is written, under the names tests, benchmarks and plots read (``train/loss``,
``weights/pause_s``, ``async/staleness_max``, ``data/rows``...); ``from_dict`` reads one back.

    >>> record = StepRecord(step=3, reward=0.5, train={"loss": 0.1}, weights=Weights(pause_s=0.2))
    >>> record.as_dict()
    {'step': 3, 'reward': 0.5, 'train/loss': 0.1, 'weights/pause_s': 0.2}
    >>> StepRecord.from_dict(record.as_dict()) == record
    True
"""

from __future__ import annotations

import collections
import itertools
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Self

import msgspec


class Flat(msgspec.Struct, kw_only=True):
    """Fields that are keys of one flat record, under the names written (``msgspec.field(name=
    ...)``); a field left ``None`` is not written. A field that is itself ``Flat`` adds its own
    keys; a mapping field whose name ends in ``/`` adds its entries under that prefix."""

    def as_dict(self) -> dict[str, Any]:
        """The flat record, in field order."""
        out: dict[str, Any] = {}
        for field in msgspec.structs.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, Flat):
                out.update(value.as_dict())
            elif field.encode_name.endswith("/"):
                out.update({field.encode_name + key: item for key, item in value.items()})
            else:
                out[field.encode_name] = value
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Self:
        """A flat record read back (e.g. a line of ``metrics.jsonl``), its values checked against
        the fields' types; keys that are no field's are left out."""
        return msgspec.convert(cls._nested(record), cls)

    @classmethod
    def _nested(cls, record: Mapping[str, Any]) -> dict[str, Any]:
        nested: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            name, group = field.encode_name, _group(field.type)
            if group is not None:
                if inner := group._nested(record):
                    nested[name] = inner
            elif name.endswith("/"):
                if inner := {key[len(name) :]: v for key, v in record.items() if key.startswith(name)}:
                    nested[name] = inner
            elif name in record:
                nested[name] = record[name]
        return nested


def _group(kind: Any) -> type[Flat] | None:
    """The ``Flat`` struct a field of type ``kind`` (``Group`` or ``Group | None``) holds."""
    for option in typing.get_args(kind) or (kind,):
        if isinstance(option, type) and issubclass(option, Flat):
            return option
    return None


class Weights(Flat, kw_only=True):
    """A weight sync's seconds: the transfer, and how long generation was paused for it (the
    fully asynchronous schedule reports the sync, the longest swap and its own wait, and what
    the version cost the engines)."""

    transfer_s: float | None = msgspec.field(default=None, name="weights/transfer_s")
    sync_s: float | None = msgspec.field(default=None, name="weights/sync_s")
    swap_s: float | None = msgspec.field(default=None, name="weights/swap_s")
    pause_s: float | None = msgspec.field(default=None, name="weights/pause_s")
    relay_s: float | None = msgspec.field(default=None, name="weights/relay_s")
    """Seconds the trainer took to put the version in its relay, after which it trains on
    (engines pull the version while they decode: ``weights.max_live_versions`` >= 2)."""
    engine_idle_s: float | None = msgspec.field(default=None, name="weights/engine_idle_s")
    """Decoding time the engines lost to the version, summed over them."""
    reprefill_tokens: int | None = msgspec.field(default=None, name="weights/reprefill_tokens")
    """Tokens of the turns the version cut, which the engines must prefill again."""
    all_paused: int | None = msgspec.field(default=None, name="weights/all_paused")
    """1 if every engine was paused at one instant for this version (``commit=together`` always is)."""
    live_versions: int | None = msgspec.field(default=None, name="weights/live_versions")
    """Distinct versions the engines in rotation serve once the sync returns."""
    engines_behind: int | None = msgspec.field(default=None, name="weights/engines_behind")
    """Engines in rotation still serving an older version once the sync returns."""


class Staleness(Flat, kw_only=True):
    """How old the trained data was: per model token and per sample (the step's version minus
    the oldest version of its tokens), as histograms (index = versions behind), plus the samples
    whose tokens span several versions (partial rollouts) and the widest span."""

    token_hist: list[int] = msgspec.field(name="async/staleness_token_hist")
    sample_hist: list[int] = msgspec.field(name="async/staleness_sample_hist")
    token_mean: float = msgspec.field(name="async/staleness_token_mean")
    max: int = msgspec.field(name="async/staleness_max")
    partial_samples: int = msgspec.field(name="async/partial_samples")
    partial_span_max: int = msgspec.field(name="async/partial_span_max")

    @classmethod
    def of(cls, samples: Sequence[Sequence[Any]], version: int) -> Staleness:
        """Of ``samples`` (groups of trajectories: ``versions`` and ``response_mask`` per token)
        trained at ``version``."""
        token_hist: collections.Counter[int] = collections.Counter()
        sample_hist: dict[int, int] = {}
        partial, widest = 0, 0
        for sample in samples:
            # Its model tokens' versions, counted in C (compress, Counter): a step at scale holds
            # millions of tokens, and a Python pass over each held the loop for seconds.
            versions = collections.Counter(
                itertools.chain.from_iterable(itertools.compress(t.versions, t.response_mask) for t in sample)
            )
            if not versions:
                continue
            for v, count in versions.items():
                token_hist[version - v] += count
            oldest = version - min(versions)
            sample_hist[oldest] = sample_hist.get(oldest, 0) + 1
            span = max(versions) - min(versions)
            partial += span > 0
            widest = max(widest, span)

        def dense(hist: dict[int, int]) -> list[int]:
            return [hist.get(i, 0) for i in range(max(hist, default=-1) + 1)]

        total = sum(token_hist.values()) or 1
        return cls(
            token_hist=dense(token_hist),
            sample_hist=dense(sample_hist),
            token_mean=sum(k * n for k, n in token_hist.items()) / total,
            max=max(sample_hist, default=0),
            partial_samples=partial,
            partial_span_max=widest,
        )


class Processing(Flat, kw_only=True):
    """Seconds from admission to finish of a step's samples: percentiles (verl's
    ``processing_time``)."""

    mean: float = msgspec.field(name="async/processing_s_mean")
    p50: float = msgspec.field(name="async/processing_s_p50")
    p95: float = msgspec.field(name="async/processing_s_p95")
    p99: float = msgspec.field(name="async/processing_s_p99")
    max: float = msgspec.field(name="async/processing_s_max")

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Processing | None:
        """Of these durations; None for none."""
        times = sorted(seconds)
        if not times:
            return None

        def pct(q: float) -> float:
            return times[min(len(times) - 1, int(q * len(times)))]

        return cls(mean=sum(times) / len(times), p50=pct(0.5), p95=pct(0.95), p99=pct(0.99), max=times[-1])


class Rollouts(Flat, kw_only=True):
    """What the step's trajectories did (verl's agent-loop metrics, per step): turns (the prompt,
    model turns and tool/user turns, verl's count), tool calls and failed ones, model turns cut
    by a weight sync and resumed, and the share of trajectories that ended each way."""

    turns_mean: float = msgspec.field(name="rollout/turns_mean")
    turns_max: int = msgspec.field(name="rollout/turns_max")
    tool_calls_mean: float = msgspec.field(name="rollout/tool_calls_mean")
    tool_errors_mean: float = msgspec.field(name="rollout/tool_errors_mean")
    aborts: int = msgspec.field(name="rollout/aborts")
    termination: dict[str, float] = msgspec.field(name="rollout/termination/")
    """Share of the step's trajectories per ``Trajectory.termination`` (``stop``, ``interaction``...)."""
    overlong_penalty: float | None = msgspec.field(default=None, name="rollout/overlong_penalty")
    """Mean reward taken from the step's responses for their length (``train.overlong_buffer``)."""
    gen_batches: int | None = msgspec.field(default=None, name="rollout/gen_batches")
    """Rollout rounds the step made (``train.dynamic_sampling``)."""
    dropped_groups: int | None = msgspec.field(default=None, name="rollout/dropped_groups")
    """Groups rolled out and not trained on: all rewards equal, or past ``prompts_per_step``."""

    @classmethod
    def of(cls, trajectories: Sequence[Any], **extra: Any) -> Rollouts | None:
        """Of these trajectories (``num_turns``, ``termination``, ``metrics``) and the ``extra``
        fields given; None for none."""
        n = len(trajectories)
        if not n:
            return None
        ends: dict[str, float] = {}
        for t in trajectories:
            ends[t.termination] = ends.get(t.termination, 0.0) + 1.0 / n
        return cls(
            turns_mean=sum(t.num_turns for t in trajectories) / n,
            turns_max=max(t.num_turns for t in trajectories),
            tool_calls_mean=sum(t.metrics.tool_calls for t in trajectories) / n,
            tool_errors_mean=sum(t.metrics.tool_errors for t in trajectories) / n,
            aborts=sum(t.metrics.aborts for t in trajectories),
            termination={k: round(v, 6) for k, v in sorted(ends.items())},
            **extra,
        )


class QueueStats(Flat, kw_only=True):
    """The fully asynchronous schedule's sample queue after a step (``SampleQueue.stats``)."""

    capacity: int = msgspec.field(name="async/queue_capacity")
    ready: int = msgspec.field(name="async/queue_ready")
    in_flight: int = msgspec.field(name="async/in_flight")
    admitted: int = msgspec.field(name="async/admitted")
    consumed: int = msgspec.field(name="async/consumed")
    version: int = msgspec.field(name="async/version")
    served_version: int | None = msgspec.field(default=None, name="async/served_version")
    """The oldest version the engines serve (below ``async/version`` while they pull it)."""


class Stamp(Flat, kw_only=True):
    """What every record is stamped with as it is written: seconds since the run began, the
    fleet's state, and the rewards that failed so far."""

    elapsed_s: float
    engines: int = msgspec.field(name="cluster/engines")  # in rotation
    rows_retried: int = msgspec.field(name="cluster/rows_retried")
    rejoins: int = msgspec.field(name="cluster/rejoins")
    reward_errors: int = msgspec.field(name="reward/errors")


class Colocation(Flat, kw_only=True):
    """The engines' sleep around a colocated train step (``cluster.colocate``)."""

    kv_bytes_training: int = msgspec.field(name="colocate/kv_bytes_training")
    """KV cache bytes the engines held while the trainer stepped (the most of two readings: once
    asleep, and once the step was under way): 0 when they gave their cache up."""
    engines_asleep: int = msgspec.field(name="colocate/engines_asleep")
    """Engines that said they were asleep once the step was under way (all of them)."""
    sleep_s: float = msgspec.field(name="colocate/sleep_s")
    wake_s: float = msgspec.field(name="colocate/wake_s")


class StepRecord(Flat, kw_only=True):
    """One step of any schedule (step 0: the starting weights' validation)."""

    step: int
    reward: float | None = None  # the batch's mean reward
    rollout_s: float | None = None  # generating (asynchronous schedules: waiting for samples)
    train_s: float | None = None
    response_tokens: int | None = None  # model tokens trained on
    response_len_max: int | None = None  # the longest response's model tokens
    updates: int | None = None  # optimiser updates (asynchronous schedules: one per mini-batch)
    train: dict[str, float] = msgspec.field(default_factory=dict, name="train/")  # the trainer's, reduced
    weights: Weights | None = None
    colocation: Colocation | None = None
    data_rows: list[tuple[int, int]] | None = msgspec.field(default=None, name="data/rows")  # (epoch, row)
    sampler: dict[str, float] = msgspec.field(default_factory=dict, name="sampler/")  # Sampler.metrics
    staleness: Staleness | None = None
    rollouts: Rollouts | None = None
    processing: Processing | None = None
    trainer_idle_ratio: float | None = msgspec.field(default=None, name="trainer/idle_ratio")
    trainer_idle_ratio_total: float | None = msgspec.field(default=None, name="trainer/idle_ratio_total")
    rollouter_idle_ratio: float | None = msgspec.field(default=None, name="rollouter/idle_ratio")
    queue: QueueStats | None = None
    step_s: float | None = None  # since the last step ended
    val_accuracy: float | None = None  # held-out, greedy
    val_version: int | None = None  # the weight version validated (when it lags the step)
    checkpoint: str | None = None  # the folder saved at this step
    checkpoint_s: float | None = msgspec.field(default=None, name="checkpoint/s")
    checkpoint_in_flight: int | None = msgspec.field(default=None, name="checkpoint/in_flight")
    stamp: Stamp | None = None  # added by ``Run.write``


__all__ = ["Colocation", "Flat", "Processing", "QueueStats", "Stamp", "Staleness", "StepRecord", "Weights"]
