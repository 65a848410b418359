"""Every benchmark runs: its ``--smoke`` mode (seconds, figures meaningless) end to end, so none
rots unseen between ``make bench`` runs. What a benchmark measures needs a machine of its own
and is not asserted here; only that it runs and ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlasync.runtime.forked_commands import FORKED_SCRIPT

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
# gpu_sync.sh needs two GPUs (it is the NCCL run of sync_bench.py, whose smoke runs here).
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def test_every_benchmark_script_is_listed() -> None:
    assert {
        "actor_bench.py",
        "agent_bench.py",
        "cluster_bench.py",
        "engine_bench.py",
        "modes_bench.py",
        "plot_modes.py",
        "sync_bench.py",
        "train_bench.py",
        "launch_bench.py",
        "resume_bench.py",
        "metrics_bench.py",
        "curriculum_bench.py",
        "pause_bench.py",
        "replay_bench.py",
        "repack_bench.py",
        "memory_bench.py",
        "lora_bench.py",
    } <= set(SCRIPTS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_runs_in_its_smoke_mode(script: str, tmp_path: Path) -> None:
    extra = (
        ["--out", str(tmp_path)]
        if script == "plot_modes.py"
        else ["--run-dir", str(tmp_path)]
        if script == "cluster_bench.py"
        else []
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FORKED_SCRIPT,
            str(BENCHMARKS / script),
            "--smoke",
            *extra,
        ],  # as `python SCRIPT`
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"{script} --smoke failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict) and result, done.stdout[-2000:]
