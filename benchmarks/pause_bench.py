"""What a weight version costs the engines: each engine taking it at its own step (``keep``,
``drain``) against the old global pause (``async_training.commit=together``), in one run.

    .venv/bin/python benchmarks/pause_bench.py [--steps 12] [--repeats 2] [--smoke]

Every run is ``configs/quickstart_async.yaml`` (the reverse task from its warm-started model,
trained once and cached for the whole run) with two engines in the head's process decoding
throughout, a weight version after every step, one prompt (8 samples) a step and turns of
``--tokens`` tokens (``train.ignore_eos``), each longer than a step, so that every sync lands in
the middle of running turns and a drain has to wait for them. The controller
and both engines run on core 0, the trainer's rank on core 1. Variants, alternated
``--repeats`` times (the medians are reported):

- ``keep``: each engine takes the version at its own decode step; running turns go on with
  their KV cache (``async_training.interrupt=keep``, the default);
- ``drain``: each engine admits nothing new until its running turns end, then swaps (half the
  engines at a time, so the others decode meanwhile);
- ``old``: every engine stops for the whole transfer, running turns cut
  (``commit=together, interrupt=abort``: this project's behaviour before).

Per variant, from the steps after the first two (``metrics.jsonl``): engine decode-seconds lost
per version and engine (``weights/engine_idle_s`` / engines) ÷ the transfer
(``weights/transfer_s``: the relay's copy and the slowest pull, or the whole old sync);
re-prefilled tokens ÷ generated tokens; samples per second of wall time;
and the versions at which every engine was paused at one instant (``weights/all_paused``).

Last line JSON: ``{"idle_per_version_vs_transfer_new", "idle_per_version_vs_transfer_old",
"reprefill_fraction_keep", "samples_per_s_keep_vs_drain", "samples_per_s_new_vs_old",
"all_paused_instants"}`` (the last: keep's and drain's runs together). Goals (issue 48): idle ≤ 0.01
of the transfer, re-prefill ≤ 0.01 with keep, keep ≥ 1.2× drain, no instant with every engine
paused.

On this machine the two engines share one core: what one loses while it stands still, the
other partly gains, so the samples/s ratios understate a GPU's (whose step costs about the same
at any batch; ``benchmarks/modes_bench.py`` models that). With turns shorter than a step
(``--prompts 8 --tokens 256``) keep, drain and the old pause come out equal here.

``--smoke`` (for ``make test``; its figures mean nothing): an untrained model, 3 steps of short
turns, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = 2
WARMUP = 2  # steps left out: the pipeline filling
VARIANTS: dict[str, list[str]] = {
    "keep": ["async_training.interrupt=keep", "async_training.commit=each"],
    "drain": ["async_training.interrupt=drain", "async_training.commit=each"],
    "old": ["async_training.interrupt=abort", "async_training.commit=together"],
}


def run(variant: str, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One training run of ``variant``; its figures from ``metrics.jsonl``."""
    overrides = [
        f"cluster.engines={[0] * ENGINES}",
        f"train.model_dir={model_dir}",
        f"train.run_dir={out}",
        f"train.steps={args.steps}",
        f"train.prompts_per_step={args.prompts}",
        "train.ignore_eos=true",
        f"train.max_new_tokens={args.tokens}",
        f"agent.response_length={args.tokens + 32}",
        f"engine.max_batch={args.max_batch}",
        "train.validate_every=100000",
        "train.val_size=4",
        *VARIANTS[variant],
    ]
    command = [
        "taskset", "-c", "0",  # the controller and the engines; the trainer's rank: trainer.cpu_affinity
        sys.executable, "-m", "rlasync", "train", str(ROOT / "configs" / "quickstart_async.yaml"), *overrides,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    )
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) > 0]
    counted = steps[WARMUP:] or steps
    return figures(counted, args.prompts)


def figures(records: list[dict[str, Any]], prompts: int) -> dict[str, float]:
    # The version's way to the engines: released, the relay's copy and the slowest pull (the
    # trainer waited only for the first: weights/sync_s); the old pause, the whole sync.
    transfer = sum(r.get("weights/transfer_s") or r.get("weights/sync_s") or 0.0 for r in records)
    idle = sum(r.get("weights/engine_idle_s") or 0.0 for r in records) / ENGINES
    generated = sum(r["response_tokens"] for r in records)
    return {
        "idle_per_version_vs_transfer": idle / max(transfer, 1e-12),
        "reprefill_fraction": sum(r.get("weights/reprefill_tokens") or 0 for r in records)
        / max(generated, 1),
        "samples_per_s": prompts * len(records) / sum(r["step_s"] for r in records),
        "all_paused_instants": float(sum(r.get("weights/all_paused") or 0 for r in records)),
        "partial_samples": float(sum(r.get("async/partial_samples") or 0 for r in records)),
        "versions": float(len(records)),
    }


def model(tmp: Path, smoke: bool) -> Path:
    """The quickstart's warm-started model (an untrained one with ``smoke``)."""
    from rlasync.compose.warmstart import warm_start
    from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

    if smoke:
        return Path(save_pretrained_dir(*build_tiny_lm(TinyLMConfig.preset("nano", seed=0)), tmp / "nano"))
    return Path(warm_start("reverse", run_dir=tmp, seed=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=1, help="train.prompts_per_step")
    parser.add_argument("--tokens", type=int, default=768, help="every turn's length")
    parser.add_argument("--max-batch", type=int, default=32, help="engine.max_batch")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.prompts, args.tokens = 3, 1, 2, 16

    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model(Path(tmp), args.smoke)
        for repeat in range(args.repeats):
            for name in VARIANTS:
                figures_ = run(name, model_dir, Path(tmp) / f"{name}-{repeat}", args)
                results[name].append(figures_)
                print(
                    f"  {name:5s} run {repeat + 1}: "
                    + ", ".join(f"{k} {v:.4g}" for k, v in figures_.items()),
                    flush=True,
                )

    med = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()
    }
    print(f"\n{ENGINES} engines, {args.steps} steps ({WARMUP} left out), turns of {args.tokens} tokens, "
          f"{args.prompts} prompts a step, medians of {args.repeats}")  # fmt: skip
    print(
        f"{'variant':8s} {'idle/transfer':>14s} {'reprefill':>10s} {'samples/s':>10s} {'all paused':>11s} {'partial':>8s}"
    )
    for name, m in med.items():
        print(
            f"{name:8s} {m['idle_per_version_vs_transfer']:14.4f} {m['reprefill_fraction']:10.4f} "
            f"{m['samples_per_s']:10.3f} {m['all_paused_instants']:11.0f} {m['partial_samples']:8.0f}"
        )
    keep, drain, old = med["keep"], med["drain"], med["old"]
    print(
        json.dumps(
            {
                "idle_per_version_vs_transfer_new": keep["idle_per_version_vs_transfer"],
                "idle_per_version_vs_transfer_old": old["idle_per_version_vs_transfer"],
                "reprefill_fraction_keep": keep["reprefill_fraction"],
                "samples_per_s_keep_vs_drain": keep["samples_per_s"] / drain["samples_per_s"],
                "samples_per_s_new_vs_old": keep["samples_per_s"] / old["samples_per_s"],
                "all_paused_instants": int(
                    sum(r["all_paused_instants"] for name in ("keep", "drain") for r in results[name])
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
