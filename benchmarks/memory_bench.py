"""Peak training memory with and without activation checkpointing (``trainer.gradient_checkpointing``),
in one run: SmolLM2-135M-Instruct, one training step (forward, backward, AdamW) on a micro-batch of
2,048 tokens (one row: a 1,024-token prompt, a 1,024-token response).

    .venv/bin/python benchmarks/memory_bench.py [--tokens 2048] [--rows 1] [--smoke]

Each configuration runs in a fresh process of its own (``ru_maxrss`` is a process's peak), which
loads the model, takes the step twice (the second: AdamW's state exists, as in every step after
the first) and reports its peak resident memory and its memory before the first step.

Two allocators, each configuration under both. glibc's default keeps much of what is freed (a
freed tensor's pages stay with the process, and its mmap threshold rises to the largest block
freed), so its peak RSS holds the allocator's history as well as the tensors alive at once. With
``MALLOC_MMAP_THRESHOLD_=65536`` every block of 64 KB or more is its own mapping, returned when
freed, so the peak RSS is the peak of the memory in use (what ``torch.cuda.max_memory_allocated``
tells on a GPU): the goal (issue 52, peak training memory checkpointed <= 0.6 of without) is
judged on it, the process's whole peak (weights, gradients and AdamW's state included, which
checkpointing cannot shrink). A third pair runs under ``runtime.allocator=auto`` (tcmalloc where installed), whose peak RSS is what a run's trainer
holds. Last line: JSON ``{"checkpointed_vs_plain_peak_memory", "allocator",
"checkpointed_vs_plain_peak_rss", "checkpointed_vs_plain_peak_rss_default_malloc", "checkpointed_vs_plain_step_s",
"peak_memory_mb", "peak_memory_checkpointed_mb"}`` (step times from the default allocator).
``--smoke`` (what ``make test`` runs): the 0.8M-parameter nano model and 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from rlasync.runtime.allocator import allocator_env, resolve


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(model_dir: str, tokens: int, rows: int, checkpointing: bool) -> None:
    """(a fresh process) Load, step twice, print what memory the step took, as JSON."""
    import torch

    from rlasync.config import TrainerConfig
    from rlasync.models import load_pretrained_dir
    from rlasync.trainer import PolicyTrainer, TrainBatch

    torch.set_num_threads(2)
    model, _ = load_pretrained_dir(model_dir)
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-6, gradient_checkpointing=checkpointing))
    g = torch.Generator().manual_seed(0)
    prompt, response = tokens // 2, tokens - tokens // 2
    vocab = int(model.config.vocab_size)
    mask = torch.ones(rows, response, dtype=torch.long)
    batch = TrainBatch(
        prompts=torch.randint(3, vocab, (rows, prompt), generator=g),
        responses=torch.randint(3, vocab, (rows, response), generator=g),
        response_mask=mask,
        attention_mask=torch.ones(rows, tokens, dtype=torch.long),
        position_ids=torch.arange(tokens).repeat(rows, 1),
        logprobs=-torch.rand(rows, response, generator=g),
        advantages=torch.linspace(-1.0, 1.0, rows) if rows > 1 else torch.ones(1),
    )
    before = _rss_mb()
    times = []
    for _ in range(2):
        started = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"before_mb": before, "peak_mb": peak, "step_s": times[-1]}))


DEFAULT_MALLOC = {"LD_PRELOAD": ""}
"""glibc's malloc as it comes, whatever this process was started under."""
LIVE_MEMORY = {**DEFAULT_MALLOC, "MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc: blocks of 64 KB or more mapped one by one and returned when freed (see the module)."""


def measure(
    model_dir: str, tokens: int, rows: int, checkpointing: bool, env: dict[str, str]
) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", model_dir, str(tokens), str(rows), str(int(checkpointing))],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **env},
    )
    if done.returncode != 0:
        raise SystemExit(
            f"the {'checkpointed' if checkpointing else 'plain'} step failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="the nano model, 256 tokens (make test)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, tokens, rows, checkpointing = args.child
        child(model_dir, int(tokens), int(rows), checkpointing == "1")
        return
    if args.smoke:
        import tempfile

        from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

        model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=0))
        model_dir = str(save_pretrained_dir(model, tok, Path(tempfile.mkdtemp())))
        tokens = 256
    else:
        from rlasync.models import smollm2_dir

        model_dir, tokens = str(smollm2_dir()), args.tokens
    chosen = resolve("auto")
    ours = chosen[0] if chosen else "glibc"
    allocators = (
        ("memory in use", LIVE_MEMORY),
        ("default malloc", DEFAULT_MALLOC),
        (ours, allocator_env("auto")),
    )
    runs = {
        (allocator, checkpointing): measure(model_dir, tokens, args.rows, checkpointing, env)
        for allocator, env in allocators
        for checkpointing in (False, True)
    }
    print(f"SmolLM2-135M, one step on {args.rows} x {tokens} tokens" if not args.smoke else "nano, smoke")
    for (allocator, checkpointing), m in runs.items():
        print(
            f"{allocator:>14}, {'checkpointed' if checkpointing else 'plain':>12}: peak {m['peak_mb']:7.0f} MB "
            f"(before the step {m['before_mb']:5.0f} MB), step {m['step_s']:.2f} s"
        )
    live, default = ("memory in use", True), ("default malloc", True)
    ratio = runs[live]["peak_mb"] / runs["memory in use", False]["peak_mb"]
    result = {
        "checkpointed_vs_plain_peak_memory": ratio,
        "allocator": ours,
        "checkpointed_vs_plain_peak_rss": runs[ours, True]["peak_mb"] / runs[ours, False]["peak_mb"],
        "checkpointed_vs_plain_peak_rss_default_malloc": runs[default]["peak_mb"]
        / runs["default malloc", False]["peak_mb"],
        "checkpointed_vs_plain_step_s": runs[default]["step_s"] / runs["default malloc", False]["step_s"],
        "peak_memory_mb": runs["memory in use", False]["peak_mb"],
        "peak_memory_checkpointed_mb": runs[live]["peak_mb"],
    }
    print(f"peak memory in use, checkpointed/plain: {ratio:.3f} (goal <= 0.6)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
