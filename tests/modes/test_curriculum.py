"""A curriculum from a YAML file through ``rlasync train``: ``data.sampler`` draws the rows, hears
every step's rewards, and its state is in the checkpoint a resumed run goes on from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

CONFIG = """\
train:
  task: reverse
  model_dir: {model}
  run_dir: {run_dir}
  steps: {steps}
  prompts_per_step: 4
  group_size: 4
  max_new_tokens: 8
  validate_every: 1000
  val_size: 8
  checkpoint_every: 3
  trace_every: 0
data:
  synthetic_train_size: 12   # three steps an epoch: the curriculum acts from the fourth
  sampler:
    name: {sampler}
    revisit: 0.0
trainer:
  lr: 1.0e-4
engine:
  max_batch: 16
"""


def _train(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlasync", "train", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_a_yaml_curriculum_learns_from_every_step_and_resumes_from_its_checkpoint(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "curriculum.yaml"
    config.write_text(CONFIG.format(model=nano_model_dir, run_dir=run_dir, steps=3, sampler="pass_rate"))
    done = _train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "state.json").read_text())["sampler"]
    # The first epoch (3 steps x 4 rows) tried every row once, and heard each one's group.
    assert sorted(int(i) for i in state["pass_rates"]) == list(range(12)) and state["skipped"] == 0

    config.write_text(CONFIG.format(model=nano_model_dir, run_dir=run_dir, steps=6, sampler="pass_rate"))
    resumed = _train(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((run_dir / "checkpoints" / "step_000006" / "state.json").read_text())["sampler"]
    outside = [i for i, rate in state["pass_rates"].items() if not 0.0 < rate < 1.0]
    assert (after["skipped"] > 0) == bool(outside), (state, after)  # rows outside the band passed over
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "data/rows" in r] == list(range(1, 7))
    # Each step's record says what the curriculum knows (``sampler/*``): rows measured, the shares
    # of them in and out of the band, rows passed over.
    by_step = {r["step"]: r for r in records if "data/rows" in r}
    assert by_step[3]["sampler/measured"] == 12 and by_step[6]["sampler/skipped"] == after["skipped"]
    last = by_step[6]
    assert last["sampler/in_band"] + last["sampler/solved"] + last["sampler/unsolved"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("sampler", "message"),
    [
        ("hardest_first", "data.sampler: unknown sampler 'hardest_first'; registered: pass_rate, uniform"),
        ("my_curriculum:Nope", "data.sampler: cannot import 'my_curriculum:Nope'"),
    ],
)
def test_an_unknown_sampler_stops_the_run_before_it_starts(
    tmp_path: Path, nano_model_dir: Path, sampler: str, message: str
) -> None:
    config = tmp_path / "curriculum.yaml"
    config.write_text(CONFIG.format(model=nano_model_dir, run_dir=tmp_path / "run", steps=3, sampler=sampler))
    done = _train(config)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
