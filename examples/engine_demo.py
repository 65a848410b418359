"""Engines on two nodes answering chat prompts, before and after a warm-start.

    .venv/bin/python examples/engine_demo.py [--run-dir runs/demo] [--seed 0]

1. Builds a tiny Qwen2 model (0.8M parameters) and its BPE tokenizer in code, and saves it.
2. Warm-starts a copy by supervised training on the calculator task (about a minute on 2
   cores; cached under ``--run-dir``, so the next run skips it).
3. Starts a 2-node local cluster (this process and one node process), hosts one
   ``EngineActor`` per model per node, and puts a ``Router`` in front of each pair.
4. Asks both models the same held-out questions through the router: the fresh model
   babbles; the warm-started one calls the calculator tool (the demo runs the tool and
   hands back the result) and answers, often right, sometimes wrong: what RL then sharpens.
   Every conversation is a ``ToolAgentLoop`` trajectory, token for token what the model saw.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

import rlasync
from rlasync.agents import ToolAgentLoop
from rlasync.compose.warmstart import load_summary, warm_start
from rlasync.config import AgentConfig
from rlasync.data import loop_reward, make_problems
from rlasync.engines import EngineActor, EngineConfig, Router, SamplingParams
from rlasync.models import TinyLMConfig, build_tiny_lm, load_pretrained_dir, save_pretrained_dir
from rlasync.tools import build_tools

QUESTIONS = 6  # shown in full
HELD_OUT = 64  # scored


async def ask(router: Router, tokenizer: object, label: str, problems: list, seed: int) -> None:
    started = time.perf_counter()
    tools = build_tools(["calculator"])
    config = AgentConfig(tools=["calculator"], max_assistant_turns=3)
    loops = [
        ToolAgentLoop(
            router,
            tokenizer,
            config,
            tools=tools,
            reward_fn=loop_reward("calc"),
            trajectory_id=f"{label}-{i}",
        )
        for i in range(len(problems))
    ]
    greedy = SamplingParams(temperature=0, max_new_tokens=40)
    episodes = await asyncio.gather(
        *[loop.run(greedy, messages=p.messages, problem=p) for loop, p in zip(loops, problems)]
    )
    elapsed = time.perf_counter() - started
    print(f"\n== {label} model ==")
    for problem, episode in list(zip(problems, episodes))[:QUESTIONS]:
        text = tokenizer.decode(episode.response_ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        first_turn = repr(text.split("<|im_end|>")[0])
        first_turn = first_turn if len(first_turn) <= 90 else first_turn[:87] + "..."
        mark = "right" if episode.reward else "wrong"
        print(f"  user: {problem.messages[-1]['content']}  (answer {problem.answer})")
        if episode.metrics.tool_calls:
            print(
                f"    model: {first_turn} -> the calculator runs -> model: {episode.messages[-1]['content']!r}  [{mark}]"
            )
        else:
            print(f"    model: {first_turn}  [{mark}]")
    correct = sum(e.reward for e in episodes)
    used = sum(1 for e in episodes if e.metrics.tool_calls)
    tokens = sum(sum(e.response_mask) for e in episodes)
    print(
        f"  {label}: {correct:.0f}/{len(episodes)} held-out questions right, {used} used the calculator; "
        f"{tokens} tokens generated in {elapsed:.2f} s"
    )


async def serve(fresh_dir: Path, tuned_dir: Path, seed: int) -> None:
    config = rlasync.RuntimeConfig(preload_modules=("rlasync.engines",))
    _, tokenizer = load_pretrained_dir(tuned_dir)
    problems = make_problems("calc", HELD_OUT, seed=seed, split="val")
    async with rlasync.LocalCluster(nodes=2, config=config) as cluster:
        print(f"cluster of 2 nodes up in {cluster.start_seconds:.2f} s")
        for label, folder in (("fresh", fresh_dir), ("warm-started", tuned_dir)):
            engines = [
                await cluster.spawn(
                    EngineActor,
                    EngineConfig(model=str(folder), max_batch=64),
                    node=node,
                    name=f"{label}-engine-{node}",
                )
                for node in (0, 1)
            ]
            async with Router(engines) as router:
                await ask(router, tokenizer, label, problems, seed)
                load = ", ".join(
                    f"{e.name} on {e.node}: {e.assigned} requests" for e in router.stats().engines
                )
                print(f"  router: {load}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run_dir = Path(args.run_dir)

    fresh_dir = run_dir / "fresh-nano"
    if not (fresh_dir / "config.json").is_file():
        model, tokenizer = build_tiny_lm(TinyLMConfig.preset("nano", seed=args.seed))
        save_pretrained_dir(model, tokenizer, fresh_dir)
    print(f"fresh tiny model (Qwen2, 0.8M parameters, vocab 384): {fresh_dir}")

    started = time.perf_counter()
    tuned_dir = warm_start("calc", run_dir=run_dir, seed=args.seed)
    summary = load_summary(tuned_dir)
    cached = "cached" if time.perf_counter() - started < summary.seconds / 2 else "trained now"
    print(
        f"warm-started on the calculator task ({cached}): {summary.steps} steps, {summary.seconds:.0f} s; "
        f"held-out greedy accuracy {summary.greedy_accuracy:.2f}, sampled {summary.sampled_accuracy:.2f}: {tuned_dir}"
    )
    rlasync.run(serve(fresh_dir, tuned_dir, args.seed))


if __name__ == "__main__":
    main()
