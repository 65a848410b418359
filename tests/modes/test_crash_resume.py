"""Crash and resume, in every mode: ``rlasync train`` killed with SIGKILL at a random moment
(or in the middle of writing a checkpoint), then ``--resume``d, trains exactly the row uses an
uninterrupted run trains (``data/rows``: none lost, none twice), keeps the staleness bound
across the restart, leaves no process behind, and never loads a torn checkpoint."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlasync.config import load_config
from rlasync.data import RowSampler, synthetic_rows

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
STEPS, PROMPTS = 6, 4


def _overrides(run_dir: Path, model_dir: Path, mode: str) -> list[str]:
    return [
        f"train.run_dir={run_dir}", f"train.model_dir={model_dir}", f"train.mode={mode}", f"train.steps={STEPS}",
        f"train.prompts_per_step={PROMPTS}", "train.group_size=4", "train.max_new_tokens=24", "train.val_size=8",
        "train.validate_every=100", "train.checkpoint_every=2", "train.keep_checkpoints=2", "trainer.lr=1e-3",
        "async_training.staleness_threshold=1",
    ]  # fmt: skip


def _train(overrides: list[str], *, resume: bool = False) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "rlasync", "train", str(CONFIG), *overrides, *(["--resume"] if resume else [])]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _descendants(parent: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue
    found, todo = set(), list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _alive(pids: set[int]) -> set[int]:
    def running(pid: int) -> bool:
        try:
            return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
        except OSError:
            return False

    return {pid for pid in pids if running(pid)}


def _kill_when(proc: subprocess.Popen[str], run_dir: Path, when: str, rng: random.Random) -> str:
    """SIGKILL ``proc`` after its first checkpoint: ``random`` at a random moment of the steps
    after it, ``checkpoint`` while a later checkpoint is being written (its ``.partial`` folder
    exists). Returns what it saw at the kill."""
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + 90
    while not (checkpoints / "step_000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    if when == "random":
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        while not list(checkpoints.glob("*.partial")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a second checkpoint was written"
            time.sleep(0.001)
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    seen = sorted(p.name for p in checkpoints.iterdir())
    gone = time.monotonic() + 15
    while _alive(family) and time.monotonic() < gone:  # the ranks and engine nodes follow their parent
        time.sleep(0.1)
    assert not _alive(family), f"processes left after the controller was killed: {_alive(family)}"
    return f"killed with {seen}"


def _expected_uses(model_dir: Path, run_dir: Path) -> collections.Counter[tuple[int, int]]:
    """What an uninterrupted run trains: the sampler's first ``STEPS * PROMPTS`` row uses."""
    config = load_config(CONFIG, [f"train.run_dir={run_dir}", f"train.model_dir={model_dir}"])
    rows = synthetic_rows(config.train.task, config.data.synthetic_train_size, seed=config.train.seed, split="train")
    sampler = RowSampler(rows, seed=config.train.seed, shuffle=config.data.shuffle)
    return collections.Counter(sampler.next_uses(STEPS * PROMPTS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode, when", [("sync", "random"), ("one_step_off", "checkpoint"), ("fully_async", "random"), ("fully_async", "checkpoint")]
)  # fmt: skip
def test_a_run_killed_and_resumed_trains_every_sample_once(tmp_path: Path, nano_model_dir: Path, mode: str, when: str) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    overrides = _overrides(tmp_path, nano_model_dir, mode)
    proc = _train(overrides)
    try:
        seen = _kill_when(proc, tmp_path, when, rng)
    finally:
        if proc.poll() is None:
            proc.kill()
    context = f"{mode}, killed at {when} (seed {seed}): {seen}"
    resumed = _train(overrides, resume=True)
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, f"{context}\n{output}"
    resumed_from = output.split("resumed from ", 1)[-1].split(" ", 1)[0]
    assert resumed_from.startswith(str(tmp_path / "checkpoints" / "step_")) and not resumed_from.endswith(".partial"), f"{context}\n{output}"

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS + 1)), context
    trained = collections.Counter(tuple(use) for r in records for use in r.get("data/rows", []))
    assert trained == _expected_uses(nano_model_dir, tmp_path), context  # none lost, none trained twice
    bound = {"sync": 0, "one_step_off": 1, "fully_async": 1}[mode]
    assert max(len(r.get("async/staleness_token_hist", [0])) - 1 for r in records) <= bound, context
    assert Path(records[-1]["checkpoint"]).name == f"step_{STEPS:06d}", context
