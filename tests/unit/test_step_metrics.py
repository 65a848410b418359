"""The typed step record renders the flat ``metrics.jsonl`` lines every schedule wrote before it
(same keys, same values) and reads them back; metrics combine by their declared reductions; the
schedules' shared step scaffolding validates, checkpoints, writes and stops as they did."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from rlasync.metrics import (
    REDUCTIONS,
    Processing,
    QueueStats,
    Rollouts,
    Staleness,
    Stamp,
    StepRecord,
    Weights,
    reduce_metrics,
    reduction,
)

STAMP = {
    "elapsed_s": 5.9,
    "cluster/engines": 1,
    "cluster/rows_retried": 0,
    "cluster/rejoins": 0,
    "reward/errors": 0,
}
TRAIN = {
    "train/loss": 0.0,
    "train/pg_clipfrac": 0.0,
    "train/ratio_mean": 1.0,
    "train/ratio_min": 0.99,
    "train/ratio_max": 1.01,
    "train/compute_s_max": 0.08,
    "train/grad_norm": 0.0,
    "train/lr": 0.0007,
}
# Lines as the three schedules wrote them before ``StepRecord`` (from runs of each mode).
LINES: dict[str, dict[str, Any]] = {
    "step 0": {"step": 0, "val_accuracy": 0.25, **STAMP},
    "sync": {
        "step": 2,
        "reward": 0.5,
        "rollout_s": 0.05,
        "train_s": 0.09,
        "response_tokens": 256,
        "response_len_max": 16,
        **TRAIN,
        "train/tokens": 256.0,
        "weights/transfer_s": 0.008,
        "weights/pause_s": 0.0001,
        "data/rows": [[0, 12595], [1, 17809]],
        "val_accuracy": 0.5,
        "checkpoint": "runs/x/checkpoints/step_000002",
        **STAMP,
    },
    "one_step_off": {
        "step": 2,
        **TRAIN,
        "train/behav_weight_mean": 1.0,
        "train/offpolicy/ratio_min": 0.99,
        "train/offpolicy/kl_k3": 0.0,
        "train/offpolicy/tis_mean": 1.0,
        "reward": 0.0,
        "response_tokens": 494,
        "response_len_max": 16,
        "updates": 2,
        "async/staleness_token_hist": [0, 494],
        "async/staleness_sample_hist": [0, 8],
        "async/staleness_token_mean": 1.0,
        "async/staleness_max": 1,
        "async/partial_samples": 0,
        "async/partial_span_max": 0,
        "data/rows": [[0, 2705], [0, 14554]],
        "rollout_s": 7.3e-05,
        "train_s": 0.31,
        "trainer/idle_ratio": 0.0002,
        "weights/transfer_s": 0.004,
        "weights/pause_s": 0.0001,
        **STAMP,
    },
    "fully_async": {
        "step": 2,
        **TRAIN,
        "reward": 0.0,
        "response_tokens": 256,
        "response_len_max": 16,
        "updates": 1,
        "async/staleness_token_hist": [256],
        "async/staleness_sample_hist": [4],
        "async/staleness_token_mean": 0.0,
        "async/staleness_max": 0,
        "async/partial_samples": 0,
        "async/partial_span_max": 0,
        "async/processing_s_mean": 0.0778,
        "async/processing_s_p50": 0.0778,
        "async/processing_s_p95": 0.0779,
        "async/processing_s_p99": 0.0779,
        "async/processing_s_max": 0.0779,
        "data/rows": [[0, 19364], [0, 8698]],
        "weights/sync_s": 0.003,
        "weights/swap_s": 0.0001,
        "weights/pause_s": 0.0047,
        "rollout_s": 8.7e-05,
        "train_s": 0.077,
        "trainer/idle_ratio": 0.001,
        "trainer/idle_ratio_total": 0.0127,
        "rollouter/idle_ratio": 0.606,
        "async/queue_capacity": 12,
        "async/queue_ready": 8,
        "async/in_flight": 4,
        "async/admitted": 20,
        "async/consumed": 8,
        "async/version": 1,
        "step_s": 0.077,
        "val_accuracy": 0.0,
        "val_version": 1,
        "checkpoint": "runs/x/checkpoints/step_000002",
        "checkpoint/in_flight": 12,
        "checkpoint/s": 0.0034,
        **STAMP,
    },
}


@pytest.mark.parametrize("mode", list(LINES))
def test_a_written_line_reads_back_and_renders_to_the_same_keys_and_values(mode: str) -> None:
    line = LINES[mode]
    record = StepRecord.from_dict(line)
    rendered = record.as_dict()
    assert set(rendered) == set(line)
    assert json.loads(json.dumps(rendered)) == line  # as metrics.jsonl holds it
    assert StepRecord.from_dict(rendered) == record


def test_the_record_is_typed_and_grouped() -> None:
    record = StepRecord.from_dict(LINES["fully_async"])
    assert record.data_rows == [(0, 19364), (0, 8698)]
    assert record.train["compute_s_max"] == 0.08 and record.train["lr"] == 0.0007
    assert record.weights == Weights(sync_s=0.003, swap_s=0.0001, pause_s=0.0047)
    assert record.staleness is not None and record.staleness.max == 0 and record.staleness.token_hist == [256]
    assert record.queue == QueueStats(capacity=12, ready=8, in_flight=4, admitted=20, consumed=8, version=1)
    assert record.stamp == Stamp(elapsed_s=5.9, engines=1, rows_retried=0, rejoins=0, reward_errors=0)
    with pytest.raises(msgspec.ValidationError):  # values are checked against the fields' types
        StepRecord.from_dict({"step": 1, "response_tokens": "many"})


def test_fields_left_unset_are_not_written() -> None:
    assert StepRecord(step=0, val_accuracy=0.0).as_dict() == {"step": 0, "val_accuracy": 0.0}
    record = StepRecord(step=4, train={"loss": 0.5, "offpolicy/kl_k1": 0.1}, weights=Weights(pause_s=0.2))
    assert record.as_dict() == {
        "step": 4,
        "train/loss": 0.5,
        "train/offpolicy/kl_k1": 0.1,
        "weights/pause_s": 0.2,
    }
    assert list(StepRecord(step=1, reward=0.0, rollout_s=1.0).as_dict()) == ["step", "reward", "rollout_s"]


def test_staleness_and_processing_times() -> None:
    def trajectory(versions: list[int], mask: list[int]) -> Any:
        return SimpleNamespace(versions=versions, response_mask=mask)

    samples = [
        [trajectory([3, 3, 4], [1, 1, 1]), trajectory([4, 4], [1, 0])],  # tokens of versions 3 and 4: partial
        [trajectory([5, 5], [1, 1])],
        [trajectory([2], [0])],  # no model tokens: not counted
    ]
    # behind version 5: the first sample's tokens 2, 2, 1, 1 (oldest 2, spanning 2 versions), the second's 0, 0
    assert Staleness.of(samples, version=5) == Staleness(
        token_hist=[2, 2, 2],
        sample_hist=[1, 0, 1],
        token_mean=1.0,
        max=2,
        partial_samples=1,
        partial_span_max=1,
    )
    assert Staleness.of([], version=0).as_dict()["async/staleness_token_hist"] == []

    times = Processing.of([0.4, 0.1, 0.2, 0.3])
    assert times == Processing(mean=0.25, p50=0.3, p95=0.4, p99=0.4, max=0.4)
    assert Processing.of([]) is None


def test_reductions_are_declared_per_metric() -> None:
    assert reduction("ratio_min") == "min" and reduction("ratio_max") == "max"
    assert reduction("compute_s_max") == "max" and reduction("tokens") == "sum"
    assert reduction("offpolicy/ratio_min") == "min"  # a group's metric, by its own name
    assert reduction("pg_clipfrac") == "mean"
    assert reduction("something_max") == "mean"  # not inferred from a suffix: declared or a mean
    assert set(REDUCTIONS.values()) <= {"mean", "sum", "min", "max"}

    parts = [
        (
            3.0,
            {"loss": 1.0, "ratio_min": 0.5, "offpolicy/ratio_max": 1.5, "compute_s_max": 2.0, "tokens": 3.0},
        ),
        (
            1.0,
            {"loss": 5.0, "ratio_min": 0.9, "offpolicy/ratio_max": 3.0, "compute_s_max": 1.0, "tokens": 1.0},
        ),
    ]
    assert reduce_metrics(parts) == {
        "loss": 2.0,  # weighted by tokens: (3 * 1 + 1 * 5) / 4
        "ratio_min": 0.5,
        "offpolicy/ratio_max": 3.0,
        "compute_s_max": 2.0,
        "tokens": 4.0,
    }
    assert reduce_metrics([(0.0, {"loss": 9.0}), (2.0, {"loss": 2.0})]) == {"loss": 2.0}  # no tokens: no vote
    assert reduce_metrics([(0.0, {"loss": 9.0}), (0.0, {"loss": 1.0})]) == {
        "loss": 9.0
    }  # none has: the first
    assert reduce_metrics([]) == {}


def test_the_trainer_reduces_with_the_declared_reductions() -> None:
    from rlasync.trainer.types import reduce_metrics as trainer_reduce

    assert trainer_reduce is reduce_metrics


class _StubRun:
    """What ``Steps`` uses of a ``Run``: validation, checkpoints when due, the metrics file, the
    trackers' summary."""

    def __init__(self, steps: int, *, checkpoint_every: int, stop_after: int = 0) -> None:
        self.config = SimpleNamespace(
            train=SimpleNamespace(steps=steps, validate_every=2, checkpoint_every=checkpoint_every)
        )
        self.started, self.stop_after = 0.0, stop_after
        self.validations, self.step = 0, 0
        self.saved: list[tuple[int, dict[str, Any]]] = []
        self.lines: list[dict[str, Any]] = []
        self.summaries: list[tuple[int, Any]] = []  # (lines written by then, the result)

    def finish(self, result: Any) -> None:
        self.summaries.append((len(self.lines), result))

    async def validate(self) -> float:
        self.validations += 1
        return self.validations / 10

    async def restore(self, folder: Any, state: dict[str, Any]) -> tuple[float, float]:
        return state["initial_accuracy"], state["accuracy"]

    def stopping(self) -> bool:
        return bool(self.stop_after) and self.step >= self.stop_after

    def checkpoint_due(self, step: int, *, stopping: bool = False) -> bool:
        cfg = self.config.train
        return step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping

    async def checkpoint(self, step: int, state: dict[str, Any], files: Any = None, *, stopping: bool) -> str:
        self.saved.append((step, state))
        return f"step_{step}"

    def write(self, record: StepRecord, on_step: Any = None) -> None:
        self.lines.append(record.as_dict())

    def stopped(self, record: StepRecord) -> Exception:
        from rlasync.compose.result import RunInterrupted

        return RunInterrupted(record.step, record.checkpoint)


async def _schedule(run: _StubRun, state: dict[str, Any], resume_from: Any = None) -> Any:
    from rlasync.compose.schedule import Steps

    steps = Steps(run, state)  # type: ignore[arg-type]
    await steps.begin(resume_from)
    for step in steps:
        run.step = step
        record = StepRecord(step=step, reward=1.0)
        if steps.validating(step):
            await steps.validate(record)
        await steps.end(record, version=step)
    return steps.result()


async def test_steps_validate_checkpoint_write_and_give_the_result() -> None:
    run = _StubRun(5, checkpoint_every=3)
    result = await _schedule(run, {})
    assert [line.get("val_accuracy") for line in run.lines] == [0.1, None, 0.2, None, 0.3, 0.4]
    assert [line.get("checkpoint") for line in run.lines] == [None, None, None, "step_3", None, "step_5"]
    assert run.saved[-1] == (5, {"weight_version": 5, "initial_accuracy": 0.1, "accuracy": 0.4})
    assert (result.initial_accuracy, result.final_accuracy, result.steps) == (0.1, 0.4, 5)
    # The trackers get the summary once, after the last step's record (while still open).
    assert [(n, r.final_accuracy) for n, r in run.summaries] == [(6, 0.4)]

    resumed = _StubRun(5, checkpoint_every=3)
    result = await _schedule(
        resumed, {"step": 3, "initial_accuracy": 0.1, "accuracy": 0.2}, resume_from="step_3"
    )
    assert [line["step"] for line in resumed.lines] == [4, 5] and resumed.validations == 2
    assert (result.initial_accuracy, result.final_accuracy) == (0.1, 0.2)


async def test_steps_stop_at_the_end_of_the_step_asked_with_its_checkpoint() -> None:
    from rlasync.compose.result import RunInterrupted

    run = _StubRun(10, checkpoint_every=100, stop_after=3)
    with pytest.raises(RunInterrupted) as stopped:
        await _schedule(run, {})
    assert (stopped.value.step, stopped.value.checkpoint) == (3, "step_3")
    assert run.lines[-1]["step"] == 3 and run.lines[-1]["checkpoint"] == "step_3"


def test_rollouts_aggregate_a_steps_trajectories() -> None:
    def trajectory(turns: int, end: str, calls: int, errors: int) -> SimpleNamespace:
        metrics = SimpleNamespace(tool_calls=calls, tool_errors=errors, aborts=1)
        return SimpleNamespace(num_turns=turns, termination=end, metrics=metrics)

    rollouts = Rollouts.of(
        [trajectory(2, "stop", 0, 0), trajectory(4, "interaction", 1, 0), trajectory(6, "stop", 3, 1)],
        gen_batches=2,
    )
    assert rollouts is not None and Rollouts.of([]) is None
    line = StepRecord(step=1, rollouts=rollouts).as_dict()
    assert line == {
        "step": 1,
        "rollout/turns_mean": 4.0,
        "rollout/turns_max": 6,
        "rollout/tool_calls_mean": 4 / 3,
        "rollout/tool_errors_mean": 1 / 3,
        "rollout/aborts": 3,
        "rollout/termination/interaction": round(1 / 3, 6),
        "rollout/termination/stop": round(2 / 3, 6),
        "rollout/gen_batches": 2,
    }
    assert StepRecord.from_dict(line) == StepRecord(step=1, rollouts=rollouts)


def test_the_samplers_numbers_are_written_and_shown_to_prometheus() -> None:
    from rlasync.compose.telemetry import RunMetrics

    record = StepRecord(step=4, reward=0.5, sampler={"in_band": 0.25, "skipped": 7})
    assert record.as_dict() == {"step": 4, "reward": 0.5, "sampler/in_band": 0.25, "sampler/skipped": 7}
    assert StepRecord.from_dict(record.as_dict()) == record
    metrics = RunMetrics()
    metrics.observe(record)
    (family,) = [f for f in metrics.families() if f.name == "rlasync_sampler"]
    assert {s.labels["stat"]: s.value for s in family.samples} == {"in_band": 0.25, "skipped": 7}
    metrics.observe(StepRecord(step=5, reward=0.5))  # the uniform sampler knows nothing: no family
    assert "rlasync_sampler" not in {f.name for f in metrics.families()}
