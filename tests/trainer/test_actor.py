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
from numerics import adamw_first_steps_agree, assert_same_sgd_step, forward_rtol, step_rtol
from waiting import wait_until_sync

from rlasync import LocalCluster
from rlasync.config import RuntimeConfig, TrainerConfig
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


def _rtol(model_dir: Path, batch: TrainBatch) -> float:
    """Rounding's reach on this batch's step (``numerics.step_rtol``: forward, backward, the sum
    over the batch's positions), for the model in ``model_dir``."""
    from transformers import AutoConfig

    sequence = batch.prompts.shape[1] + batch.responses.shape[1]
    return step_rtol(AutoConfig.from_pretrained(model_dir), tokens=batch.size * sequence, sequence=sequence)


def _local_step(model_dir: Path, config: TrainerConfig, batch: TrainBatch) -> tuple[PolicyTrainer, dict]:
    """The step in this process, one rank: the reference, whose gradients stay readable."""
    from rlasync.models import load_pretrained_dir

    local = PolicyTrainer(load_pretrained_dir(model_dir)[0], config)
    return local, local.step(batch, temperature=0.8)


def _start(model_dir: Path) -> dict[str, torch.Tensor]:
    from rlasync.models import load_pretrained_dir

    return {k: v.detach().clone() for k, v in load_pretrained_dir(model_dir)[0].named_parameters()}


# A plain SGD step of lr 1 writes the summed gradient into the weights (numerics.assert_same_sgd_step):
# ranks are compared on what is equal up to rounding, not on AdamW's sign of a near-zero gradient.
SGD = {"optimizer": "sgd", "lr": 1.0}


@pytest.mark.numerics
async def test_two_gloo_ranks_take_the_step_one_rank_takes_on_the_whole_batch(model_dir: Path) -> None:
    batch, start = _batch(6), _start(model_dir)
    rtol = _rtol(model_dir, batch)
    # Micro-batches of 3: one rank accumulates rows 0-2 then 3-5; two ranks take one each.
    one, w1 = await _step_and_weights(
        model_dir, TrainerConfig(world_size=1, micro_batch_size=3, **SGD), batch
    )
    two, w2 = await _step_and_weights(
        model_dir, TrainerConfig(world_size=2, micro_batch_size=3, **SGD), batch
    )
    assert_same_sgd_step(start, w1, w2, lr=1.0, rtol=rtol)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=rtol)
    assert two["tokens"] == one["tokens"] == float(batch.response_mask.sum())
    for key in ("loss", "ppo_kl", "ratio_mean", "ratio_min", "ratio_max"):  # forward figures
        assert two[key] == pytest.approx(one[key], rel=rtol, abs=rtol), key
    # A share of tokens: one whose ratio sits within rounding of a clip bound may count on one side.
    assert abs(two["pg_clipfrac"] - one["pg_clipfrac"]) <= 1 / one["tokens"]
    # The step really moved the parameters (so "equal" is not "both unchanged").
    assert _max_diff(w1, start) > 1e-4


@pytest.mark.numerics
async def test_fsdp2_shards_take_the_same_step_and_checkpoints_move_between_strategies(
    model_dir: Path, tmp_path: Path
) -> None:
    """Uneven shards (7 rows: 4 + 3, micro-batches of 2: the short rank runs a filler so both
    gather parameters as often). Checkpoints are saved whole: an FSDP2 one resumes under DDP."""
    batch, follow = _batch(7), _batch(6, seed=2)
    rtol = _rtol(model_dir, batch)
    ddp, _ = _local_step(model_dir, TrainerConfig(micro_batch_size=2), batch)
    async with TrainerActor(TrainerConfig(world_size=2, strategy="fsdp2", micro_batch_size=2)) as trainer:
        await trainer.start(model_dir)
        first = await trainer.step(batch, temperature=0.8)
        fsdp = await trainer.weights()
        await trainer.save(tmp_path / "ckpt")
        expected_next = await trainer.step(follow, temperature=0.8)
        logprobs = await trainer.compute_logprobs(follow, temperature=0.8)
    gradients = {n: p.grad for n, p in ddp.model.named_parameters()}
    tight, total = adamw_first_steps_agree(fsdp, ddp.weights(), gradients, lr=1e-3, rtol=rtol)
    assert tight > total / 2 and first["tokens"] == float(batch.response_mask.sum())
    assert logprobs.shape == follow.responses.shape
    async with TrainerActor(TrainerConfig(world_size=1, micro_batch_size=2)) as resumed:
        await resumed.start(model_dir)
        assert await resumed.load(tmp_path / "ckpt") == 1
        assert _max_diff(await resumed.weights(), fsdp) == 0.0
        again = await resumed.step(follow, temperature=0.8)
    for key in ("loss", "grad_norm", "ratio_mean"):  # the optimiser state came along too
        assert again[key] == pytest.approx(expected_next[key], rel=rtol), key


async def test_activation_checkpointing_recomputes_the_very_same_gradients(model_dir: Path) -> None:
    """A checkpointed block runs its forward again, in the backward, on the same input with the
    same kernels in the same process: the same activations bit for bit, so the same gradients
    bit for bit (no tolerance to derive: nothing is summed in another order). Logprobs without
    grad (where checkpointing does nothing) likewise."""
    batch = _batch(6, seed=3)
    plain, plain_metrics = _local_step(model_dir, TrainerConfig(**SGD, micro_batch_size=3), batch)
    saving, saving_metrics = _local_step(
        model_dir, TrainerConfig(**SGD, micro_batch_size=3, gradient_checkpointing=True), batch
    )
    assert saving.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    grads = {n: p.grad for n, p in plain.model.named_parameters()}
    for name, p in saving.model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert saving_metrics["loss"] == plain_metrics["loss"]
    assert torch.equal(saving.compute_logprobs(batch), plain.compute_logprobs(batch))


@pytest.mark.numerics
async def test_fsdp2_ranks_with_activation_checkpointing_take_the_plain_step(model_dir: Path) -> None:
    """Checkpointing composes with FSDP2's sharded blocks: two sharded, checkpointed ranks sum
    the gradients one plain rank computes (up to the rounding of the split, as without it)."""
    batch, start = _batch(7, seed=4), _start(model_dir)
    rtol = _rtol(model_dir, batch)
    saving = {"world_size": 2, "strategy": "fsdp2", "micro_batch_size": 2, "gradient_checkpointing": True}
    _, distributed = await _step_and_weights(model_dir, TrainerConfig(**saving, **SGD), batch)
    local, _ = _local_step(model_dir, TrainerConfig(**SGD), batch)
    assert_same_sgd_step(start, distributed, local.weights(), lr=1.0, rtol=rtol)


@pytest.mark.numerics
async def test_ranks_agree_with_the_in_process_trainer_whatever_the_split(model_dir: Path) -> None:
    """Uneven shards (7 rows on 2 ranks, micro-batches of 2) and seq-mean aggregation: the same
    summed gradients up to float rounding, so the same SGD step; and the same AdamW step wherever
    the gradient is well above AdamW's eps (``numerics.adamw_first_steps_agree``)."""
    batch, start = _batch(7, seed=1), _start(model_dir)
    rtol = _rtol(model_dir, batch)
    split = {"world_size": 2, "micro_batch_size": 2, "loss_agg": "seq-mean-token-mean"}
    _, distributed = await _step_and_weights(model_dir, TrainerConfig(**split, **SGD), batch)
    local, _ = _local_step(model_dir, TrainerConfig(loss_agg="seq-mean-token-mean", **SGD), batch)
    assert_same_sgd_step(start, distributed, local.weights(), lr=1.0, rtol=rtol)
    _, distributed = await _step_and_weights(model_dir, TrainerConfig(**split, lr=1e-3), batch)
    local, _ = _local_step(model_dir, TrainerConfig(loss_agg="seq-mean-token-mean", lr=1e-3), batch)
    gradients = {n: p.grad for n, p in local.model.named_parameters()}
    tight, total = adamw_first_steps_agree(distributed, local.weights(), gradients, lr=1e-3, rtol=rtol)
    assert tight > total / 2  # most of the model is checked to rounding, not to +-lr


@pytest.mark.numerics
@pytest.mark.parametrize("balance_batch", [True, False])
async def test_logprobs_are_gathered_in_row_order(model_dir: Path, balance_batch: bool) -> None:
    """Shards balanced by tokens (rows 0, 2, 3 on one rank, 1, 4 on the other) or contiguous:
    either way the logprobs come back in the batch's row order."""
    batch = _batch(5)
    from transformers import AutoConfig

    from rlasync.models import load_pretrained_dir

    expected = PolicyTrainer(load_pretrained_dir(model_dir)[0]).compute_logprobs(batch, temperature=0.8)
    async with TrainerActor(TrainerConfig(world_size=2, balance_batch=balance_batch)) as trainer:
        await trainer.start(model_dir)
        got = await trainer.compute_logprobs(batch, temperature=0.8)
    # Each rank runs its rows as a smaller batch (other matmul blocking): the same forward up to
    # rounding, relative to the logprobs' scale.
    rtol = forward_rtol(AutoConfig.from_pretrained(model_dir), sequence=12)
    assert got.shape == expected.shape and float((got - expected).abs().max()) <= rtol * float(
        expected.abs().max()
    )


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
    # AdamW's first update is lr * g / (|g| + eps), within [-lr, lr] whatever bf16 did to g: the
    # two steps agree to 2 lr (lr 1e-3) plus a float32 weight's spacing: all the maths allows,
    # as bf16's rounding (2^-8) may turn a small gradient's sign.
    assert gpu_metrics["grad_norm"] > 0 and _max_diff(on_gpu, on_cpu) <= 2 * 1e-3 + 1e-6
