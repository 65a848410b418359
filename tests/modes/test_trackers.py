"""What a run leaves for people to look at, from one short ``rlasync train``: its step records in
every tracker (TensorBoard event files read back with TensorBoard's own reader, an offline W&B
run, ``metrics.jsonl``), rollout traces that ``rlasync show`` prints, and the PNG ``rlasync plot``
draws. Plus the errors: an unknown tracker, a step never traced, a folder that is no run."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlasync.compose.run import Run
from rlasync.config import ConfigError, load_config

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _rlasync(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlasync", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_a_run_feeds_tensorboard_wandb_traces_show_and_plot(tmp_path: Path, nano_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    done = _rlasync(
        "train",
        str(QUICKSTART),
        f"train.run_dir={run_dir}",
        f"train.model_dir={nano_model_dir}",
        "train.steps=4",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.max_new_tokens=8",
        "train.validate_every=2",
        "train.val_size=4",
        "train.trace_every=2",
        "train.trace_samples=2",
        "train.trackers=[jsonl, tensorboard, wandb]",
        "train.wandb_project=rlasync-test",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    summary_file = json.loads((run_dir / "summary.json").read_text())
    assert summary_file["final_accuracy"] == result["final_accuracy"] and summary_file["steps"] == 4

    # TensorBoard, read back by TensorBoard's reader: every step's scalars, the config, the summary.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"reward", "train/loss", "train/lr", "val_accuracy", "summary/final_accuracy"} <= set(scalars), (
        scalars
    )
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([r["reward"] for r in records[1:]])
    assert events.Scalars("summary/final_accuracy")[0].value == pytest.approx(result["final_accuracy"])
    texts = {
        tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]
    }
    config_text = next(text for tag, text in texts.items() if tag.startswith("config"))
    assert '"trace_every": 2' in config_text

    # W&B, offline: its run file read back with W&B's own record schema.
    (offline,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    kinds = _wandb_records(offline)
    history = {r.history.step.num: {_key(i): i.value_json for i in r.history.item} for r in kinds["history"]}
    assert sorted(history) == [0, 1, 2, 3, 4]
    assert (
        json.loads(history[4]["reward"]) == pytest.approx(records[4]["reward"]) and "train/loss" in history[4]
    )
    summary = {_key(i): json.loads(i.value_json) for r in kinds["summary"] for i in r.summary.update}
    assert summary["final_accuracy"] == pytest.approx(result["final_accuracy"]) and summary["steps"] == 4
    (run,) = kinds["run"]
    config = {item.key: json.loads(item.value_json) for item in run.run.config.update}
    assert config["train"]["trace_every"] == 2 and run.run.project == "rlasync-test"

    # Traces: two trajectories of steps 2 and 4, as text, and `rlasync show` prints them.
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert [t["step"] for t in traces] == [2, 2, 4, 4]
    for trace in traces:
        assert [m["role"] for m in trace["messages"]][-1] == "assistant"
        assert sum(n for _, n in trace["versions"]) == trace["model_tokens"] > 0
        assert {v for v, _ in trace["versions"]} <= {1, 3}  # sync: step N samples with version N - 1
    shown = _rlasync("show", str(run_dir), "--step", "2")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("=== step 2, trajectory") == 2 and "assistant:" in shown.stdout, shown.stdout
    assert traces[0]["messages"][-1]["content"].strip()[:20] in shown.stdout
    last = _rlasync("show", str(run_dir))
    assert last.stdout.count("=== step 4, trajectory") == 2
    missing = _rlasync("show", str(run_dir), "--step", "3")
    assert missing.returncode == 2 and "no traces of step 3" in missing.stderr and "2, 4" in missing.stderr

    # `rlasync plot`: one PNG of the run.
    drawn = _rlasync("plot", str(run_dir), "--out", str(tmp_path / "run.png"))
    assert drawn.returncode == 0, drawn.stderr
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    nothing = _rlasync("plot", str(tmp_path / "no-such-run"))
    assert nothing.returncode == 2 and "metrics.jsonl does not exist" in nothing.stderr


def _wandb_records(path: Path) -> dict[str, list[Any]]:
    """The records of a W&B run file (``run-*.wandb``: a LevelDB-style log of 32 KiB blocks,
    each chunk a 7-byte header then a piece of one ``Record``), by type."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pieces, out = path.read_bytes(), 7, b"", {}  # 7: W&B's file header
    block = 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.setdefault(record.WhichOneof("record_type"), []).append(record)
            pieces = b""
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def test_an_unknown_tracker_is_a_config_error_naming_the_known_ones(tmp_path: Path) -> None:
    config = load_config(QUICKSTART, [f"train.run_dir={tmp_path}", "train.trackers=[jsonl, tensorbored]"])
    with pytest.raises(
        ConfigError, match=r"train\.trackers: unknown \['tensorbored'\]; known: jsonl, tensorboard, wandb"
    ):
        Run(config)
