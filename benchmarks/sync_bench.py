"""Weight sync throughput and the engine's pause, against a raw gloo broadcast, in one run.

    .venv/bin/python benchmarks/sync_bench.py [--gb 1.0] [--bucket-mb 64] [--repeats 5] [--smoke]

Two processes on this machine: this one plays the trainer's rank 0, a child plays an engine
(a torch engine serving a model of about ``--gb`` of float32 parameters, decoding the whole
time). Measured, each as the best of ``--repeats``, on the sender and up to a barrier:

(a) ``raw_broadcast_s``: one ``broadcast`` of the same number of bytes in one flat buffer over
    the same gloo group (the transport's limit);
(b) ``sync_s``: ``WeightSender.send`` of the model's named parameters (bucket packing, the
    transfer, and the receiver staging a full copy); (a) and (b) with the engine idle;
(c) then, with the engine decoding throughout, ``sync_while_decoding_s`` and ``pause_s``: how
    long the engine stopped decoding to take each new version (``TorchEngine.swap_weights``),
    against the transfer (the receive, during which it decoded).

(d) on CPU, ``shm_sync_s``: the same-host path. The trainer's parameters live in a shared-memory
    file; a sync publishes the version in its header and the engine (decoding throughout)
    copies it into its staging buffer (``EngineWeights``, as an ``EngineActor`` does), then
    swaps (``shm_pause_s``). ``shm_vs_raw_broadcast`` = raw / this.

Last line JSON: ``{"bytes", "sync_s", "raw_broadcast_s", "vs_raw_broadcast",
"sync_while_decoding_s", "pause_s", "pause_vs_transfer", "shm_sync_s", "shm_vs_raw_broadcast", "shm_pause_s"}`` with ``vs_raw_broadcast`` = raw /
ours (goal >= 0.8) and ``pause_vs_transfer`` = pause / transfer (goal <= 0.1).

``--smoke`` (for ``make test``; its figures mean nothing): one repeat of each on a model of 2
layers of width 256 (8 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import msgspec
import torch

from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.weights import (
    EngineWeights,
    SharedWeights,
    WeightGroup,
    WeightReceiver,
    WeightSender,
    flat_layout,
    plan_for,
)

LAYERS = 16  # --smoke: 2


def model_config(gb: float, seed: int) -> TinyLMConfig:
    """A Qwen2-shaped model of about ``gb`` GB of float32 (``LAYERS`` layers, width to fit; 256
    at least)."""
    layers, hidden = LAYERS, 256
    while True:
        per_layer = 3 * hidden * hidden + 3 * hidden * 4 * hidden  # attention (GQA) and MLP, roughly
        if layers * per_layer * 4 >= gb * 1e9 or hidden >= 4096:
            break
        hidden += 128
    return TinyLMConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 128,
        intermediate_size=4 * hidden,
        seed=seed,
    )


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    """CPU, or with ``--device cuda`` the trainer on GPU 0 and the engine on GPU 1 (NCCL needs
    a device per rank)."""
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def _backend(args: argparse.Namespace) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _alone(args: argparse.Namespace) -> int | None:
    return int(args.alone_mb * (1 << 20)) if args.alone_mb else None


def sender(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    forwarded = [
        "--gb",
        str(args.gb),
        "--bucket-mb",
        str(args.bucket_mb),
        "--alone-mb",
        str(args.alone_mb),
        "--repeats",
        str(args.repeats),
        "--device",
        args.device,
        *(["--smoke"] if args.smoke else []),  # the engine's model as small (LAYERS) as this one's
    ]
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "engine", "--port", str(port), *forwarded],
        stdout=subprocess.PIPE,
        text=True,
    )
    torch.set_num_threads(1)
    device = _device(args, 0)
    model, _ = build_tiny_lm(model_config(args.gb, seed=1))
    model.to(device)
    params = {name: p.detach() for name, p in model.named_parameters()}
    plan = plan_for(params, args.bucket_mb << 20, alone_bytes=_alone(args))
    if not args.no_flat:  # as the trainer's rank 0 does: parameters laid out as the buckets
        flat_layout(plan, dict(model.named_parameters()))
        params = {name: p.detach() for name, p in model.named_parameters()}
    group = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=600, backend=_backend(args))
    sender_ = WeightSender(group, plan, device=device)
    flat = torch.ones(plan.total_bytes, dtype=torch.uint8, device=device)
    raw, ours, busy = [], [], []
    version = 0
    for _ in range(args.repeats):  # phase 1, the engine idle: the transport against its limit
        version += 1
        group.barrier()
        started = time.perf_counter()
        group.broadcast(flat, "the raw broadcast")
        group.barrier()
        raw.append(time.perf_counter() - started)
        started = time.perf_counter()
        sender_.send(params, version)
        group.barrier()
        ours.append(time.perf_counter() - started)
    for _ in range(args.repeats):  # phase 2, the engine decoding throughout
        version += 1
        group.barrier()
        started = time.perf_counter()
        sender_.send(params, version)
        group.barrier()
        busy.append(time.perf_counter() - started)
    shm_times: list[float] = []
    if args.device == "cpu":  # phase 3, the same-host path: the parameters live in shared memory
        shared = SharedWeights.create(args.shm_dir, plan)
        flat_layout(
            plan, dict(model.named_parameters()), out=shared.data
        )  # as rank 0 does: the optimizer writes there
        path = torch.zeros(512, dtype=torch.uint8)
        encoded = msgspec.json.encode(shared.offer)
        path[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        group.broadcast(
            path, "the shared-memory offer"
        )  # the runtime sends it in rlasync; a broadcast will do here
        for _ in range(args.repeats):
            version += 1
            group.barrier()
            started = time.perf_counter()
            shared.invalidate()  # a training step would change the parameters here
            shared.publish(version)
            group.barrier()  # the engine has copied the version into its staging buffer
            shm_times.append(time.perf_counter() - started)
        group.barrier()
        shared.close()
    engine_report = json.loads(child.communicate(timeout=600)[0].strip().splitlines()[-1])
    group.close()
    sync_s, raw_s = min(ours), min(raw)
    pause, transfer = engine_report["pause_s"], engine_report["transfer_s"]
    print(
        f"parameters: {plan.total_bytes / 1e9:.2f} GB in {len(plan.sizes)} buckets of {args.bucket_mb} MB (model width {model.config.hidden_size})"
    )
    print(f"raw gloo broadcast, one buffer: {raw_s:7.3f} s  ({plan.total_bytes / raw_s / 1e9:.2f} GB/s)")
    print(
        f"weight sync, end to end:        {sync_s:7.3f} s  ({plan.total_bytes / sync_s / 1e9:.2f} GB/s, {raw_s / sync_s:.2f}x raw)"
    )
    print(f"weight sync, engine decoding:   {min(busy):7.3f} s  (decoding and the transfer share the cores)")
    print(
        f"engine: decoded {engine_report['tokens_during_transfer']} tokens during those transfers; paused {pause * 1e3:.2f} ms to swap ({pause / transfer:.4f} of the transfer)"
    )
    result = {
        "bytes": plan.total_bytes,
        "sync_s": round(sync_s, 4),
        "raw_broadcast_s": round(raw_s, 4),
        "vs_raw_broadcast": round(raw_s / sync_s, 3),
        "sync_while_decoding_s": round(min(busy), 4),
        "pause_s": round(pause, 5),
        "pause_vs_transfer": round(pause / transfer, 5),
    }
    if shm_times:
        shm_s = min(shm_times)
        print(
            f"same-host shared memory, engine decoding: {shm_s:7.3f} s  ({raw_s / shm_s:.2f}x the raw broadcast; "
            f"pause {engine_report['shm_pause_s'] * 1e3:.2f} ms)"
        )
        result.update(
            shm_sync_s=round(shm_s, 4),
            shm_vs_raw_broadcast=round(raw_s / shm_s, 3),
            shm_pause_s=round(engine_report["shm_pause_s"], 5),
        )
    print(json.dumps(result))


def engine(args: argparse.Namespace) -> None:
    from rlasync.engines import GenerateRequest, SamplingParams, TorchEngine

    torch.set_num_threads(1)
    device = _device(args, 1)
    model, _ = build_tiny_lm(model_config(args.gb, seed=0))
    model.to(device)
    plan = plan_for(
        {name: p.detach() for name, p in model.named_parameters()},
        args.bucket_mb << 20,
        alone_bytes=_alone(args),
    )
    group = WeightGroup("127.0.0.1", args.port, 1, 2, timeout_s=600, backend=_backend(args))
    receiver = WeightReceiver(group, plan, device=device)
    flat = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)

    async def main() -> dict[str, float]:
        server = TorchEngine(model, max_batch=4)
        stop = asyncio.Event()

        async def decode() -> None:  # keep the engine busy the whole time
            n = 0
            while not stop.is_set():
                n += 1
                await server.generate(
                    GenerateRequest(
                        request_id=f"r{n}",
                        prompt_ids=[5, 6, 7],
                        params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=n),
                    )
                )

        staged: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):  # phase 1: idle, the transfer alone
            await asyncio.to_thread(group.barrier)
            await asyncio.to_thread(group.broadcast, flat, "the raw broadcast")
            await asyncio.to_thread(group.barrier)
            version, staged = await asyncio.to_thread(receiver.receive)
            await asyncio.to_thread(group.barrier)
        await server.swap_weights(staged, version)
        decoding = asyncio.create_task(decode())
        pauses, transfers, tokens = [], [], 0
        for _ in range(args.repeats):  # phase 2: decoding throughout; the pause is the swap
            await asyncio.to_thread(group.barrier)
            before = server.stats().finished
            started = time.perf_counter()
            version, staged = await asyncio.to_thread(receiver.receive)
            transfers.append(time.perf_counter() - started)
            tokens += server.stats().finished - before
            pauses.append(await server.swap_weights(staged, version))
            await asyncio.to_thread(group.barrier)
        shm_pauses = []
        if args.device == "cpu":  # phase 3: copies from the trainer's shared memory, decoding throughout
            path = torch.zeros(512, dtype=torch.uint8)
            await asyncio.to_thread(group.broadcast, path, "the shared-memory offer")
            offer = msgspec.json.decode(bytes(path.numpy()).rstrip(b"\0"))
            weights = EngineWeights(server)
            assert await weights.attach(msgspec.msgpack.encode(plan), offer) == "shm", (
                "the engine could not map the trainer's shared memory"
            )
            for _ in range(args.repeats):
                version += 1
                await asyncio.to_thread(group.barrier)
                await weights.stage(version, timeout_s=600)
                await asyncio.to_thread(group.barrier)
                shm_pauses.append((await weights.commit(version)).pause_s)
            await asyncio.to_thread(group.barrier)
        stop.set()
        await decoding
        await server.close()
        return {
            "pause_s": min(pauses),
            "transfer_s": min(transfers),
            "tokens_during_transfer": tokens,
            "shm_pause_s": min(shm_pauses, default=0.0),
        }

    report = asyncio.run(main())
    group.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument(
        "--alone-mb",
        type=float,
        default=0.0,
        help="tensors this big travel alone (0: the planner's default, a bucket)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: NCCL between GPU 0 (trainer) and GPU 1 (engine)",
    )
    parser.add_argument(
        "--shm-dir", default="/dev/shm", help="where the same-host path's shared-memory file lives"
    )
    parser.add_argument(
        "--no-flat", action="store_true", help="pack every bucket (parameters not laid out as the buckets)"
    )
    parser.add_argument("--role", choices=["trainer", "engine"], default="trainer")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="an 8 MB model (2 layers), one repeat (seconds; the figures mean nothing)",
    )
    arguments = parser.parse_args()
    if arguments.smoke:
        arguments.gb, arguments.repeats = 0.001, 1
        # 16 layers of the smallest width (256) are 63 MB. The engine's process gets --smoke: this too.
        LAYERS = 2
    (engine if arguments.role == "engine" else sender)(arguments)
