"""Helpers of the environment frameworks' tier (``make test-envs``, tests/envs_frameworks): verifiers, TextArena and OpenEnv, each in
the environment ``.venv-envs`` that has them (verifiers' classic API pins ``mcp<2``, which the main
test environment's MCP tests cannot share). Elsewhere each test is skipped, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BASE = """\
train:
  model_dir: {model}
  run_dir: {run_dir}
  mode: {mode}
  steps: 3
  prompts_per_step: {prompts}
  group_size: 2
  max_new_tokens: {tokens}
  validate_every: 3
  val_size: {val}
  trace_every: 1
trainer:
  lr: {lr}
engine:
  max_batch: 16
agent:
  response_length: 2048
"""


def run_yaml(
    cwd: Path,
    source: str,
    *,
    model: Path,
    mode: str,
    prompts: int = 4,
    tokens: int = 8,
    val: int = 4,
    lr: float = 1e-4,
) -> dict[str, Any]:
    """``rlasync train`` of a 3-step run of ``source`` (the ``data:`` section, YAML) in ``cwd``; its
    step records and traces."""
    config = (
        BASE.format(
            model=model, run_dir=cwd / "run", mode=mode, prompts=prompts, tokens=tokens, val=val, lr=lr
        )
        + source
    )
    (cwd / "run.yaml").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "rlasync", "train", "run.yaml"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    traces = [json.loads(line) for line in (cwd / "run" / "traces.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and r.get("reward") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]
    return {"steps": steps, "traces": traces, "records": records, "stderr": done.stderr}
