"""Weight sync over a real gloo group between real processes: bit-exact, any bucket size,
and a dead or stalled engine is an error within the deadline, never a hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.weights import SyncError, WeightGroup, WeightSender, plan_for

# An engine process: joins the group, receives `syncs` versions, saves the last one staged.
RECEIVER = """
import sys, time, torch
from safetensors.torch import save_file
from rlasync.weights import WeightGroup, WeightReceiver, BucketPlan
import msgspec
port, rank, size, plan_file, out, syncs, stall, generation = sys.argv[1:9]
plan = msgspec.json.decode(open(plan_file, "rb").read(), type=BucketPlan)
group = WeightGroup("127.0.0.1", int(port), int(rank), int(size), timeout_s=20, generation=int(generation))
receiver = WeightReceiver(group, plan)
for i in range(int(syncs)):
    if float(stall) and i == 1:
        time.sleep(float(stall))  # alive but not taking part
    version, staged = receiver.receive()
    print("received", version, flush=True)
save_file({k: v.contiguous() for k, v in staged.items()}, out, metadata={"version": str(version)})
group.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    model, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=seed))
    named = {name: p.detach().clone() for name, p in model.named_parameters()}
    named["extra.bf16"] = torch.randn(33, 7).bfloat16()  # odd sizes and a 2-byte dtype
    named["extra.empty"] = torch.empty(0, 4)
    return named


def _engines(
    tmp_path: Path,
    port: int,
    plan_bytes: bytes,
    count: int,
    syncs: int,
    stall: float = 0.0,
    generation: int = 0,
) -> list[tuple[subprocess.Popen[str], Path]]:
    (tmp_path / "plan.json").write_bytes(plan_bytes)
    (tmp_path / "receiver.py").write_text(RECEIVER)
    engines = []
    for rank in range(1, count + 1):
        out = tmp_path / f"engine{rank}.safetensors"
        command = [
            sys.executable,
            str(tmp_path / "receiver.py"),
            str(port),
            str(rank),
            str(count + 1),
            str(tmp_path / "plan.json"),
            str(out),
            str(syncs),
            str(stall),
            str(generation),
        ]
        engines.append(
            (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
        )
    return engines


@pytest.mark.parametrize(
    "bucket_bytes",
    [
        pytest.param(1, id="one-tensor-per-bucket"),
        # The numerics tier copies under each CPU code path once: packed buckets, the general case.
        pytest.param(4096, id="4KiB", marks=pytest.mark.numerics),
        pytest.param(1 << 30, id="one-bucket"),
    ],
)
def test_every_engine_gets_the_trainers_parameters_bit_for_bit(tmp_path: Path, bucket_bytes: int) -> None:
    import msgspec

    first, second = _params(0), _params(1)
    plan = plan_for(first, bucket_bytes)
    assert max(plan.sizes) >= max(t.numel() * t.element_size() for t in first.values())
    port = _free_port()
    engines = _engines(tmp_path, port, msgspec.json.encode(plan), count=2, syncs=2)
    group = WeightGroup("127.0.0.1", port, 0, 3, timeout_s=60)
    sender = WeightSender(group, plan)
    sender.send(first, version=1)
    stats = sender.send(second, version=2)
    assert stats.buckets == len(plan.sizes) and stats.bytes == plan.total_bytes
    for proc, out in engines:
        assert proc.wait(timeout=60) == 0, proc.stdout.read() if proc.stdout else ""
        got = load_file(str(out))
        assert got.keys() == second.keys()
        for name, tensor in second.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    group.close()


def test_a_killed_engine_is_an_error_within_the_deadline_and_a_new_generation_works(tmp_path: Path) -> None:
    import msgspec

    params = _params()
    plan = plan_for(params, 64 << 10)
    port = _free_port()
    ((proc, _),) = _engines(tmp_path, port, msgspec.json.encode(plan), count=1, syncs=1)
    group = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=30)
    proc.kill()
    proc.wait()
    started = time.monotonic()
    with pytest.raises(SyncError, match="a peer died"):
        WeightSender(group, plan).send(params, version=1)
    assert time.monotonic() - started < 30
    # The store outlives the group: a new generation, with a fresh engine, syncs.
    (tmp_path / "gen1").mkdir()
    ((fresh, out),) = _engines(
        tmp_path / "gen1", port, msgspec.json.encode(plan), count=1, syncs=1, generation=1
    )
    again = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=30, generation=1, store=group.store)
    WeightSender(again, plan).send(params, version=2)
    assert fresh.wait(timeout=60) == 0
    assert all(torch.equal(load_file(str(out))[name], tensor) for name, tensor in params.items())
    again.close()


@pytest.mark.serial
def test_a_stalled_engine_is_an_error_after_the_deadline_not_a_hang(tmp_path: Path) -> None:
    import msgspec

    params = _params()
    plan = plan_for(params, 64 << 10)
    port = _free_port()
    ((proc, _),) = _engines(tmp_path, port, msgspec.json.encode(plan), count=1, syncs=2, stall=30)
    group = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=3)
    sender = WeightSender(group, plan)
    sender.send(params, version=1)
    started = time.monotonic()
    with pytest.raises(SyncError, match="stalled past 3 s"):
        sender.send(params, version=2)
    assert time.monotonic() - started < 15
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
