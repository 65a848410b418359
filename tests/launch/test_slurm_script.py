"""``launch/slurm.sbatch``'s own part of ending early, with stand-ins for ``srun`` and ``scontrol``
on its PATH (Slurm's daemons cannot run in the suite; the real ``rlasync launch --from-env``
tasks under Slurm's variables are ``tests/multinode``'s):

- SIGUSR1 to the batch shell (``#SBATCH --signal=B:USR1@120``: the time limit is near) reaches
  the job step (srun passes it to every task), and once the step ends the job is requeued;
- SIGTERM to the batch shell (scancel, a preemption) neither kills the step nor requeues: the
  shell waits for the tasks, which got the signal themselves, to save their checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from waiting import wait_until_sync

SCRIPT = Path(__file__).parents[2] / "launch" / "slurm.sbatch"

# srun: writes its arguments, then lives until a signal, which it writes down and ends on.
SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$LOG"
trap 'echo "step got USR1" >> "$LOG"; exit 0' USR1
trap 'echo "step got TERM" >> "$LOG"; exit 0' TERM
echo started >> "$LOG"
while :; do sleep 0.05; done
"""
# scontrol: a large job's host list (a reader that stops at the first line would fail it: SIGPIPE).
SCONTROL = """#!/usr/bin/env bash
if [ "$1" = show ]; then echo head-node; exec seq -f 'node-%g' 2 20000; fi
echo "scontrol $*" >> "$LOG"
"""


@pytest.fixture
def job(tmp_path: Path):  # type: ignore[no-untyped-def]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "job.log"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        LOG=str(log),
        RLASYNC_CLUSTER_SECRET="s",
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="head-node,node-2",
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "configs/quickstart_cluster.yaml", "--resume=auto"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def started() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return log.is_file() and "started" in log.read_text()

    wait_until_sync(started, timeout_s=30, what="the job step started")
    yield proc, log
    proc.kill()


def test_the_time_limit_signal_reaches_the_step_and_the_job_is_requeued(job) -> None:  # type: ignore[no-untyped-def]
    proc, log = job
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    lines = log.read_text().splitlines()
    assert (
        lines[0]
        == "srun --ntasks-per-node=1 --label --kill-on-bad-exit=1 python -m rlasync launch --from-env configs/quickstart_cluster.yaml --resume=auto"
    )
    assert lines[1:] == ["started", "step got USR1", "scontrol requeue 77"], lines
    assert proc.returncode == 0 and "requeueing job 77" in out, out


def test_scancel_lets_the_step_finish_its_checkpoint_and_does_not_requeue(job) -> None:  # type: ignore[no-untyped-def]
    proc, log = job
    proc.send_signal(signal.SIGTERM)  # the shell's share of scancel: the tasks get their own
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)  # it waits for the step
    assert "step got" not in log.read_text()
    step = int(
        subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0]
    )
    os.kill(step, signal.SIGTERM)  # Slurm's SIGTERM to the task: it checkpoints and ends
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "requeue" not in log.read_text() and "requeue" not in out, out
