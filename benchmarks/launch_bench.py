"""How long a launch takes to bring a cluster up, against torchrun, in one run.

    .venv/bin/python benchmarks/launch_bench.py [--repeats 7] [--smoke]

(a) ``rlasync launch --nodes hosts.txt --via 'sh -c {command}'`` with 3 local hosts (three
    ``127.0.0.1`` lines on their own ports) and the quickstart cluster placed with a trainer
    rank on every node (``cluster.trainer=[0, 1, 2]``, engines on nodes 1 and 2): seconds from
    starting the command until every node has joined and the trainer's group did its first
    collective (the launcher prints that line; the run is then stopped with Ctrl-C).
(b) ``torchrun --standalone --nnodes=1 --nproc-per-node=3`` of a script that forms a gloo
    group and does one ``all_reduce``: seconds from starting the command until rank 0 printed
    that it did.

Alternating, ``--repeats`` of each; medians count. Last line, JSON: ``{"launch_s":…,
"torchrun_s":…, "launch_vs_torchrun":…}``; goal ``launch_vs_torchrun`` <= 1.0. ``--smoke`` runs
each once, on 2 hosts (the engine on node 1) and 2 torchrun processes (for ``make test``): its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs" / "quickstart_cluster.yaml"
FIRST_ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 0:
    print("first all_reduce done", flush=True)
dist.destroy_process_group()
"""
DEADLINE_S = 240.0


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def until_line(
    command: list[str],
    marker: str,
    *,
    env: dict[str, str] | None = None,
    stop: signal.Signals = signal.SIGINT,
) -> float:
    """Seconds from starting ``command`` until a line of its output contains ``marker``; then it
    is stopped (``stop``, then killed) and reaped."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    assert proc.stdout is not None
    tail: list[str] = []
    try:
        for line in proc.stdout:
            if marker in line:
                return time.perf_counter() - started
            tail = (tail + [line])[-30:]
            if time.perf_counter() - started > DEADLINE_S:
                break
        raise RuntimeError(f"{command[2:5]} never printed {marker!r}:\n{''.join(tail)}")
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch_s(folder: Path, model: Path, nodes: int) -> float:
    hosts = folder / "hosts.txt"
    hosts.write_text("".join(f"127.0.0.1 port={port}\n" for port in free_ports(nodes)))
    command = [
        sys.executable,
        "-m",
        "rlasync",
        "launch",
        "--nodes",
        str(hosts),
        "--via",
        "sh -c {command}",
        str(CLUSTER),
        f"cluster.trainer={list(range(nodes))}",  # a rank on every node
        f"cluster.engines={list(range(1, nodes))}",  # an engine on every node but the head's
        f"trainer.world_size={nodes}",
        f"train.model_dir={model}",
        f"train.run_dir={folder / 'run'}",
    ]
    return until_line(command, "did their first collective")


def torchrun_s(folder: Path, nodes: int) -> float:
    script = folder / "first_all_reduce.py"
    script.write_text(FIRST_ALL_REDUCE)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nodes}",
        str(script),
    ]
    return until_line(command, "first all_reduce done", stop=signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--smoke", action="store_true", help="one of each, 2 nodes (for make test): figures mean nothing"
    )
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    # --smoke: 2 nodes, not 3: the same path (every node joins, a rank on each does the first
    # collective), a node process fewer to start (torch, the engines) on each side.
    nodes = 2 if args.smoke else 3
    from rlasync.models import TinyLMConfig, build_tiny_lm

    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        folder = Path(tmp)
        model, tokenizer = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
        model.save_pretrained(folder / "model")
        tokenizer.save_pretrained(folder / "model")
        ours, theirs = [], []
        for i in range(repeats):
            ours.append(launch_s(folder, folder / "model", nodes))
            theirs.append(torchrun_s(folder, nodes))
            print(f"repeat {i + 1}: launch {ours[-1]:.2f} s, torchrun {theirs[-1]:.2f} s", flush=True)
    result = {
        "launch_s": round(statistics.median(ours), 3),
        "torchrun_s": round(statistics.median(theirs), 3),
    }
    result["launch_vs_torchrun"] = round(result["launch_s"] / result["torchrun_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
