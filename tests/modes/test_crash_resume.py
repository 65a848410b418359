"""Crash and resume, in every mode: ``rlasync train`` killed with SIGKILL at a random moment
(or in the middle of writing a checkpoint), then ``--resume``d, trains exactly the row uses an
uninterrupted run trains (``data/rows``: none lost, none twice), keeps the staleness bound
across the restart, leaves no process behind, and never loads a torn checkpoint."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ledger import uninterrupted_uses
from waiting import wait_until_sync

from rlasync.runtime.spawner import COMMANDS_ENV
from rlasync.trainer.checkpoint import verify

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
STEPS, PROMPTS = 6, 4


def _overrides(run_dir: Path, model_dir: Path, mode: str) -> list[str]:
    return [
        f"train.run_dir={run_dir}",
        f"train.model_dir={model_dir}",
        f"train.mode={mode}",
        f"train.steps={STEPS}",
        f"train.prompts_per_step={PROMPTS}",
        "train.group_size=4",
        "train.max_new_tokens=24",
        "train.val_size=8",
        "train.validate_every=100",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=2",
        "trainer.lr=1e-3",
        "async_training.staleness_threshold=1",
    ]


def _train(
    overrides: list[str], *, resume: bool | str = False, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``rlasync train``; ``resume``: True for ``--resume``, "auto" for ``--resume=auto``."""
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(CONFIG),
        *overrides,
        *({True: ["--resume"], "auto": ["--resume=auto"]}.get(resume, [])),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _descendants(parent: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []
                ).append(int(entry.name))
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

    def checkpointed() -> bool:
        if (checkpoints / "step_000002").is_dir():
            return True
        assert proc.poll() is None, proc.communicate()[0]
        return False

    wait_until_sync(checkpointed, timeout_s=90, what="the run wrote its first checkpoint")
    if when == "random":
        time.sleep(rng.uniform(0.0, 1.5))
    else:

        def writing() -> bool:
            if list(checkpoints.glob("*.partial")):
                return True
            assert proc.poll() is None, "the run ended before a second checkpoint was written"
            return False

        wait_until_sync(writing, timeout_s=90, interval_s=0.001, what="a second checkpoint is being written")
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    seen = sorted(p.name for p in checkpoints.iterdir())
    wait_until_sync(  # the ranks and engine nodes follow their parent
        lambda: not _alive(family),
        timeout_s=15,
        interval_s=0.1,
        what=f"no process of {sorted(family)} is left after the controller was killed",
    )
    return f"killed with {seen}"


def _expected_uses(model_dir: Path, run_dir: Path) -> collections.Counter[tuple[int, int]]:
    """What an uninterrupted run trains: the sampler's first ``STEPS * PROMPTS`` row uses."""
    return uninterrupted_uses(CONFIG, _overrides(run_dir, model_dir, "sync"))


ELSEWHERE = [
    "trainer.world_size=2",
    "cluster.engines=[0, 0]",
]  # another placement: two trainer ranks, two engines


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode, when, placement",
    [
        ("sync", "random", []),
        ("one_step_off", "checkpoint", []),
        ("fully_async", "random", ELSEWHERE),
        ("fully_async", "checkpoint", []),
    ],
)
def test_a_run_killed_and_resumed_trains_every_sample_once(
    tmp_path: Path, nano_model_dir: Path, mode: str, when: str, placement: list[str]
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    overrides = _overrides(tmp_path, nano_model_dir, mode)
    proc = _train(overrides)
    try:
        seen = _kill_when(proc, tmp_path, when, rng)
    finally:
        if proc.poll() is None:
            proc.kill()
    context = (
        f"{mode}, killed at {when} (seed {seed}): {seen}, resumed with {placement or 'the same placement'}"
    )
    resumed = _train([*overrides, *placement], resume=True)
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, f"{context}\n{output}"
    resumed_from = output.split("resumed from ", 1)[-1].split(" ", 1)[0]
    assert resumed_from.startswith(str(tmp_path / "checkpoints" / "step_")) and not resumed_from.endswith(
        ".partial"
    ), f"{context}\n{output}"

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS + 1)), context
    trained = collections.Counter(tuple(use) for r in records for use in r.get("data/rows", []))
    assert trained == _expected_uses(nano_model_dir, tmp_path), context  # none lost, none trained twice
    bound = {"sync": 0, "one_step_off": 1, "fully_async": 1}[mode]
    assert max(len(r.get("async/staleness_token_hist", [0])) - 1 for r in records) <= bound, context
    assert Path(records[-1]["checkpoint"]).name == f"step_{STEPS:06d}", context
    if mode == "fully_async":
        # Its checkpoints before the last step (the one it resumed from, unless it was killed
        # after the last) were taken while the engines had not taken the trainer's newest
        # version yet: they pull it after the step, and nothing waits for them. Their work in
        # flight holds tokens of older versions, and still every sample was trained once. (The
        # last step validates, so the engines take the version before its checkpoint.)
        for folder in sorted((tmp_path / "checkpoints").glob("step_*[0-9]")):
            state = json.loads((folder / "state.json").read_text())
            versions = state["engine_versions"]
            assert versions and (
                state["step"] == STEPS or all(v < state["weight_version"] for v in versions.values())
            ), f"{context}: {folder.name} {versions}, trainer at {state['weight_version']}"


def _interrupt(proc: subprocess.Popen[str], run_dir: Path, *, after_steps: int) -> tuple[str, float]:
    """SIGINT once ``after_steps`` steps are in ``metrics.jsonl`` (0: now); (output, seconds to exit)."""
    metrics = run_dir / "metrics.jsonl"

    def stepped() -> bool:
        if not after_steps or (metrics.is_file() and len(metrics.read_text().splitlines()) > after_steps):
            return True
        assert proc.poll() is None, proc.communicate()[0]
        return False

    wait_until_sync(stepped, timeout_s=120, interval_s=0.05, what=f"{after_steps} steps are in metrics.jsonl")
    family = _descendants(proc.pid)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    wait_until_sync(  # within a second of the controller's exit: it stops its processes itself
        lambda: not _alive(family),
        timeout_s=1.0,
        interval_s=0.05,
        what=f"no process of {sorted(family)} is left after the interrupt\n{output}",
    )
    return output, took


@pytest.mark.timeout(300)
def test_ctrl_c_with_checkpoint_on_interrupt_saves_the_step_and_resumes_without_loss(
    tmp_path: Path, nano_model_dir: Path
) -> None:
    overrides = [
        *_overrides(tmp_path, nano_model_dir, "fully_async"),
        "train.checkpoint_every=0",
        "train.checkpoint_on_interrupt=true",
    ]
    output, took = _interrupt(_train(overrides), tmp_path, after_steps=2)
    assert took < 30 and "Traceback" not in output, output
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and f"resume from its checkpoint {saved[0]}" in output, output
    resumed = _train(overrides, resume=True)
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, output
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    trained = collections.Counter(tuple(use) for r in records for use in r.get("data/rows", []))
    assert trained == _expected_uses(nano_model_dir, tmp_path)


SOAK_S = float(os.environ.get("RLASYNC_SOAK_S", "0"))


@pytest.mark.skipif(not SOAK_S, reason="runs with `make soak` (RLASYNC_SOAK_S set)")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("checkpoint", [False, True])
def test_sigint_at_20_random_moments_stops_a_fully_async_run_within_30_s(
    tmp_path: Path, nano_model_dir: Path, checkpoint: bool
) -> None:
    """From its first instant to its steps, Ctrl-C stops ``rlasync train`` within 30 s, with exit
    code 130, no traceback and no process left (with ``checkpoint_on_interrupt`` too)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for attempt in range(20):
        run_dir = tmp_path / f"run{attempt}"
        overrides = [
            *_overrides(run_dir, nano_model_dir, "fully_async"),
            "train.steps=500",
            f"train.checkpoint_on_interrupt={str(checkpoint).lower()}",
        ]
        proc = _train(overrides)
        at = rng.uniform(0.0, 15.0)
        time.sleep(at)
        output, took = _interrupt(proc, run_dir, after_steps=0)
        context = f"attempt {attempt}, SIGINT {at:.1f} s after the start (seed {seed}): exit {proc.returncode} after {took:.1f} s"
        assert took < 30 and proc.returncode == 130 and "Traceback" not in output, f"{context}\n{output}"


# The quickstart as configs/quickstart_cluster.yaml places it: three node processes, two trainer
# ranks and two engines, each supervised by its node.
CLUSTER = [
    "cluster.engines=[1, 2]",
    "cluster.trainer=[0, 1]",
    "cluster.agent_loops=engines",
    "trainer.world_size=2",
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig, checkpoint_on_interrupt", [(signal.SIGTERM, True), (signal.SIGUSR1, False)])
def test_a_signal_to_every_process_at_once_is_one_interrupt_with_a_checkpoint_and_resume_auto_goes_on(
    tmp_path: Path, nano_model_dir: Path, sig: signal.Signals, checkpoint_on_interrupt: bool
) -> None:
    """What Slurm's scancel or a preemption (SIGTERM), or its time-limit warning (SIGUSR1, which
    checkpoints whatever ``train.checkpoint_on_interrupt`` says), does: the signal to every
    process of a run at once, the nodes' and trainer ranks' too. The nodes defer to the head,
    which ends its step with a checkpoint; every process is gone within
    ``train.interrupt_grace_s`` + 5 s; the same command with ``--resume=auto`` (which started
    the run afresh) trains on from there, and the two parts train exactly the uninterrupted
    run's rows."""
    grace = 30.0
    overrides = [
        *_overrides(tmp_path, nano_model_dir, "fully_async"),
        *CLUSTER,
        "train.checkpoint_every=0",
        f"train.checkpoint_on_interrupt={str(checkpoint_on_interrupt).lower()}",
        f"train.interrupt_grace_s={grace}",
    ]
    # Started from nothing, not forked by the test's spawner: its whole process tree is its own.
    env = {k: v for k, v in os.environ.items() if k != COMMANDS_ENV}
    proc = _train(overrides, resume="auto", env=env)
    metrics = tmp_path / "metrics.jsonl"

    def stepped() -> bool:
        if metrics.is_file() and len(metrics.read_text().splitlines()) > 1:
            return True
        assert proc.poll() is None, proc.communicate()[0]
        return False

    try:
        wait_until_sync(stepped, timeout_s=180, interval_s=0.05, what="step 1 is in metrics.jsonl")
        family = {proc.pid, *_descendants(proc.pid)}
        # the head, 2 nodes, 2 trainer ranks and each node's spawner at least
        assert len(family) >= 7, sorted(family)
        interrupted_at = len(metrics.read_text().splitlines()) - 1
        sent = time.monotonic()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        output, _ = proc.communicate(timeout=grace + 30)
        wait_until_sync(
            lambda: not _alive(family),
            timeout_s=max(0.1, grace + 5 - (time.monotonic() - sent)),
            interval_s=0.1,
            what=f"no process of {sorted(family)} is left within interrupt_grace_s + 5 s\n{output}",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in output, output
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and f"resume from its checkpoint {saved[0]}" in output, output
    assert not verify(saved[0]) and int(saved[0].name.split("_")[1]) >= interrupted_at, (
        saved,
        interrupted_at,
    )

    resumed = _train(overrides, resume="auto")
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0 and f"resumed from {saved[0]}" in output, output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    trained = collections.Counter(tuple(use) for r in records for use in r.get("data/rows", []))
    assert trained == _expected_uses(nano_model_dir, tmp_path)  # none lost, none trained twice
