"""Continuous batching vs static batches: the torch engine vs transformers' generate, one run.

    .venv/bin/python benchmarks/engine_bench.py [--preset nano] [--batch 32] [--smoke]

Same tiny model, same 256 prompts, long-tail output lengths (max_new_tokens log-normal,
median 32, p99 256, end-of-sequence ignored so both produce exactly the tokens asked
for). (a) ``model.generate`` in static batches of ``--batch`` prompts, each batch running to
its longest request; (b) ``TorchEngine`` with up to ``--batch`` rows, refilled as requests
finish. (c) vLLM (CPU build) on the same prompts with the same row limit, when ``make
setup-vllm``'s environment exists (it runs in a child process with that environment's
Python; start-up and the first, compiling request are not timed). Tokens/s counts the
tokens requested, for all. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from rlasync.engines import GenerateRequest, SamplingParams, TorchEngine
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir

PROMPTS = 256
LONGEST = 256  # the most tokens a request asks for


def workload(tok: object, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    sigma = math.log(256 / 32) / 2.326  # p99 = 256 for a median of 32
    lengths = [max(1, min(LONGEST, round(32 * math.exp(rng.gauss(0, sigma))))) for _ in range(PROMPTS)]
    words = ["Reverse", "What is", "hello", "tool", "abc", "12+34", "calc", "the answer"]
    prompts = [
        tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))) for _ in range(PROMPTS)
    ]  # type: ignore[attr-defined]
    return prompts, lengths


def bench_hf(model: object, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, wants = prompts[i : i + batch], lengths[i : i + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, p in enumerate(group):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(wants),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )  # type: ignore[attr-defined]
    return time.perf_counter() - start


def _fmt(runs: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in runs) + " s"


async def bench_engine(
    model: object, prompts: list[list[int]], lengths: list[int], batch: int, threads: int = 1
) -> float:
    return await _timed(TorchEngine(model, max_batch=batch, cpu_threads=threads), prompts, lengths)


async def _timed(engine: object, prompts: list[list[int]], lengths: list[int]) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(
        *[
            engine.generate(
                GenerateRequest(
                    request_id=f"{start}-{i}",
                    prompt_ids=p,
                    params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
                )
            )  # type: ignore[attr-defined]
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
    )
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == lengths
    await engine.close()  # type: ignore[attr-defined]
    return elapsed


def vllm_child(model_dir: str, batch: int, repeats: int) -> None:
    """(In the vLLM environment) time vLLM on the same workload; print {"vllm_s": best}."""
    from rlasync.config import VLLMEngineConfig
    from rlasync.engines.vllm import VLLMEngine

    _, tok = load_pretrained_dir(model_dir)
    prompts, lengths = workload(tok)

    async def run() -> list[float]:
        engine = await VLLMEngine.create(VLLMEngineConfig(model=model_dir, max_batch=batch, max_seq_len=1024))
        engine.close = _no_close  # type: ignore[method-assign]  # one engine for every run
        await _timed(engine, prompts[:8], [4] * 8)  # warm-up: vLLM compiles on its first requests
        runs = [await _timed(engine, prompts, lengths) for _ in range(repeats)]
        await VLLMEngine.close(engine)
        return runs

    print(json.dumps({"vllm_runs": asyncio.run(run())}))


async def _no_close() -> None:
    return None


def bench_vllm(python: Path, model: object, tok: object, batch: int, repeats: int) -> list[float] | None:
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained_dir(model, tok, folder)
        cmd = [
            str(python),
            __file__,
            "--vllm-child",
            folder,
            "--batch",
            str(batch),
            "--repeats",
            str(repeats),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print(
            f"vLLM run failed (exit {done.returncode}); its last output:\n{done.stderr[-2000:]}",
            file=sys.stderr,
        )
        return None
    runs: list[float] = json.loads(done.stdout.strip().splitlines()[-1])["vllm_runs"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="nano", choices=sorted(TinyLMConfig.PRESETS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating; the best counts")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="the engine's cpu_threads (its default: 1)"
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python",
    )
    parser.add_argument("--vllm-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="8 prompts of up to 16 tokens, one run each, vLLM left out (seconds; the figures mean nothing)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.smoke:
        global PROMPTS, LONGEST
        PROMPTS, LONGEST, args.repeats, args.vllm_python = 8, 16, 1, Path("/nonexistent/left-out-of-smoke")
        # One torch thread for generate: with two, on cores that make test's other workers keep
        # busy, the threads wait on each other (a smoke run took 49 s instead of 7).
        torch.set_num_threads(1)
    if args.vllm_child:
        vllm_child(args.vllm_child, args.batch, args.repeats)
        return
    model, tok = build_tiny_lm(TinyLMConfig.preset(args.preset))
    prompts, lengths = workload(tok)
    tokens = sum(lengths)
    bench_hf(model, prompts[:8], lengths[:8], args.batch)  # warm-up both paths
    asyncio.run(bench_engine(model, prompts[:8], [4] * 8, args.batch, args.engine_threads))
    # Alternate the two, --repeats times each, and keep each one's best run: the machine is
    # shared, and a burst of load should not decide the ratio.
    hf_runs, engine_runs = [], []
    for _ in range(args.repeats):
        hf_runs.append(bench_hf(model, prompts, lengths, args.batch))
        engine_runs.append(
            asyncio.run(bench_engine(model, prompts, lengths, args.batch, args.engine_threads))
        )
    hf_s, engine_s = min(hf_runs), min(engine_runs)
    hf_rate, engine_rate = tokens / hf_s, tokens / engine_s
    print(
        f"model {args.preset}, {PROMPTS} prompts, {tokens} tokens (median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}), batch {args.batch}"
    )
    print(
        f"transformers generate, static batches: {hf_s:6.2f} s  {hf_rate:8.0f} tokens/s  ({torch.get_num_threads()} torch threads; runs {_fmt(hf_runs)})"
    )
    print(
        f"rlasync torch engine, continuous:      {engine_s:6.2f} s  {engine_rate:8.0f} tokens/s  ({args.engine_threads} worker thread(s); runs {_fmt(engine_runs)})"
    )
    result: dict[str, object] = {
        "engine_tokens_per_s": round(engine_rate),
        "hf_tokens_per_s": round(hf_rate),
        "vs_hf_generate": round(engine_rate / hf_rate, 3),
    }
    vllm_runs = (
        bench_vllm(args.vllm_python, model, tok, args.batch, args.repeats)
        if args.vllm_python.exists()
        else None
    )
    if vllm_runs:
        vllm_rate = tokens / min(vllm_runs)
        print(
            f"vLLM (CPU build), continuous:          {min(vllm_runs):6.2f} s  {vllm_rate:8.0f} tokens/s  (runs {_fmt(vllm_runs)})"
        )
        result.update(vllm_tokens_per_s=round(vllm_rate), engine_vs_vllm=round(engine_rate / vllm_rate, 3))
    else:
        print(f"vLLM: not measured ({args.vllm_python} missing or failed; `make setup-vllm` builds it)")
        result.update(vllm_tokens_per_s=None, engine_vs_vllm=None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
