"""A two-step calc run through ``rlasync train`` from a YAML file, its tools from somewhere other
than ``agent.tools``: what the MCP and verl tool-file tests start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

CONFIG = """\
train:
  task: calc
  model_dir: {model}
  run_dir: {run_dir}
  steps: 2
  prompts_per_step: 4
  group_size: 4
  validate_every: 1000
  val_size: 8
  trace_every: 0
agent:
  default_loop: tool
  tools: []
  max_assistant_turns: 3
{agent}trainer:
  lr: 1.0e-4
"""
"""``agent`` is more of the agent section, indented by two spaces (ending in a newline)."""


def train(config: Path, *, pythonpath: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``rlasync train CONFIG``, from the repository, ``pythonpath`` importable."""
    return subprocess.run(
        [sys.executable, "-m", "rlasync", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *pythonpath])},
    )
