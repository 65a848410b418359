"""What the OpenAI-compatible endpoint costs: 64 concurrent clients through it, against the same
requests sent to the router directly, one run.

    .venv/bin/python benchmarks/openai_bench.py                  # ~80 s on 2 cores
    .venv/bin/python benchmarks/openai_bench.py --preset nano    # the 4x faster model: ~35 s
    .venv/bin/python benchmarks/openai_bench.py --smoke          # seconds: that it runs (make test)

A torch engine (the ``micro`` preset, one thread, up to 64 sequences a step) runs as an
``EngineActor`` on a node process of its own; this process is the head and holds a ``Router``
to it, as an agent-loop worker does, and an ``Endpoint`` in front of that router.

- **router**: ``--clients`` coroutines each send ``--requests`` chat requests one after another
  through ``Router.generate`` (the prompt rendered by the chat template, as the endpoint does).
- **endpoint**: as many ``openai.AsyncOpenAI`` clients send the same requests (same messages,
  seeds, ``max_tokens``) over HTTP, from a process of their own: a user's agent calling in.
- **endpoint_http**: the same with plain ``httpx`` clients posting the same JSON. The official
  client's own work per call (~2.5 ms of CPU, most of it building the request and the reply's
  pydantic objects) is the agent's, not the endpoint's; on 2 cores it competes with the engine
  for the same CPUs, so this side isolates what the endpoint itself costs.

Rounds alternate (router, endpoint, endpoint_http, endpoint_http, endpoint, router...); each
side's figure is its median round. Tokens/s counts completion tokens; a request's latency is
from its send to its whole reply; ``added_latency_ms_p50`` is the endpoint's median latency
minus the router's. Goal: ``endpoint_vs_router`` >= 0.8 (the official client).

**Which model.** On these 2 cores the engine, the head and the clients share the CPUs, so what a
request costs outside the engine is paid in the engine's time: the official client's ~2.5 ms
of CPU per call (five times the endpoint's ~0.5 ms) slows the engine's steps and leaves its
batch part-empty while replies wait for the client's loop. That weighs in proportion to how
fast the engine makes a request's tokens. The ``micro`` model's engine (~2,500 tokens/s for 64
sequences) is still several times faster per CPU than any real model; the ``nano`` one (~9,500
tokens/s, a 32-token reply every ~7 ms of a step) makes the client's CPU the measurement.
Measured (2 cores, one run each): ``micro`` 0.895, 0.859, 0.915; ``nano`` 0.744, 0.784, 0.750
(and 0.82, 0.79, 0.82 on a quieter day); with plain httpx clients 0.93-0.95 and 0.78-0.87.
On a GPU the engine's compute is not the clients' CPU, which is the case ``micro`` is nearer.

Last line: ``{"endpoint_tokens_per_s":…, "router_tokens_per_s":…, "endpoint_vs_router":…,
"added_latency_ms_p50":…, "endpoint_http_vs_router":…, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import uvloop

from rlasync import LocalCluster, RuntimeConfig
from rlasync.agents import ChatTurns
from rlasync.config import EndpointConfig, EngineConfig
from rlasync.engines import EngineActor, GenerateRequest, Router, SamplingParams
from rlasync.models import TinyLMConfig, build_tiny_lm, save_pretrained_dir
from rlasync.serving import Endpoint

WORDS = ["Reverse", "hello", "What is", "abc", "calc", "the answer", "12+34", "tool"]


def messages_of(i: int) -> list[dict[str, Any]]:
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(2 + i % 5)]
    return [{"role": "user", "content": " ".join(words)}]


async def router_round(
    router: Router, turns: ChatTurns, clients: int, requests: int, tokens: int, salt: int
) -> tuple[int, float, list[float]]:
    latencies: list[float] = []
    made = 0

    async def client(c: int) -> None:
        nonlocal made
        for r in range(requests):
            i = c * requests + r
            prompt = turns.prompt_ids(messages_of(i))
            params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=i)
            start = time.perf_counter()
            out = await router.generate(
                GenerateRequest(request_id=f"r{salt}-{i}", prompt_ids=prompt, params=params),
                session_id=f"c{c}",
            )
            latencies.append(time.perf_counter() - start)
            made += len(out.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*[client(c) for c in range(clients)])
    return made, time.perf_counter() - start, latencies


async def endpoint_round(clients: list[Any], requests: int, tokens: int) -> tuple[int, float, list[float]]:
    """A round of ``clients``: ``openai.AsyncOpenAI`` objects, or ``httpx.AsyncClient`` ones
    posting the same JSON (what any other agent framework sends)."""
    latencies: list[float] = []
    made = 0

    async def client(c: int, api: Any) -> None:
        nonlocal made
        for r in range(requests):
            i = c * requests + r
            body = {
                "model": "nano",
                "messages": messages_of(i),
                "temperature": 1.0,
                "max_tokens": tokens,
                "seed": i,
            }
            start = time.perf_counter()
            if isinstance(api, openai.AsyncOpenAI):
                reply = await api.chat.completions.create(**body)
                made += reply.usage.completion_tokens if reply.usage else 0
            else:
                response = await api.post("/v1/chat/completions", json=body)
                made += response.json()["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*[client(c, api) for c, api in enumerate(clients)])
    return made, time.perf_counter() - start, latencies


async def agents_process(url: str, clients: int, kind: str) -> None:
    """The clients' side (``--agents URL``): a round per line read, its figures as a JSON line."""
    import httpx

    apis = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        if kind == "openai"
        else httpx.AsyncClient(base_url=url, timeout=600)
        for _ in range(clients)
    ]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        requests, tokens = map(int, line.split())
        made, wall, latencies = await endpoint_round(apis, requests, tokens)
        print(json.dumps([made, wall, latencies]), flush=True)


class Agents:
    """The clients, in a process of their own: a user's agent calling the endpoint over HTTP."""

    def __init__(self, url: str, clients: int, kind: str) -> None:
        self.url, self.clients, self.kind = url, clients, kind

    async def __aenter__(self) -> Agents:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--agents",
            self.url,
            "--clients",
            str(self.clients),
            "--client",
            self.kind,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        assert (await asyncio.wait_for(self.process.stdout.readline(), 120)).strip() == b"ready"
        return self

    async def round(self, requests: int, tokens: int) -> tuple[int, float, list[float]]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{requests} {tokens}\n".encode())
        await self.process.stdin.drain()
        made, wall, latencies = json.loads(await asyncio.wait_for(self.process.stdout.readline(), 600))
        return made, wall, latencies

    async def __aexit__(self, *exc: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 30)
        except TimeoutError:
            self.process.kill()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    model, tok = build_tiny_lm(TinyLMConfig.preset(args.preset, seed=0))
    with tempfile.TemporaryDirectory(prefix="openai-bench-") as tmp:
        save_pretrained_dir(model, tok, Path(tmp))
        config = RuntimeConfig(preload_modules=("rlasync.engines",))
        async with LocalCluster(nodes=2, config=config) as cluster:
            engine = await cluster.spawn(
                EngineActor,
                EngineConfig(model=tmp, max_batch=args.clients, cpu_threads=1),
                node=1,
                name="engine-1",
            )
            async with Router([engine]) as router:
                turns = ChatTurns(tok)
                async with Endpoint(router, tok, EndpointConfig(), model_name="nano") as endpoint:
                    await router_round(router, turns, 2, 1, 4, salt=-1)  # warm: the first decode steps
                    async with (
                        Agents(endpoint.url, args.clients, "openai") as official,
                        Agents(endpoint.url, args.clients, "http") as plain,
                    ):
                        agents = {"endpoint": official, "endpoint_http": plain}
                        for warm in agents.values():
                            await warm.round(1, 4)  # the first connections
                        sides: dict[str, list[tuple[int, float, list[float]]]] = {
                            "router": [],
                            "endpoint": [],
                            "endpoint_http": [],
                        }
                        order = ["router", "endpoint", "endpoint_http", "endpoint_http", "endpoint", "router"]
                        for k in range(args.rounds):
                            side = order[k % len(order)]
                            if side == "router":
                                result = await router_round(
                                    router, turns, args.clients, args.requests, args.tokens, salt=k
                                )
                            else:
                                result = await agents[side].round(args.requests, args.tokens)
                            sides[side].append(result)
                            made, wall, _ = result
                            print(
                                f"round {k}: {side:13s} {made / wall:8.0f} tokens/s ({made} tokens, {wall:.2f} s)",
                                flush=True,
                            )
    rate = {side: statistics.median(m / w for m, w, _ in rounds) for side, rounds in sides.items()}
    p50 = {side: statistics.median(x for _, _, lat in rounds for x in lat) for side, rounds in sides.items()}
    return {
        "endpoint_tokens_per_s": round(rate["endpoint"], 1),
        "router_tokens_per_s": round(rate["router"], 1),
        "endpoint_vs_router": round(rate["endpoint"] / rate["router"], 3),
        "added_latency_ms_p50": round(1000 * (p50["endpoint"] - p50["router"]), 2),
        "endpoint_http_tokens_per_s": round(rate["endpoint_http"], 1),
        "endpoint_http_vs_router": round(rate["endpoint_http"] / rate["router"], 3),
        "added_latency_http_ms_p50": round(1000 * (p50["endpoint_http"] - p50["router"]), 2),
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.tokens,
        "preset": args.preset,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--requests", type=int, default=8, help="requests each client sends, one after another"
    )
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--rounds", type=int, default=12, help="rounds in all, alternating the three sides")
    parser.add_argument("--preset", default="micro", help="the engine's model (see Which model)")
    parser.add_argument("--smoke", action="store_true", help="4 clients, 2 requests, 8 tokens, 3 rounds")
    parser.add_argument("--agents", default="", help=argparse.SUPPRESS)  # the clients' process
    parser.add_argument("--client", default="openai", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents:
        uvloop.run(agents_process(args.agents, args.clients, args.client))
        sys.exit(0)
    if args.smoke:
        args.clients, args.requests, args.tokens, args.rounds, args.preset = 4, 2, 8, 3, "nano"
    result = uvloop.run(main(args))  # what node processes run on
    print(json.dumps(result))
