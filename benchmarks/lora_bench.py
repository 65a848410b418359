"""Full fine-tuning against LoRA rank 16, in one run: SmolLM2-135M-Instruct on the times-table config
(``configs/smollm2_arith.yaml``).

    .venv/bin/python benchmarks/lora_bench.py [--steps 10] [--lora-lr 1e-4] [--out runs/lora_bench] [--smoke]

Four measures, each configuration in a fresh process of its own (``ru_maxrss`` is a process's peak):

- the trainer's peak resident memory and its step time, over four steps on a batch shaped as
  the config's (64 rows, 2,048-token micro-batches), the step time the mean of the last three,
  under the allocator a run's processes take (``runtime.allocator=auto``: tcmalloc where
  installed, ``rlasync.runtime.allocator``): the goal and the step times are judged there. Two
  more peaks under glibc's malloc, as in ``memory_bench.py``: its default, which also holds what
  it kept of freed blocks (peft's adapted layers, three more temporaries each, freed at once,
  leave it holding far more: 6.6 GB against 3.4 GB in use), and with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of 64 KB or more mapped alone and returned when
  freed), whose peak RSS is the peak of the memory in use;
- the bytes one weight sync sends: the plan the trainer builds (``weight_layout``), the whole
  model or, with ``trainer.lora.sync: adapter``, the adapters alone;
- how the torch engine decodes when the adapters are applied on the fly (the peft model in the
  engine) against merged into its weights (what ``rlasync.weights.adapters`` does): tokens/s;
- the held-out gain: ``rlasync train`` on the config, full (its ``trainer.lr``) then LoRA
  (``--lora-lr``), ``--steps`` each, validated every ``--validate-every``; each run's gain is
  its held-out greedy accuracy at its last validation within the shorter run's wall time, less
  its accuracy at step 0.

Last line JSON ``{"allocator", "lora_vs_full_sync_bytes", "lora_vs_full_peak_rss",
"lora_vs_full_peak_rss_glibc", "lora_vs_full_peak_in_use", "lora_vs_full_step_s",
"lora_heldout_gain", "full_heldout_gain", "on_the_fly_vs_merged_decode"}``; the goals (issue 52):
sync bytes <= 0.05 of full, peak memory <= 0.7, LoRA's gain >= 0.15 within 30 minutes.
``--smoke`` (what ``make test`` runs): the nano model on the quickstart config, two steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from memory_bench import DEFAULT_MALLOC, LIVE_MEMORY  # glibc as it comes; glibc returning what is freed

from rlasync.runtime.allocator import allocator_env, resolve

ROOT = Path(__file__).resolve().parents[1]
ARITH = ROOT / "configs" / "smollm2_arith.yaml"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
RANK, ALPHA = 16, 32


def child_trainer(model_dir: str, lora: bool, rows: int, prompt: int, response: int) -> None:
    """(a fresh process) Four steps of the config's trainer, full or LoRA: peak RSS, step time
    and the bytes a weight sync sends, as JSON."""
    import torch

    from rlasync.config import TrainerConfig, load_config
    from rlasync.config.train import LoraSettings
    from rlasync.models import load_pretrained_dir
    from rlasync.trainer import PolicyTrainer, TrainBatch
    from rlasync.weights import plan_buckets

    torch.set_num_threads(2)
    base = load_config(ARITH).trainer
    settings = LoraSettings(rank=RANK, alpha=ALPHA) if lora else LoraSettings()
    config = TrainerConfig(lr=base.lr, micro_batch_tokens=base.micro_batch_tokens, lora=settings)
    model, _ = load_pretrained_dir(model_dir)
    trainer = PolicyTrainer(model, config)
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    tokens = prompt + response
    batch = TrainBatch(
        prompts=torch.randint(3, vocab, (rows, prompt), generator=g),
        responses=torch.randint(3, vocab, (rows, response), generator=g),
        response_mask=torch.ones(rows, response, dtype=torch.long),
        attention_mask=torch.ones(rows, tokens, dtype=torch.long),
        position_ids=torch.arange(tokens).repeat(rows, 1),
        logprobs=-torch.rand(rows, response, generator=g),
        advantages=torch.linspace(-1.0, 1.0, rows),
    )
    times = []
    for _ in range(4):
        started = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - started)
    plan = plan_buckets(trainer.weight_layout(), 64 << 20, lora_scale=trainer.sync_scale)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"peak_mb": peak, "step_s": sum(times[1:]) / 3, "sync_bytes": plan.total_bytes}))


def child_decode(model_dir: str, on_the_fly: bool, rows: int, prompt: int, response: int) -> None:
    """(a fresh process) The torch engine decoding ``rows`` sequences with a trained-looking
    adapter, applied on the fly (the peft model) or merged into the weights: tokens/s, as JSON."""
    import torch

    from rlasync.config.train import LoraSettings
    from rlasync.engines import GenerateRequest, SamplingParams, TorchEngine
    from rlasync.models import load_pretrained_dir
    from rlasync.trainer import lora

    torch.set_num_threads(2)
    model, _ = load_pretrained_dir(model_dir)
    adapted = lora.wrap(model, LoraSettings(rank=RANK, alpha=ALPHA))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:  # B starts at zero, which a merge would make free
                p.normal_(0, 1e-3)
    if not on_the_fly:
        adapted = adapted.merge_and_unload()
    engine = TorchEngine(adapted.eval())
    vocab = int(model.config.vocab_size)
    prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(prompt)] for i in range(rows)]

    async def run() -> float:
        params = SamplingParams(temperature=1.0, max_new_tokens=response, ignore_eos=True, seed=0)
        await engine.generate(GenerateRequest(request_id="warm", prompt_ids=prompts[0], params=params))
        started = time.perf_counter()
        outs = await asyncio.gather(
            *[
                engine.generate(GenerateRequest(request_id=f"r{i}", prompt_ids=p, params=params))
                for i, p in enumerate(prompts)
            ]
        )
        elapsed = time.perf_counter() - started
        await engine.close()
        return sum(len(o.token_ids) for o in outs) / elapsed

    print(json.dumps({"tokens_per_s": asyncio.run(run())}))


def _child(*args: str, env: dict[str, str] | None = None) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} ({args[2]}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def train(config: Path, run_dir: Path, overrides: list[str]) -> list[tuple[float, float]]:
    """``rlasync train`` afresh in ``run_dir``: its held-out accuracies, as (seconds, accuracy)."""
    command = [sys.executable, "-m", "rlasync", "train", str(config), f"train.run_dir={run_dir}", *overrides]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["elapsed_s"], r["val_accuracy"]) for r in records if r.get("val_accuracy") is not None]


def gain_within(curve: list[tuple[float, float]], seconds: float) -> float:
    """The accuracy at the last validation within ``seconds``, less the one at step 0 (0 when
    the run had not validated again by then: the start's validation can itself end later than
    ``seconds`` on a loaded machine)."""
    within = [(t, acc) for t, acc in curve if t <= seconds] or curve[:1]
    return max(within)[1] - curve[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--validate-every", type=int, default=5)
    parser.add_argument(
        "--lora-lr", type=float, default=1e-4, help="LoRA's learning rate (full: the config's)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "lora_bench")
    parser.add_argument("--smoke", action="store_true", help="the nano model, two steps (make test)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, model_dir, flag, rows, prompt, response = args.child
        run = child_trainer if kind == "trainer" else child_decode
        run(model_dir, flag == "1", int(rows), int(prompt), int(response))
        return
    if args.smoke:
        import tempfile

        from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir

        model, tok = build_tiny_lm(TinyLMConfig.preset("nano", seed=0))
        args.out = Path(tempfile.mkdtemp())
        model_dir = str(save_pretrained_dir(model, tok, args.out / "model"))
        config, shape = QUICKSTART, ("8", "16", "8")
        common = [f"train.model_dir={model_dir}", "train.prompts_per_step=4", "train.group_size=2"]
        common += ["train.max_new_tokens=8", "train.val_size=8", "train.validate_every=1", "train.steps=2"]
    else:
        data = ROOT / "runs" / "smollm2_arith"
        if not (data / "val.jsonl").is_file() or not (data / "model" / "config.json").is_file():
            subprocess.run(
                [sys.executable, str(ROOT / "examples" / "smollm2_arith.py")], check=True, cwd=ROOT
            )
        model_dir, config, shape = str(data / "model"), ARITH, ("64", "40", "24")
        common = [f"train.steps={args.steps}", f"train.validate_every={args.validate_every}"]
        common += ["train.checkpoint_every=0", "train.trace_every=0"]
    allocator = resolve("auto")  # what runtime.allocator=auto gives a run's processes here
    runs_under = allocator_env("auto")
    trainer = {
        lora: _child("trainer", model_dir, str(int(lora)), *shape, env=runs_under) for lora in (False, True)
    }
    glibc = {
        lora: _child("trainer", model_dir, str(int(lora)), *shape, env=DEFAULT_MALLOC)
        for lora in (False, True)
    }
    in_use = {
        lora: _child("trainer", model_dir, str(int(lora)), *shape, env=LIVE_MEMORY) for lora in (False, True)
    }
    decode = {fly: _child("decode", model_dir, str(int(fly)), *shape) for fly in (False, True)}
    full = train(config, args.out / "full", common)
    lora = train(
        config,
        args.out / "lora",
        [*common, f"trainer.lora.rank={RANK}", f"trainer.lora.alpha={ALPHA}"]
        + [f"trainer.lr={args.lora_lr}"],
    )
    seconds = min(full[-1][0], lora[-1][0])
    result = {
        "allocator": allocator[0] if allocator else "glibc",
        "lora_vs_full_sync_bytes": trainer[True]["sync_bytes"] / trainer[False]["sync_bytes"],
        "lora_vs_full_peak_rss": trainer[True]["peak_mb"] / trainer[False]["peak_mb"],
        "lora_vs_full_peak_rss_glibc": glibc[True]["peak_mb"] / glibc[False]["peak_mb"],
        "lora_vs_full_peak_in_use": in_use[True]["peak_mb"] / in_use[False]["peak_mb"],
        "lora_vs_full_step_s": trainer[True]["step_s"] / trainer[False]["step_s"],
        "lora_heldout_gain": gain_within(lora, seconds),
        "full_heldout_gain": gain_within(full, seconds),
        "on_the_fly_vs_merged_decode": decode[True]["tokens_per_s"] / decode[False]["tokens_per_s"],
    }
    name = "nano, smoke" if args.smoke else "SmolLM2-135M-Instruct, configs/smollm2_arith.yaml"
    print(f"{name}: full fine-tuning vs LoRA rank {RANK} (alpha {ALPHA})")
    for label, adapted in (("full", False), ("lora", True)):
        m = trainer[adapted]
        print(
            f"  {label}: peak RSS {m['peak_mb']:7.0f} MB under {result['allocator']}, step {m['step_s']:.2f} s "
            f"(glibc: {glibc[adapted]['peak_mb']:7.0f} MB, step {glibc[adapted]['step_s']:.2f} s; in use "
            f"{in_use[adapted]['peak_mb']:7.0f} MB), sync {m['sync_bytes'] / 2**20:8.2f} MB"
        )
    for label, curve in (("full", full), ("lora", lora)):
        points = ", ".join(f"{acc:.3f} at {t:.0f} s" for t, acc in curve)
        print(f"  {label} held-out accuracy: {points}")
    print(
        f"  torch engine decode, adapters on the fly: {decode[True]['tokens_per_s']:.0f} tok/s, "
        f"merged: {decode[False]['tokens_per_s']:.0f} tok/s"
    )
    print(
        f"sync bytes {result['lora_vs_full_sync_bytes']:.4f} (goal <= 0.05), peak RSS "
        f"{result['lora_vs_full_peak_rss']:.3f} under {result['allocator']} (goal <= 0.7; glibc's "
        f"{result['lora_vs_full_peak_rss_glibc']:.3f}, in use {result['lora_vs_full_peak_in_use']:.3f}), "
        f"held-out gain within {seconds:.0f} s: LoRA "
        f"{result['lora_heldout_gain']:+.3f} (goal >= 0.15), full {result['full_heldout_gain']:+.3f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
