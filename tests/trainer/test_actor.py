"""The trainer: rank actors in real processes their nodes supervise, real gloo, real ZeroMQ.

Data parallelism must not change the step: ranks sum gradients whose losses are normalised by
the whole batch, so N ranks take the step one rank takes on the whole batch.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import wait_until_sync

from rlasync import LocalCluster
from rlasync.config import RuntimeConfig, TrainerConfig
from rlasync.models import TinyLMConfig, build_tiny_lm
from rlasync.runtime.errors import ActorError, CallTimeout
from rlasync.runtime.spawner import current_spawner, use_spawner
from rlasync.trainer import PolicyTrainer, RankLostError, TrainBatch, TrainerActor

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.fixture
def model_dir(nano_model_dir: Path) -> Path:
    return nano_model_dir


def _batch(size: int = 6, seed: int = 0) -> TrainBatch:
    """Left-padded prompts, ragged responses, behaviour logprobs off-policy (ratios != 1)."""
    g = torch.Generator().manual_seed(seed)
    prompt, response = 5, 7
    prompts = torch.randint(3, 300, (size, prompt), generator=g)
    responses = torch.randint(3, 300, (size, response), generator=g)
    mask = torch.ones(size, response, dtype=torch.long)
    attention = torch.ones(size, prompt + response, dtype=torch.long)
    for row in range(size):
        pad, length = row % 3, response - (row % 4)
        prompts[row, :pad], attention[row, :pad] = 0, 0
        mask[row, length:], attention[row, prompt + length :], responses[row, length:] = 0, 0, 0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logprobs = -torch.rand(size, response, generator=g) * 6 * mask
    return TrainBatch(
        prompts=prompts,
        responses=responses,
        response_mask=mask,
        attention_mask=attention,
        position_ids=positions,
        logprobs=logprobs,
        advantages=torch.linspace(-1.0, 1.0, size),
    )


async def _step_and_weights(
    model_dir: Path, config: TrainerConfig, batch: TrainBatch
) -> tuple[dict[str, float], dict[str, Any]]:
    async with TrainerActor(config) as trainer:
        await trainer.start(model_dir)
        metrics = await trainer.step(batch, temperature=0.8)
        return metrics, await trainer.weights()


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


async def test_two_gloo_ranks_take_the_step_one_rank_takes_on_the_whole_batch(model_dir: Path) -> None:
    batch = _batch(6)
    # Micro-batches of 3: one rank accumulates rows 0-2 then 3-5; two ranks take one each.
    one, w1 = await _step_and_weights(model_dir, TrainerConfig(world_size=1, micro_batch_size=3), batch)
    two, w2 = await _step_and_weights(model_dir, TrainerConfig(world_size=2, micro_batch_size=3), batch)
    assert _max_diff(w1, w2) <= 1e-6
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
    assert two["tokens"] == one["tokens"] == float(batch.response_mask.sum())
    for key in ("loss", "pg_clipfrac", "ppo_kl", "ratio_mean", "ratio_min", "ratio_max"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    # The step really moved the parameters (so "equal" is not "both unchanged").
    start, _ = build_tiny_lm(TinyLMConfig.preset("nano", seed=3))
    assert _max_diff(w1, {k: v.detach() for k, v in start.named_parameters()}) > 1e-4


async def test_fsdp2_shards_take_the_same_step_and_checkpoints_move_between_strategies(
    model_dir: Path, tmp_path: Path
) -> None:
    """Uneven shards (7 rows: 4 + 3, micro-batches of 2: the short rank runs a filler so both
    gather parameters as often). Checkpoints are saved whole: an FSDP2 one resumes under DDP."""
    batch, follow = _batch(7), _batch(6, seed=2)
    _, ddp = await _step_and_weights(model_dir, TrainerConfig(world_size=1, micro_batch_size=2), batch)
    async with TrainerActor(TrainerConfig(world_size=2, strategy="fsdp2", micro_batch_size=2)) as trainer:
        await trainer.start(model_dir)
        first = await trainer.step(batch, temperature=0.8)
        fsdp = await trainer.weights()
        await trainer.save(tmp_path / "ckpt")
        expected_next = await trainer.step(follow, temperature=0.8)
        logprobs = await trainer.compute_logprobs(follow, temperature=0.8)
    assert _max_diff(fsdp, ddp) <= 1e-6 and first["tokens"] == float(batch.response_mask.sum())
    assert logprobs.shape == follow.responses.shape
    async with TrainerActor(TrainerConfig(world_size=1, micro_batch_size=2)) as resumed:
        await resumed.start(model_dir)
        assert await resumed.load(tmp_path / "ckpt") == 1
        assert _max_diff(await resumed.weights(), fsdp) == 0.0
        again = await resumed.step(follow, temperature=0.8)
    for key in ("loss", "grad_norm", "ratio_mean"):  # the optimiser state came along too
        assert again[key] == pytest.approx(expected_next[key], rel=1e-5), key


async def test_ranks_agree_with_the_in_process_trainer_whatever_the_split(model_dir: Path) -> None:
    """Uneven shards (7 rows on 2 ranks, micro-batches of 2) and seq-mean aggregation: the
    same step up to float rounding. AdamW's first step is lr * g / (|g| + eps), so gradients
    that differ in the last bits move near-zero-gradient weights by up to ~lr * 1e-3."""
    batch = _batch(7, seed=1)
    config = TrainerConfig(world_size=2, micro_batch_size=2, loss_agg="seq-mean-token-mean", lr=1e-3)
    _, distributed = await _step_and_weights(model_dir, config, batch)
    from rlasync.models import load_pretrained_dir

    local = PolicyTrainer(
        load_pretrained_dir(model_dir)[0], TrainerConfig(loss_agg="seq-mean-token-mean", lr=1e-3)
    )
    local.step(batch, temperature=0.8)
    assert _max_diff(distributed, local.weights()) <= 1e-5


async def test_logprobs_are_gathered_in_row_order(model_dir: Path) -> None:
    batch = _batch(5)
    from rlasync.models import load_pretrained_dir

    expected = PolicyTrainer(load_pretrained_dir(model_dir)[0]).compute_logprobs(batch, temperature=0.8)
    async with TrainerActor(TrainerConfig(world_size=2)) as trainer:
        await trainer.start(model_dir)
        got = await trainer.compute_logprobs(batch, temperature=0.8)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6)


async def test_a_failing_call_raises_with_the_remote_traceback_and_the_trainer_lives_on(
    model_dir: Path,
) -> None:
    async with TrainerActor(TrainerConfig(world_size=1)) as trainer:
        await trainer.start(model_dir)
        broken = _batch(4)
        broken.responses = broken.responses[:, :3]  # no longer lines up with its mask
        with pytest.raises(ActorError) as caught:
            await trainer.step(broken)
        assert caught.value.method == "step" and "Traceback" in caught.value.remote_traceback
        assert (await trainer.step(_batch(4)))["grad_norm"] > 0


async def test_the_trainer_has_no_rpc_of_its_own() -> None:
    """Ranks are actors: every call to them goes through the runtime (one RPC stack, its
    deadlines and errors); nothing in ``rlasync.trainer`` opens a socket of its own."""
    import ast

    import rlasync.trainer

    for path in Path(rlasync.trainer.__file__).parent.glob("*.py"):
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        assert not imported & {"zmq", "socket"}, f"{path.name} imports {sorted(imported & {'zmq', 'socket'})}"


async def test_a_killed_rank_fails_the_call_at_once_not_at_the_deadline(model_dir: Path) -> None:
    async with TrainerActor(TrainerConfig(world_size=2, operation_timeout_s=600)) as trainer:
        await trainer.start(model_dir)
        os.kill(trainer.info["pids"][1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankLostError, match="trainer rank 1 .* was lost"):
            await trainer.step(_batch(4))
        assert time.monotonic() - started < 10  # its parent sees the exit: no heartbeat deadline either
        with pytest.raises(RankLostError, match="unusable"):
            await trainer.step(_batch(4))


async def test_ranks_on_two_nodes_take_the_step_and_a_lost_node_fails_the_call_with_rank_lost(
    model_dir: Path,
) -> None:
    """Rank 0 beside the head, rank 1 in a process node-1 supervises; node-1 killed: its rank's
    process dies with it, and the trainer's call fails with RankLostError, leaving no process."""
    runtime = RuntimeConfig(heartbeat_interval_s=0.2, node_dead_after_s=2.0, join_timeout_s=60)
    async with LocalCluster(nodes=2, config=runtime) as cluster:
        trainer = TrainerActor(
            TrainerConfig(world_size=2, operation_timeout_s=60), node=cluster.head, hosts=[0, 1]
        )
        try:
            await trainer.start(model_dir)
            assert trainer.processes == ["node-0.0", "node-1.0"]
            assert (await trainer.step(_batch(4)))["grad_norm"] > 0
            pids = trainer.info["pids"]
            os.kill(cluster.pid(1), signal.SIGKILL)
            started = time.monotonic()
            # The rank's process gets SIGTERM from the kernel when node-1 dies and stops; a step
            # already on its way may still be answered by it (a step takes ~50 ms): steps go on
            # until one fails, and it must fail with RankLostError, within the deadline.
            with pytest.raises(RankLostError):
                for _ in range(200):
                    await trainer.step(_batch(4))
                    assert time.monotonic() - started < 60, "the lost rank went unnoticed"
            assert time.monotonic() - started < 60
        finally:
            await trainer.close()
        for pid in pids:
            _wait_gone(pid, 15)


async def test_ranks_meet_at_master_addr_and_port_when_they_are_set(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's variables name the rendezvous: the store is there (hosted by this process
    unless torchrun's agent hosts it), and the ranks' group forms on it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    async with TrainerActor(TrainerConfig(world_size=2)) as trainer:
        await trainer.start(model_dir)
        assert trainer._store is not None and trainer._store.port == port
        assert (await trainer.step(_batch(4)))["grad_norm"] > 0


def _wait_gone(pid: int, seconds: float) -> None:
    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent to reap it is gone too
            return f.read().split(") ", 1)[1].startswith("Z")

    wait_until_sync(gone, timeout_s=seconds, interval_s=0.1, what=f"process {pid} is gone")


async def test_ranks_that_cannot_start_fail_within_the_start_deadline(tmp_path: Path) -> None:
    async with TrainerActor(TrainerConfig(world_size=1, start_timeout_s=60)) as trainer:
        with pytest.raises(ActorError, match="config.json"):
            await trainer.start(tmp_path / "no-model-here")
    # Ranks started from nothing (not forked from the test's spawner, torch loaded): half a
    # second is too short to start a process that imports torch.
    spawner = current_spawner()
    use_spawner(None)
    try:
        slow = TrainerActor(TrainerConfig(world_size=2, start_timeout_s=0.5))
        with pytest.raises(CallTimeout, match="trainer.start_timeout_s"):
            await slow.start(tmp_path)
        await slow.close()
        await slow.close()  # idempotent
    finally:
        use_spawner(spawner)


@pytest.mark.gpu
async def test_on_gpu_ranks_train_under_bf16_autocast_and_match_the_cpu_step(model_dir: Path) -> None:
    """NCCL when every rank gets its own GPU (else one rank); bf16 autocast, float32 master
    weights: the step lands near the float32 CPU step."""
    world = 2 if torch.cuda.device_count() >= 2 else 1
    batch = _batch(6)
    gpu_metrics, on_gpu = await _step_and_weights(
        model_dir, TrainerConfig(world_size=world, device="cuda", micro_batch_size=3), batch
    )
    _, on_cpu = await _step_and_weights(
        model_dir, TrainerConfig(world_size=1, device="cpu", micro_batch_size=3), batch
    )
    assert all(v.dtype == torch.float32 for v in on_gpu.values())
    assert gpu_metrics["grad_norm"] > 0 and _max_diff(on_gpu, on_cpu) <= 5e-3
