"""The agent loop's own cost per turn, next to the chat-template tokenisation it must do, one run.

    .venv/bin/python benchmarks/agent_bench.py [--trajectories 2000] [--smoke]

2,000 ``ToolAgentLoop`` trajectories run concurrently on one event loop (uvloop) against an
engine that answers at once with scripted turns, whole: three calculator calls, then an answer
(4 model turns, 3 tool turns each). Then, in the same run, the tokenisation the loop cannot
avoid is timed: rendering and encoding the prompt, decoding each model turn, rendering and
encoding what the chat template puts after it (timed inside the run, and also alone for
reference). The loop's overhead per turn is the wall time per model turn minus that
tokenisation time (it includes parsing, running the calculator, the state machine, and the
scripted engine's own answer). The goal is ``overhead_vs_tokenize`` <= 1.0.

Then both tool-call parsers read adversarial model turns (``ADVERSARIAL``: the same malformed
or degenerate block repeated, e.g. 1 MB of ``<tool_call>x</tool_call>`` or of ``<|start|>``) of
10 KB, 100 KB and 1 MB; per size, the fastest of five parses. Reported: the worst milliseconds
per MB over every input and size (goal <= 50); the worst growth from 100 KB to 1 MB (linear is
10x; goal <= 12x; over the inputs whose 1 MB parse takes 1 ms or more: below that the timer
decides; an input read only up to the parser's per-turn caps grows less than 10x); and, for scale, the worst input's parse time against decoding its tokens
(``tokenizer.decode``, which the loop does for every model turn anyway). Last line: JSON
``{"turns_per_s", "overhead_us_per_turn", "overhead_vs_tokenize", "parser_ms_per_mb_worst",
"parser_growth_worst", "parser_worst_input", "parser_vs_decode"}``. ``--smoke`` runs 50
trajectories and parses 10 KB and 100 KB once (for ``make test``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from rlasync.agents import ChatTurns, ToolAgentLoop
from rlasync.config import AgentConfig
from rlasync.engines import GenerateOutput, GenerateRequest, SamplingParams, TokenChunk
from rlasync.models import build_tokenizer
from rlasync.tools import HermesParser, ToolResult, build_tools, get_parser

QUESTION = [{"role": "user", "content": "What is ((12*7)+5)*3?"}]
TURNS = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "84+5"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "89*3"}}</tool_call>',
    "267",
]


class InstantEngine:
    """Answers every request at once with the next scripted turn: whole (``generate``, how the
    loops take turns by default) or as one chunk (``generate_stream``, with ``agent.stream``)."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.turns = [tokenizer.encode(t + tokenizer.eos_token, add_special_tokens=False) for t in turns]

    def _turn(self, request: GenerateRequest) -> list[int]:
        turn = int(
            request.request_id.split(".")[1]
        )  # the loop's request ids: trajectory.turn.partial.attempt
        return self.turns[min(turn, len(self.turns) - 1)]

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        ids = self._turn(request)
        return GenerateOutput(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            versions=[0] * len(ids),
            finish_reason="stop",
        )

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        ids = self._turn(request)
        yield TokenChunk(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            versions=[0] * len(ids),
            finish_reason="stop",
        )


class Stopwatch:
    """Total time spent inside the wrapped functions (the run is one thread: no overlap)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


async def run_loops(tok: Any, n: int) -> tuple[float, int, float]:
    """Wall time, model turns, and the time spent tokenising inside the run."""
    watch = Stopwatch()
    originals = ChatTurns.prompt_ids, ChatTurns.after_model_turn, type(tok).decode
    ChatTurns.prompt_ids, ChatTurns.after_model_turn = (
        watch.wrap(ChatTurns.prompt_ids),
        watch.wrap(ChatTurns.after_model_turn),
    )  # type: ignore[method-assign]
    type(tok).decode = watch.wrap(type(tok).decode)
    try:
        elapsed, turns = await _run_loops(tok, n)
    finally:
        ChatTurns.prompt_ids, ChatTurns.after_model_turn, type(tok).decode = originals  # type: ignore[method-assign]
    return elapsed, turns, watch.seconds


async def _run_loops(tok: Any, n: int) -> tuple[float, int]:
    engine = InstantEngine(tok, TURNS)
    tools = build_tools(["calculator"])
    config = AgentConfig(tools=["calculator"], response_length=4096)
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
    loops = [ToolAgentLoop(engine, tok, config, tools=tools, trajectory_id=f"t{i}") for i in range(n)]
    start = time.perf_counter()
    trajectories = await asyncio.gather(*[loop.run(params, messages=QUESTION) for loop in loops])
    elapsed = time.perf_counter() - start
    turns = sum(t.num_turns - 1 - (t.num_turns - 1) // 2 for t in trajectories)  # model turns
    assert all(t.termination == "stop" and t.messages[-1]["content"] == "267" for t in trajectories)
    return elapsed, turns


def tokenize_cost(tok: Any, repeats: int) -> float:
    """Seconds per model turn of the tokenisation a loop must do: render and encode the prompt
    (once per trajectory), decode each model turn, render and encode the environment's reply."""
    turns = ChatTurns(tok)
    parser = HermesParser()
    schemas = [tool.schema() for tool in build_tools(["calculator"]).values()]
    model_turns = [tok.encode(t + tok.eos_token, add_special_tokens=False) for t in TURNS]
    replies = [
        parser.format_responses([ToolResult(text=r, name="calculator", call_id="call_0")])
        for r in ("84", "89", "267")
    ]
    start = time.perf_counter()
    for _ in range(repeats):
        turns.prompt_ids(QUESTION, schemas)
        for i, ids in enumerate(model_turns):
            tok.decode(ids, skip_special_tokens=False)
            if i < len(replies):
                turns.after_model_turn(replies[i])
    return (time.perf_counter() - start) / (repeats * len(model_turns))


# Each input is one block repeated to the size: malformed calls, calls past the per-turn cap,
# strings holding the closing tag, deep nesting, degenerate headers, runs of control tokens,
# floods of tiny messages and tags.
ADVERSARIAL = {
    "hermes": [
        "<tool_call>x</tool_call>",
        "<tool_call>x",
        '<tool_call>{"name": "a</tool_call>',
        "<tool_call>[[[[[[[[",
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
        "<think></think><tool_call>{",
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
        "</think><tool_call>1e999999</tool_call>",
        "<think>x</think>",
        "x</think>",
    ],
    "gpt-oss": [
        "<|channel|>",
        "<|start|>",
        "<|message|>",
        "<|constrain|>x",
        "<|end|>x",
        "to=functions.aaaa",
        "<|start|>x",
        "<|channel|>x",
        "<|start|> <|start|>",
        "<|start|>to=functions.x<|end|>",
        "<|channel|>x<|constrain|>x",
        "<|message|>x<|end|>x",
        "<|call|><|message|>",
        "<|start|>a<|message|>x",
        "<|channel|>analysis<|message|>x<|end|>",
        "<|channel|>commentary to=functions.x<|message|>{bad<|call|>",
        "<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{}<|call|>",
    ],
}
SIZES = (10_000, 100_000, 1_000_000)


def _size(n: int) -> str:
    return f"{n // 1_000_000} MB" if n >= 1_000_000 else f"{n // 1000} KB"


def ms_per_mb(parse: Any, text: str, repeats: int) -> float:
    """The fastest of ``repeats`` parses, per MB: on a shared machine, others only ever slow one down."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        parse(text)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3 / (len(text) / 1e6)


def parser_costs(tok: Any, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """ms per MB of each parser on each adversarial input and size; the worst, and the growth."""
    worst, growth, worst_input, worst_text = 0.0, 0.0, "", ""
    for fmt, blocks in ADVERSARIAL.items():
        parse = get_parser(fmt).parse
        for block in blocks:
            costs = []
            for size in sizes:
                text = (block * (size // len(block) + 1))[:size]
                costs.append(ms_per_mb(parse, text, repeats))
                if costs[-1] > worst:
                    worst, worst_input, worst_text = (
                        costs[-1],
                        f"{fmt}: {block[:40]!r} at {_size(size)}",
                        text,
                    )
            print(f"  {fmt:8} {block[:44]!r:48} " + "  ".join(f"{c:6.1f}" for c in costs) + " ms/MB")
            if len(costs) > 1 and costs[-1] * sizes[-1] / 1e6 >= 1.0:  # 1 ms or more at the largest size
                growth = max(growth, costs[-1] * sizes[-1] / (costs[-2] * sizes[-2]))
    ids = tok.encode(worst_text, add_special_tokens=False)
    decode = ms_per_mb(lambda _: tok.decode(ids, skip_special_tokens=False), worst_text, repeats)
    return {
        "parser_ms_per_mb_worst": round(worst, 1),
        "parser_growth_worst": round(growth, 1),
        "parser_worst_input": worst_input,
        "parser_vs_decode": round(worst / decode, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few trajectories, to check that it runs (seconds; the figures mean nothing)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.trajectories = 50
    import uvloop

    tok = build_tokenizer()
    uvloop.run(run_loops(tok, 50))  # warm-up: imports, template compilation
    tokenize_cost(tok, 50)
    runs = [uvloop.run(run_loops(tok, args.trajectories)) for _ in range(1 if args.smoke else 2)]
    elapsed, turns, in_run = min(runs)
    per_turn = elapsed / turns
    tokenize = in_run / turns  # timed inside the run: the same cache and GC conditions as the loop
    alone = min(tokenize_cost(tok, 50 if args.smoke else 500) for _ in range(2))
    overhead = max(per_turn - tokenize, 0.0)
    print(
        f"{args.trajectories} trajectories x {len(TURNS)} model turns (+{len(TURNS) - 1} tool turns) concurrently: {elapsed:.2f} s, {turns / elapsed:,.0f} model turns/s"
    )
    print(
        f"per model turn: {per_turn * 1e6:.0f} us in all; tokenisation {tokenize * 1e6:.0f} us of it (the same work timed alone: {alone * 1e6:.0f} us); loop overhead {overhead * 1e6:.0f} us"
    )
    sizes = SIZES[:2] if args.smoke else SIZES
    print(
        f"tool-call parsers on adversarial turns of {', '.join(_size(s) for s in sizes)} (fastest of {1 if args.smoke else 5}, ms per MB):"
    )
    parsers = parser_costs(tok, sizes, 1 if args.smoke else 5)
    print(
        f"worst {parsers['parser_ms_per_mb_worst']} ms/MB ({parsers['parser_worst_input']}; {parsers['parser_vs_decode']}x the time to "
        f"decode its tokens), worst growth {_size(sizes[-2])} -> {_size(sizes[-1])} {parsers['parser_growth_worst']}x "
        f"(linear: {sizes[-1] // sizes[-2]}x)"
    )
    loop = {
        "turns_per_s": round(turns / elapsed),
        "overhead_us_per_turn": round(overhead * 1e6, 1),
        "overhead_vs_tokenize": round(overhead / tokenize, 3),
    }
    print(json.dumps(loop | parsers))


if __name__ == "__main__":
    main()
