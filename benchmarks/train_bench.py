"""Trainer step throughput on the tiny model: the trainer actor with 1 and 2 gloo ranks, and a
plain in-process PyTorch step on the same batch as the reference, in one run.

    .venv/bin/python benchmarks/train_bench.py [--preset nano] [--steps 8] [--smoke]

The batch has the quickstart's shape: 16 prompts x 8 samples, 24-token prompts, responses of
8 to 48 tokens (model tokens counted by the response mask). Each configuration takes
``--warmup`` untimed steps, then ``--steps`` timed ones; throughput is model tokens trained per
second of wall time (forward, backward, gradient all-reduce, AdamW). Every rank and the
reference use one torch thread (``trainer.threads``), so 2 ranks on 2 cores can at best double.
2 ranks run both strategies (``ddp``, ``fsdp2``). Last line: JSON ``{"train_tokens_per_s",
"train_tokens_per_s_2_ranks", "scaling_2_ranks", "scaling_2_ranks_fsdp2", "actor_vs_plain_torch"}``
(``train_tokens_per_s`` is 1 rank), and ``"packed_vs_padded"``: trained tokens/s of padding-free
micro-batches (``trainer.packing``) over padded ones on a long-tailed batch (the quickstart's
shape, responses of 8-16 tokens, every eighth 8x longer), in process on one thread (goal: 1.3x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from rlasync.config import RuntimeConfig, TrainerConfig
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir
from rlasync.runtime.spawner import fork_children
from rlasync.trainer import PolicyTrainer, TrainBatch, TrainerActor


def make_batch(size: int = 128, prompt: int = 24, max_response: int = 48, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 300, (size, prompt), generator=g)
    responses = torch.randint(3, 300, (size, max_response), generator=g)
    lengths = torch.randint(8, max_response + 1, (size,), generator=g)
    mask = (torch.arange(max_response) < lengths[:, None]).long()
    attention = torch.cat([torch.ones(size, prompt, dtype=torch.long), mask], dim=1)
    return TrainBatch(
        prompts=prompts,
        responses=responses * mask,
        response_mask=mask,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        logprobs=-torch.rand(size, max_response, generator=g) * mask,
        advantages=torch.randn(size, generator=g),
    )


async def actor_rate(
    model_dir: Path, batch: TrainBatch, world_size: int, warmup: int, steps: int, strategy: str = "ddp"
) -> float:
    async with TrainerActor(
        TrainerConfig(world_size=world_size, threads=1, lr=1e-5, strategy=strategy)
    ) as trainer:  # type: ignore[arg-type]
        await trainer.start(model_dir)
        for _ in range(warmup):
            await trainer.step(batch)
        started = time.perf_counter()
        for _ in range(steps):
            await trainer.step(batch)
        return float(batch.response_mask.sum()) * steps / (time.perf_counter() - started)


def long_tailed_batch(size: int = 128, prompt: int = 24, seed: int = 0) -> TrainBatch:
    """The quickstart's shape with a long tail: responses of 8 to 16 tokens, every eighth row's
    8x longer, so padding to the longest row makes most of the padded batch padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (size,), generator=g)
    lengths[::8] *= 8
    width = int(lengths.max())
    mask = (torch.arange(width) < lengths[:, None]).long()
    attention = torch.cat([torch.ones(size, prompt, dtype=torch.long), mask], dim=1)
    return TrainBatch(
        prompts=torch.randint(3, 300, (size, prompt), generator=g),
        responses=torch.randint(3, 300, (size, width), generator=g) * mask,
        response_mask=mask,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        logprobs=-torch.rand(size, width, generator=g) * mask,
        advantages=torch.randn(size, generator=g),
    )


def packed_vs_padded(model_dir: Path, batch: TrainBatch, warmup: int, steps: int) -> tuple[float, float]:
    """Trained tokens/s of the padded and the packed step (``trainer.packing``) on one thread,
    in this process, their steps alternating (so load on the machine falls on both alike)."""
    torch.set_num_threads(1)
    trainers = {
        packing: PolicyTrainer(load_pretrained_dir(model_dir)[0], TrainerConfig(lr=1e-5, packing=packing))
        for packing in (False, True)
    }
    spent = dict.fromkeys(trainers, 0.0)
    for i in range(warmup + steps):
        for packing, trainer in trainers.items():
            started = time.perf_counter()
            trainer.step(batch)
            if i >= warmup:
                spent[packing] += time.perf_counter() - started
    tokens = float(batch.response_mask.sum()) * steps
    return tokens / spent[False], tokens / spent[True]


def plain_rate(model_dir: Path, batch: TrainBatch, warmup: int, steps: int) -> float:
    torch.set_num_threads(1)
    trainer = PolicyTrainer(load_pretrained_dir(model_dir)[0], TrainerConfig(lr=1e-5))
    for _ in range(warmup):
        trainer.step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.step(batch)
    return float(batch.response_mask.sum()) * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one step of each on 8 sequences (seconds; the figures mean nothing)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 1, 0
        # The ranks' processes (5) forked from a copy of this one with torch, the trainer and the
        # model's code loaded (as `rlasync train` starts them), not each started from nothing:
        # ~3 s of CPU less apiece. Before any thread exists. A full run starts them from nothing,
        # as it always has.
        fork_children(RuntimeConfig(preload_modules=("rlasync.models.model_code",)))
    # --smoke: 8 sequences, not 128; what remains is mostly the ranks' processes starting.
    batch = make_batch(size=8) if args.smoke else make_batch()
    with tempfile.TemporaryDirectory() as folder:
        model, tokenizer = build_tiny_lm(TinyLMConfig.preset(args.preset, seed=0))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        plain = plain_rate(Path(folder), batch, args.warmup, args.steps)
        one = asyncio.run(actor_rate(Path(folder), batch, 1, args.warmup, args.steps))
        two = asyncio.run(actor_rate(Path(folder), batch, 2, args.warmup, args.steps))
        sharded = asyncio.run(actor_rate(Path(folder), batch, 2, args.warmup, args.steps, strategy="fsdp2"))
        tailed = long_tailed_batch(size=16) if args.smoke else long_tailed_batch()
        padded, packed = packed_vs_padded(Path(folder), tailed, args.warmup, args.steps)
    tokens = int(batch.response_mask.sum())
    print(f"batch: {batch.size} sequences, {tokens} model tokens; preset {args.preset}")
    print(f"plain PyTorch step (1 thread): {plain:9.0f} tokens/s")
    print(f"trainer actor, 1 rank:         {one:9.0f} tokens/s  ({one / plain:.2f}x plain)")
    print(f"trainer actor, 2 ranks:        {two:9.0f} tokens/s  ({two / one:.2f}x 1 rank)")
    print(f"trainer actor, 2 ranks FSDP2:  {sharded:9.0f} tokens/s  ({sharded / one:.2f}x 1 rank)")
    real = int(tailed.attention_mask.sum())
    print(
        f"long-tailed batch ({tailed.size} rows, {real} real tokens of {tailed.attention_mask.numel()} padded): "
        f"padded {padded:.0f} tokens/s, packed {packed:.0f} tokens/s ({packed / padded:.2f}x, goal >= 1.3x)"
    )
    print(
        json.dumps(
            {
                "train_tokens_per_s": round(one, 1),
                "train_tokens_per_s_2_ranks": round(two, 1),
                "scaling_2_ranks": round(two / one, 3),
                "scaling_2_ranks_fsdp2": round(sharded / one, 3),
                "actor_vs_plain_torch": round(one / plain, 3),
                "packed_vs_padded": round(packed / padded, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
