"""``rlasync eval``: a run's checkpoint scored on its held-out rows (pass@1, pass@k, avg@k,
maj@k) on the engines the config trains with; a checkpoint that is not one is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

CONFIG = """\
train:
  model_dir: {model}
  run_dir: {run_dir}
  task: reverse
  steps: 2
  prompts_per_step: 4
  group_size: 4
  max_new_tokens: 12
  validate_every: 1000
  val_size: 16
  checkpoint_every: 2
trainer:
  lr: 1.0e-5
engine:
  max_batch: 32
data:
  synthetic_train_size: 64
"""


def _rlasync(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlasync", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_eval_scores_the_newest_checkpoint_and_refuses_a_torn_one(
    tmp_path: Path, reverse_model: Path
) -> None:
    (tmp_path / "run.yaml").write_text(CONFIG.format(model=reverse_model, run_dir=tmp_path / "run"))
    trained = _rlasync(tmp_path, "train", "run.yaml")
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = _rlasync(tmp_path, "eval", "run.yaml", "--checkpoint", "newest", "-k", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"].endswith("checkpoints/step_000002/model")
    assert (result["rows"], result["samples"], result["temperature"]) == (16, 4, 1.0)
    s = result["scores"]
    assert set(s) == {"pass@1", "pass@4", "avg@4", "maj@4"}
    assert s["pass@1"] == pytest.approx(s["avg@4"])  # the reverse task's reward is 0 or 1
    assert 0.0 < s["pass@1"] <= s["pass@4"] <= 1.0  # the warm-started model reverses some words
    assert "pass@4" in done.stdout and "maj@4" in done.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").read_text().count('"eval')  # the run's records untouched

    # A checkpoint whose weights changed after it was sealed is not one.
    weights = tmp_path / "run" / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    torn = _rlasync(tmp_path, "eval", "run.yaml", "--checkpoint", str(weights.parents[1]))
    assert torn.returncode == 2 and "not a sound checkpoint (model/model.safetensors has" in torn.stderr, (
        torn.stderr
    )
    missing = _rlasync(tmp_path, "eval", "run.yaml", "--checkpoint", "nowhere")
    assert missing.returncode == 2 and "--checkpoint nowhere: no such folder" in missing.stderr
