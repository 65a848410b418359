"""A fully async run killed with SIGKILL and resumed, against the same run uninterrupted, in one run.

    .venv/bin/python benchmarks/resume_bench.py [--every 30] [--seed S] [--smoke]

(a) ``rlasync train configs/quickstart_async.yaml`` (600 steps) with a checkpoint every
    ``--every`` steps, to its end;
(b) the same run killed with SIGKILL at a random step after its first checkpoint, then
    ``rlasync train ... --resume`` to its end.

Both start from the same warm-started model (made once, first). Figures:

- ``samples_lost`` / ``samples_duplicated``: the row uses (``[epoch, row]``, ``data/rows``) the
  resumed run trained, against the uninterrupted run's: missing ones, and ones trained more
  often than there;
- ``checkpoint_s``: median seconds the trainer's loop waits for a checkpoint (``checkpoint/s``:
  until the samples in flight and the trainer's state are taken; the files are written and
  sealed in the background), ``step_s``: median seconds of a step after neither a checkpoint
  nor a validation; ``trainer_wait_per_checkpoint_vs_step`` = their ratio (goal <= 0.2);
- ``step_slowdown_per_checkpoint_vs_step``: how much longer the step after a checkpoint takes
  than ``step_s`` (the wait, plus what the background writes take from the steps running
  meanwhile on a busy machine), over ``step_s``: the whole cost of a checkpoint to training;
- ``redone_steps``: steps between the checkpoint resumed from and the kill (trained again);
- ``wal_append_s_per_step``: what a write-ahead log would cost instead: one fsynced append per
  admission, per finished sample (its trajectories) and per trained batch, measured here on this
  disk with a step's worth of the run's own records;
- final validation accuracies of both runs (goal >= 0.9 each).

Last line, JSON: ``{"samples_lost":…, "samples_duplicated":…, "checkpoint_s":…, "step_s":…,
"trainer_wait_per_checkpoint_vs_step":…, "resumed_final_accuracy":…,
"uninterrupted_final_accuracy":…, …}``. ``--smoke`` (for ``make test``): the nano model untrained,
5 steps, small batches drawn from 64 synthetic problems, killed at step 4; its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart_async.yaml"
DEADLINE_S = 1800.0


def train(
    run_dir: Path, overrides: list[str], *, resume: bool = False, kill_at_step: int = 0
) -> subprocess.CompletedProcess[str] | int:
    """``rlasync train`` to its end (its completed process), or killed with SIGKILL once
    ``metrics.jsonl`` holds step ``kill_at_step`` (the step it was killed at)."""
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "train",
        str(CONFIG),
        f"train.run_dir={run_dir}",
        *overrides,
        *(["--resume"] if resume else []),
    ]
    if not kill_at_step:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S)
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return done
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + DEADLINE_S
    while not (
        metrics.is_file()
        and any(
            json.loads(line)["step"] >= kill_at_step
            for line in metrics.read_text().splitlines()[-3:]
            if line.strip()
        )
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the run ended (or hung) before step {kill_at_step}: {proc.returncode}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return max(json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip())


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trained(run: list[dict[str, Any]]) -> collections.Counter[tuple[int, int]]:
    return collections.Counter(tuple(use) for r in run for use in r.get("data/rows", []))


def wal_append_cost(run_dir: Path, per_step: int, *, repeats: int = 20) -> float:
    """Seconds per step of a write-ahead log: ``per_step`` admissions, as many finished samples
    (each the size of one of this run's samples) and one training record, each appended and
    fsynced, as a log must before the work it records goes on."""
    import msgspec

    from rlasync.modes.rollouter import InFlight

    latest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    in_flight = msgspec.msgpack.decode((latest / "in_flight.msgpack").read_bytes(), type=InFlight)
    sample = next(
        (msgspec.msgpack.encode(s.trajectories) for s in in_flight.samples if s.trajectories), b"x" * 4096
    )
    admission, training = b"a" * 64, b"t" * (16 * per_step)
    path = run_dir / "wal.bin"
    took = []
    with path.open("ab") as log:
        for _ in range(repeats):
            started = time.perf_counter()
            for record in [admission] * per_step + [sample] * per_step + [training]:
                log.write(record)
                log.flush()
                os.fsync(log.fileno())
            took.append(time.perf_counter() - started)
    path.unlink()
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--every", type=int, default=30, help="train.checkpoint_every")
    parser.add_argument("--seed", type=int, default=None, help="the random kill step's seed")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    if args.smoke:
        from rlasync.models import TinyLMConfig, build_tiny_lm

        model_dir = work / "model"
        model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        # A checkpoint every 2 of 5 steps: the kill (below) at the second checkpoint's step,
        # a step after a checkpoint and one after neither for the medians below.
        every, steps = 2, 5
        extra = [
            f"train.steps={steps}",
            "train.prompts_per_step=2",
            "train.group_size=2",
            "train.max_new_tokens=8",
            "train.val_size=4",
            "train.validate_every=100",
            "data.synthetic_train_size=64",  # not 20,000 problems to draw from: ~0.4 s a run to make
        ]
    else:
        import asyncio

        from rlasync.compose.model_dir import model_dir_for
        from rlasync.config import load_config

        print("warm-starting the quickstart's model (once, for both runs)...", flush=True)
        config = load_config(CONFIG, [f"train.run_dir={work / 'warm'}"])
        model_dir = asyncio.run(model_dir_for(config))
        every, steps, extra = args.every, config.train.steps, []
    common = [
        f"train.model_dir={model_dir}",
        f"train.checkpoint_every={every}",
        "train.keep_checkpoints=2",
        *extra,
    ]
    # --smoke's steps are so short that the step after a checkpoint can end before that checkpoint
    # is sealed (nothing to resume from); at the second checkpoint's step the first is sealed (a
    # save waits for the one before it).
    kill_at = 2 * every if args.smoke else random.Random(seed).randint(every + 1, steps - 1)

    print(f"(a) uninterrupted, {steps} steps, a checkpoint every {every}...", flush=True)
    train(work / "whole", common)
    print(f"(b) killed with SIGKILL at step {kill_at} (seed {seed}), then resumed...", flush=True)
    killed_at = train(work / "cut", common, kill_at_step=kill_at)
    resumed_output = train(work / "cut", common, resume=True)
    assert not isinstance(resumed_output, int)
    resumed_from = (
        int(resumed_output.stderr.split("resumed from ", 1)[1].split("step_", 1)[1][:6])
        if "resumed from " in resumed_output.stderr
        else 0
    )

    whole, cut = records(work / "whole"), records(work / "cut")
    expected, got = trained(whole), trained(cut)
    lost, duplicated = sum((expected - got).values()), sum((got - expected).values())
    # A step's step_s runs from the end of the step before it, so the step after a checkpoint
    # carries the time the trainer's loop waited for it and any slowdown its background writes
    # caused: against the median step after neither a checkpoint nor a validation.
    checkpoints = [r["checkpoint/s"] for r in whole if "checkpoint/s" in r and r["step"] != steps]
    after = {"checkpoint": [], "plain": []}
    for before, r in zip(whole[1:], whole[2:]):
        if "val_accuracy" not in before and "step_s" in r:
            after["checkpoint" if "checkpoint" in before else "plain"].append(r["step_s"])
    checkpoint_s, step_s = statistics.median(checkpoints), statistics.median(after["plain"])
    wait_s = statistics.median(after["checkpoint"]) - step_s
    batch = len(whole[1].get("data/rows", [])) or 1
    result = {
        "samples_lost": lost,
        "samples_duplicated": duplicated,
        "checkpoint_s": round(checkpoint_s, 4),
        "step_s": round(step_s, 4),
        "trainer_wait_per_checkpoint_vs_step": round(checkpoint_s / step_s, 3),
        "step_slowdown_per_checkpoint_vs_step": round(wait_s / step_s, 3),
        "resumed_final_accuracy": cut[-1].get("val_accuracy"),
        "uninterrupted_final_accuracy": whole[-1].get("val_accuracy"),
        "killed_at_step": killed_at,
        "resumed_from_step": resumed_from,
        "redone_steps": killed_at - resumed_from,
        "in_flight_at_checkpoint": statistics.median(
            r["checkpoint/in_flight"] for r in whole if "checkpoint/in_flight" in r
        ),
        "wal_append_s_per_step": round(wal_append_cost(work / "whole", batch), 4),
        "seed": seed,
    }
    print(
        f"trained row uses: {sum(expected.values())} uninterrupted, {sum(got.values())} resumed; lost {lost}, duplicated {result['samples_duplicated']}"
    )
    print(
        f"a checkpoint holds the trainer's loop {checkpoint_s:.3f} s: {checkpoint_s / step_s:.2f} of a step ({step_s:.3f} s);"
        f" the step after one takes {wait_s:+.3f} s more, writes in the background included: {wait_s / step_s:.2f} of a step"
    )
    print(
        f"a write-ahead log would cost {result['wal_append_s_per_step']:.4f} s per step ({3 * batch} fsynced appends)"
    )
    print(json.dumps(result))
    if args.smoke:  # its runs are nothing to look at: make test would leave ~30 MB in /tmp each time
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
