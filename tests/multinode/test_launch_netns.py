"""``rlasync launch`` on three hosts: network namespaces on one bridge, the head given by its
IPv6 address. The launcher runs outside them and reaches each through ``--via 'ip netns
exec {host}'``, as it would through ssh.

- the quickstart cluster trains across the three (held-out accuracy rises), and ``rlasync
  status`` lists the three nodes while it runs;
- the same run started by real torchrun (c10d rendezvous) in each namespace (4 short steps of
  an untrained model: that the launch learns is the test above's);
- a host that cannot start is an error naming it within ``launch.start_timeout_s``, and nothing
  is left running in any namespace;
- Ctrl-C: every namespace's processes are gone within 30 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import Lan
from learning import RISE, reward_rise
from ledger import trained_uses, uninterrupted_uses
from waiting import wait_until_sync

from rlasync import new_secret
from rlasync.runtime.joining import EX_ENDED_EARLY
from rlasync.runtime.types import SECRET_ENV
from rlasync.trainer.checkpoint import verify

pytestmark = pytest.mark.multinode
ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"
RUN = ["weights.transport=broadcast", "runtime.heartbeat_interval_s=0.3", "launch.port=29800"]
# The runs that check how a cluster starts, not that it learns: 4 short steps of an untrained model.
SHORT_RUN = [
    "train.steps=4",
    "train.prompts_per_step=4",
    "train.group_size=4",
    "train.max_new_tokens=16",
    "train.val_size=8",
]
# The runs that are stopped half-way and resumed: 16 such steps, validated at the end only.
STOPPED_RUN = ["train.steps=16", *SHORT_RUN[1:], "train.validate_every=100"]


def _hosts_file(lan: Lan, path: Path, *extra: str) -> Path:
    lines = [
        f"{lan.names[0]} addr={lan.ip6(0)}",
        f"{lan.names[1]} addr={lan.ip(1)}",
        f"{lan.names[2]} addr={lan.ip(2)}",
    ]
    comments = [
        "  # the head, by its IPv6 address: the nodes join it, and the trainer's and weights' stores meet there, over IPv6",
        "",
        "",
    ]
    path.write_text(
        "".join(
            f"{line} {more}{comment}\n" for line, more, comment in zip(lines, [*extra, "", "", ""], comments)
        )
    )
    return path


def _launch(
    lan: Lan, tmp_path: Path, model: Path, *overrides: str, hosts_extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], Path, dict[str, str]]:
    env = dict(os.environ, **{SECRET_ENV: new_secret()})
    log = tmp_path / "launch.log"
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "launch",
        "--nodes",
        str(_hosts_file(lan, tmp_path / "hosts.txt", *hosts_extra)),
        "--via",
        "ip netns exec {host}",
        str(CLUSTER),
        f"train.run_dir={tmp_path / 'run'}",
        f"train.model_dir={model}",
        *RUN,
        *overrides,
    ]
    return (
        subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True),
        log,
        env,
    )


def _records(tmp_path: Path) -> list[dict[str, object]]:
    """The run's records so far; a last line still being written (no newline yet) is left for later."""
    path = tmp_path / "run" / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    whole = text[: text.rfind("\n") + 1]  # up to the last complete line
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def _wait_for_step(
    proc: subprocess.Popen[str], tmp_path: Path, log: Path, step: int, timeout: float = 240
) -> None:
    def stepped() -> bool:
        if any(int(r["step"]) >= step for r in _records(tmp_path)):  # type: ignore[call-overload]
            return True
        assert proc.poll() is None, "the launcher exited"
        return False

    try:
        wait_until_sync(stepped, timeout_s=timeout, interval_s=0.3, what=f"step {step} is in metrics.jsonl")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text()[-4000:]}") from None


def _run_on_every_host(
    tmp_path: Path, commands: list[tuple[list[str], dict[str, str]]], timeout: float
) -> list[str]:
    """Run one command (with its environment) per host, as torchrun or srun would start them on
    each machine; all must exit 0 within ``timeout``. Returns their outputs."""
    logs = [tmp_path / f"host-{i}.log" for i in range(len(commands))]
    procs = [
        subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
        for (command, env), log in zip(commands, logs)
    ]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
        assert codes == [0] * len(procs), "\n".join(log.read_text()[-3000:] for log in logs)
    finally:
        for p in procs:
            p.kill()
    return [log.read_text() for log in logs]


def _gone(lan: Lan, timeout: float) -> list[int]:
    """The LAN's processes still alive after waiting up to ``timeout`` s for all to end."""
    with contextlib.suppress(AssertionError):  # the caller names what is left
        wait_until_sync(lambda: not lan.pids(), timeout_s=timeout, interval_s=0.2, what="all ended")
    return lan.pids()


@pytest.mark.timeout(500)
def test_launch_trains_across_three_hosts_the_head_by_ipv6_and_status_lists_them(
    three_hosts: Lan, tmp_path: Path, reverse_model: Path
) -> None:
    lan = three_hosts
    proc, log, env = _launch(lan, tmp_path, reverse_model, "train.steps=100", "train.validate_every=1000")
    try:
        _wait_for_step(proc, tmp_path, log, 3)
        status = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                lan.names[1],
                sys.executable,
                "-m",
                "rlasync",
                "status",
                "--head",
                f"tcp://[{lan.ip6(0)}]:29800",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        table = status.stdout
        for node, address in (("node-0", f"[{lan.ip6(0)}]"), ("node-1", lan.ip(1)), ("node-2", lan.ip(2))):
            assert node in table and address in table, table
        assert (
            "head" in table
            and "engine-0 (weights v" in table
            and "engine-1 (weights v" in table
            and "trainer rank 1" in table
        ), table
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        proc.kill()
    out = log.read_text()
    result = json.loads(out.strip().splitlines()[-1].split("| ", 1)[1])
    records = _records(tmp_path)
    assert reward_rise(records) >= RISE, (reward_rise(records), result)  # it learns
    assert [r["step"] for r in records[1:]] == list(range(1, 101))
    assert (
        f"{lan.names[2]} |" in out and f"{lan.names[1]} |" in out
    )  # every host's output, prefixed with its name
    assert SECRET_ENV not in out and env[SECRET_ENV] not in out
    assert not _gone(lan, 30)


def _torchrun(lan: Lan, host: int, address: str, args: list[str], *options: str) -> list[str]:
    """torchrun on ``host`` (its namespace) starting ``rlasync launch --from-env ARGS``: c10d
    rendezvous at host 0, which hosts it; ``address``: the host's address the others reach."""
    return [
        "ip",
        "netns",
        "exec",
        lan.names[host],
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=3",
        "--nproc-per-node=1",
        *options,
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={lan.ip(0)}:29400",
        f"--rdzv-conf=is_host={int(host == 0)}",
        f"--local-addr={address}",
        "-m",
        "rlasync",
        "launch",
        "--from-env",
        *args,
    ]


@pytest.mark.timeout(500)
def test_the_same_run_started_by_torchrun_in_each_namespace(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path
) -> None:
    lan = three_hosts
    env = dict(os.environ, **{SECRET_ENV: new_secret()})
    addresses = [lan.ip(0), lan.ip(1), lan.ip6(2)]
    commands = [
        (
            _torchrun(
                lan,
                i,
                address,
                [
                    str(CLUSTER),
                    f"train.run_dir={tmp_path / 'run'}",
                    f"train.model_dir={nano_model_dir}",
                    *SHORT_RUN,
                    *RUN,
                ],
            ),
            env,
        )
        for i, address in enumerate(addresses)
    ]
    logs = _run_on_every_host(tmp_path, commands, timeout=420)
    head_log = next(log for log in logs if '"final_accuracy"' in log)  # c10d picks which machine is rank 0
    result = json.loads(
        next(line for line in reversed(head_log.splitlines()) if line.startswith('{"initial_accuracy"'))
    )
    assert result["steps"] == 4 and [r["step"] for r in _records(tmp_path)[1:]] == [1, 2, 3, 4], (
        result
    )  # learning: the test above
    assert "cluster: 3 node(s)" in head_log
    assert not _gone(lan, 30)


@pytest.mark.timeout(200)
def test_a_host_that_cannot_start_is_named_within_the_deadline_and_nothing_is_left(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path
) -> None:
    lan = three_hosts
    started = time.monotonic()
    proc, log, _ = _launch(
        lan,
        tmp_path,
        nano_model_dir,
        "launch.start_timeout_s=60",
        hosts_extra=("", "", "python=/opt/no-such-python/bin/python3"),
    )
    code = proc.wait(timeout=120)
    took = time.monotonic() - started
    out = log.read_text()
    assert code == 2, out[-3000:]
    assert (
        f"rlasync launch: {lan.names[2]} (node-2) stopped with exit code" in out and "no-such-python" in out
    ), out[-3000:]
    assert took < 60, took
    assert not _gone(lan, 30)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", ["ctrl_c", "a_node_fails"])
def test_ctrl_c_or_a_failed_node_stops_every_host_within_30_s(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path, stop: str
) -> None:
    lan = three_hosts
    proc, log, _ = _launch(
        lan,
        tmp_path,
        nano_model_dir,
        "train.steps=500",
        "train.prompts_per_step=4",
        "train.group_size=4",
        "train.max_new_tokens=16",
        "train.val_size=8",
        "train.checkpoint_on_interrupt=true",
    )
    try:
        _wait_for_step(proc, tmp_path, log, 2)
        assert len(lan.pids()) >= 5  # three nodes and the two trainer ranks' processes
        stopped = time.monotonic()
        if stop == "ctrl_c":  # the head ends its step with a checkpoint, then every host stops
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=40) == 130, log.read_text()[-3000:]
            saved = list((tmp_path / "run" / "checkpoints").glob("step_*"))
            assert len(saved) == 1 and not verify(saved[0]), log.read_text()[-3000:]
        else:  # node-2 (an engine's) dies: the run could go on, the launch stops every host
            node = [
                int(p)
                for p in subprocess.run(
                    ["ip", "netns", "pids", lan.names[2]], capture_output=True, text=True
                ).stdout.split()
            ]
            os.kill(min(node), signal.SIGKILL)
            assert proc.wait(timeout=40) == 1, log.read_text()[-3000:]
            assert (
                f"launch: {lan.names[2]} (node-2) failed with exit code -9; stopping every host"
                in log.read_text()
            )
        assert not _gone(lan, 30 - (time.monotonic() - stopped)), log.read_text()[-3000:]
    finally:
        proc.kill()


@pytest.mark.timeout(300)
def test_a_slurm_job_one_task_per_host_node_zero_hosting_the_store(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path
) -> None:
    """What ``launch/slurm.sbatch``'s ``srun`` starts on each host: ``--from-env`` with Slurm's
    variables; node 0 hosts the store at MASTER_ADDR:MASTER_PORT (no torchrun agent here)."""
    lan = three_hosts
    args = [
        str(CLUSTER),
        f"train.run_dir={tmp_path / 'run'}",
        f"train.model_dir={nano_model_dir}",
        *SHORT_RUN,
        *RUN,
    ]
    commands = _slurm_commands(lan, args, 29450)
    head = _run_on_every_host(tmp_path, commands, timeout=240)[0]
    assert "cluster: 3 node(s)" in head and '"steps": 4' in head, head[-3000:]
    assert [r["step"] for r in _records(tmp_path)[1:]] == [1, 2, 3, 4]
    assert not _gone(lan, 30)


def _slurm_commands(lan: Lan, args: list[str], port: int) -> list[tuple[list[str], dict[str, str]]]:
    """What ``launch/slurm.sbatch``'s ``srun`` starts: one ``--from-env`` task per host (with
    ``args``), each with the variables srun sets; node 0 hosts the store at ``port``."""
    env = dict(
        os.environ,
        **{SECRET_ENV: new_secret()},
        MASTER_ADDR=lan.ip(0),
        MASTER_PORT=str(port),
        SLURM_JOB_ID="4242",
        SLURM_STEP_ID="0",
        SLURM_NTASKS="3",
        SLURM_NNODES="3",
    )
    return [
        (
            ["ip", "netns", "exec", name, sys.executable, "-m", "rlasync", "launch", "--from-env", *args],
            dict(env, SLURM_PROCID=str(i), SLURM_NODEID=str(i), SLURM_LOCALID="0"),
        )
        for i, name in enumerate(lan.names)
    ]


def _slurm_tasks(lan: Lan, tmp_path: Path, args: list[str], port: int) -> list[subprocess.Popen[str]]:
    """``_slurm_commands`` started, each writing ``task-<i>.log``."""
    return [
        subprocess.Popen(
            command,
            env=env,
            stdout=(tmp_path / f"task-{i}.log").open("a"),
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, (command, env) in enumerate(_slurm_commands(lan, args, port))
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("start, mode", [("nodes", "fully_async"), ("slurm", "sync")])
def test_sigterm_to_every_node_at_once_checkpoints_and_the_same_command_with_resume_auto_goes_on(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path, start: str, mode: str
) -> None:
    """What ``scancel``, a time limit or a preemption does to a job: SIGTERM to every process
    on every host at the same instant. The nodes defer to the head, which ends its step with a
    sealed checkpoint; every process is gone within ``train.interrupt_grace_s`` + 5 s; then the
    same command (``--resume=auto``, which started the run afresh) continues from it, and the
    two parts train exactly the rows an uninterrupted run trains."""
    lan, grace, steps = three_hosts, 30.0, 16
    run = [
        f"train.mode={mode}",
        *STOPPED_RUN,
        "train.checkpoint_every=0",
        "train.checkpoint_on_interrupt=true",
        f"train.interrupt_grace_s={grace}",
        "async_training.staleness_threshold=1",
    ]
    args = [
        str(CLUSTER),
        f"train.run_dir={tmp_path / 'run'}",
        f"train.model_dir={nano_model_dir}",
        *RUN,
        *run,
    ]

    def begin() -> tuple[list[subprocess.Popen[str]], Path]:
        if start == "nodes":
            proc, log, _ = _launch(lan, tmp_path, nano_model_dir, *run, "--resume=auto")
            return [proc], log
        return _slurm_tasks(lan, tmp_path, [*args, "--resume=auto"], 29460), tmp_path / "task-0.log"

    procs, log = begin()
    try:
        _wait_for_step(procs[0], tmp_path, log, 2)
        pids = lan.pids()
        assert len(pids) >= 8, pids  # 3 nodes, 2 trainer ranks, a spawner on each host
        interrupted_at = max(int(r["step"]) for r in _records(tmp_path))  # type: ignore[call-overload]
        sent = time.monotonic()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        left = _gone(lan, grace + 5)
        took = time.monotonic() - sent
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = log.read_text()
    assert not left and took < grace + 5, (left, took, out[-4000:])
    assert codes == [130, EX_ENDED_EARLY, EX_ENDED_EARLY][: len(codes)], (codes, out[-4000:])
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and not verify(saved[0]), (saved, out[-4000:])
    assert int(saved[0].name.removeprefix("step_")) >= interrupted_at, (saved, interrupted_at)
    # Nothing lost: no node, head or sample. The transport's safety timer may log a "lost
    # wake-up rescued" (an edge it re-read, nothing lost; CI saw one as the nodes left).
    losses = [line for line in out.splitlines() if "lost" in line and "wake-up rescued" not in line]
    assert "Traceback" not in out and not losses, (losses, out[-4000:])

    procs, log = begin()  # the same command: it resumes
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = log.read_text()
    assert codes == [0] * len(procs) and f"resumed from {saved[0]}" in out, (codes, out[-4000:])
    assert [r["step"] for r in _records(tmp_path)] == list(range(steps + 1))
    overrides = [f"train.model_dir={nano_model_dir}", *run]
    assert trained_uses(tmp_path / "run") == uninterrupted_uses(CLUSTER, overrides)  # none lost, none twice
    assert not _gone(lan, 30)


def _worker_of(lan: Lan, host: int) -> int:
    """The pid of the process torchrun started on host ``host``: the node (``launch --from-env``)."""
    for pid in map(
        int,
        subprocess.run(
            ["ip", "netns", "pids", lan.names[host]], capture_output=True, text=True, timeout=30
        ).stdout.split(),
    ):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            agent = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"--from-env" in argv and b"torch.distributed.run" in agent:
            return pid
    raise AssertionError(f"no torchrun worker on {lan.names[host]}")


@pytest.mark.timeout(600)
def test_torchrun_restarts_the_group_after_a_node_is_killed_and_it_resumes_from_the_last_checkpoint(
    three_hosts: Lan, tmp_path: Path, nano_model_dir: Path
) -> None:
    """``torchrun --max-restarts=1`` on every host, the run given ``--resume=auto``: a node other
    than the head killed mid-run fails the group, torchrun stops the others (SIGTERM: they end
    in order) and starts the same command again, which resumes from the newest checkpoint; the
    run ends complete, every row trained once."""
    lan, steps = three_hosts, 16
    run = [*STOPPED_RUN, "train.checkpoint_every=2"]
    env = dict(os.environ, **{SECRET_ENV: new_secret()})
    logs = [tmp_path / f"host-{i}.log" for i in range(3)]
    args = [
        str(CLUSTER),
        f"train.run_dir={tmp_path / 'run'}",
        f"train.model_dir={nano_model_dir}",
        *RUN,
        *run,
        "--resume=auto",
    ]
    procs = [
        subprocess.Popen(
            _torchrun(lan, i, lan.ip(i), args, "--max-restarts=1"),
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, log in enumerate(logs)
    ]

    def everything() -> str:
        return "\n".join(log.read_text()[-3000:] for log in logs)

    try:
        _wait_for_step(procs[0], tmp_path, logs[0], 3)
        head = next(i for i, log in enumerate(logs) if "listening node=node-0" in log.read_text())
        victim = (head + 1) % 3
        os.kill(_worker_of(lan, victim), signal.SIGKILL)
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0, 0], (codes, everything())
    texts = [log.read_text() for log in logs]
    resumed = [t.split("resumed from ", 1)[1].split(" ", 1)[0] for t in texts if "resumed from " in t]
    assert len(resumed) == 1 and Path(resumed[0]).name.startswith("step_"), everything()
    assert [r["step"] for r in _records(tmp_path)] == list(range(steps + 1))
    overrides = [f"train.model_dir={nano_model_dir}", *run]
    assert trained_uses(tmp_path / "run") == uninterrupted_uses(CLUSTER, overrides)  # none lost, none twice
    assert not _gone(lan, 30)
