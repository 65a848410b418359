"""``Router.migrate``: a turn moved mid-generation from one engine (on one node process) to
another keeps every token it made and the version of each, checked token by token against an
oracle: the two engines serve different weights, so a full forward pass under each tells which
engine made which token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from waiting import wait_until

from rlasync import LocalCluster, RuntimeConfig
from rlasync.agents import SingleTurnAgentLoop
from rlasync.data import synthetic_rows
from rlasync.engines import EngineActor, EngineConfig, Router, RouterConfig, SamplingParams
from rlasync.models import load_pretrained_dir

FAST = RuntimeConfig(
    heartbeat_interval_s=0.2,
    node_dead_after_s=5,
    call_timeout_s=60,
    join_timeout_s=60,
    preload_modules=("rlasync.engines",),
)
TOKENS = 200
# The engine decodes with a KV cache and the oracle in one pass (float32 in another order):
# ~1e-6 apart. A token is attributed to a version only where the two versions' logprobs differ
# by SEPARATE at least; then the tagged one must match within MATCH (see test_version_tags).
MATCH, SEPARATE = 1e-3, 1e-2


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_migrated_turn_keeps_every_token_and_its_version(nano_model_dir: Path) -> None:
    model, tok = load_pretrained_dir(nano_model_dir)
    base = model.model.norm.weight.detach().clone()
    other = base * 4 * torch.rand(base.shape, generator=torch.Generator().manual_seed(0))
    config = EngineConfig(model=str(nano_model_dir), max_batch=8)
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        a = await cluster.spawn(EngineActor, config, node=1, name="engine-a")
        b = await cluster.spawn(EngineActor, config, node=2, name="engine-b")
        await b.update_weights({"model.norm.weight": other}, 1)  # b serves version 1: other weights
        async with Router([a, b], RouterConfig(load_refresh_s=0.2)) as router:
            rows = synthetic_rows("reverse", 6, seed=0, split="val")
            loops = [SingleTurnAgentLoop(router, tok, trajectory_id=f"t{i}") for i in range(len(rows))]
            params = [
                SamplingParams(temperature=1.0, max_new_tokens=TOKENS, ignore_eos=True, seed=i)
                for i in range(len(rows))
            ]
            tasks = [asyncio.ensure_future(loop.run(p, **row)) for loop, p, row in zip(loops, params, rows)]
            await wait_until(lambda: len(router.outstanding("engine-a")) == 3, what="three turns on engine-a")

            async def made_some() -> bool:
                return (await a.stats()).generated_tokens >= 3 * 40  # type: ignore[attr-defined]

            await wait_until(made_some, what="engine-a made ~40 tokens of each of its turns")
            moved = [rid for rid in router.outstanding("engine-a") if await router.migrate(rid, "engine-b")]
            assert len(moved) == 3
            assert not await router.migrate("no-such-request", "engine-b")
            assert not await router.migrate(router.outstanding("engine-b")[0], "engine-b")  # already there
            trajectories = await asyncio.gather(*tasks)
            assert router.stats().migrations == 3

    migrated = 0
    for t in trajectories:
        assert len(t.response_ids) == TOKENS and all(t.response_mask)  # none lost, none made twice
        assert t.versions == sorted(t.versions) and set(t.versions) <= {0, 1}
        migrated += set(t.versions) == {0, 1}
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        oracle = []
        with torch.no_grad():
            for norm in (base, other):
                model.model.norm.weight.data = norm
                logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1].float()
                oracle.append(
                    torch.log_softmax(logits, -1).gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
                )
        table = torch.stack(oracle)  # [version, token]
        error = (table - torch.tensor(t.logprobs)[None]).abs()
        attributed = 0
        for i, tagged in enumerate(t.versions):
            if abs(table[0, i] - table[1, i]) < SEPARATE:
                continue  # both weights give this token about the same logprob: it proves nothing
            assert error[tagged, i] < MATCH < error[1 - tagged, i], (
                t.trajectory_id,
                i,
                tagged,
                error[:, i].tolist(),
            )
            attributed += 1
        assert attributed >= 0.8 * TOKENS, (t.trajectory_id, attributed)
    assert migrated == 3  # the three moved turns hold tokens of both engines, in order


def test_the_repack_policy_frees_the_emptiest_engines_onto_the_fullest_small_one() -> None:
    from rlasync.engines.repack import repack_moves

    running = {"e0": ["a"], "e1": ["b", "c"], "e2": ["d"], "e3": [f"x{i}" for i in range(10)], "e4": []}
    # e3 is busy (above the threshold) and e4 idle: neither gives; e0 and e2 give to e1.
    assert sorted(repack_moves(running, waiting=5, below=2, target_max=64)) == [("a", "e1"), ("d", "e1")]
    assert repack_moves(running, waiting=0, below=2, target_max=64) == []  # nothing waits: no move
    assert repack_moves(running, waiting=5, below=0, target_max=64) == []  # off
    # The fullest fills (3 turns at most there), then the next fullest takes the rest.
    running = {"e0": ["a", "b"], "e1": ["c"], "e2": ["d"], "e3": ["e"]}
    moves = repack_moves(running, waiting=1, below=2, target_max=3)
    assert moves[0][1] == "e0" and len(moves) == 2
    targets = {t for _, t in moves}
    donors = {name for name, ids in running.items() if set(ids) & {r for r, _ in moves}}
    assert not targets & donors  # no engine both gives and takes


def test_the_rebalance_policy_evens_out_queues_with_queued_turns_only() -> None:
    from rlasync.engines.repack import rebalance_moves

    # e0: 9 requests, 3 of ours queued; e1: 3. All three move: 6 and 6.
    assert rebalance_moves({"e0": 9, "e1": 3}, {"e0": ["r9", "r8", "r7"]}) == [
        ("r9", "e1"),
        ("r8", "e1"),
        ("r7", "e1"),
    ]
    assert rebalance_moves({"e0": 9, "e1": 3}, {"e0": ["a", "b", "c", "d", "e"]}) == [
        ("a", "e1"),
        ("b", "e1"),
        ("c", "e1"),
    ]  # 6 and 6: no further move, so none moves back at the next look
    assert rebalance_moves({"e0": 4, "e1": 3}, {"e0": ["a"]}) == []  # one apart: even enough
    assert rebalance_moves({"e0": 4, "e1": 0}, {}) == []  # nothing queued: nothing moves
    # Two donors, one idle engine: the most loaded gives first; everyone ends within one.
    moves = rebalance_moves({"e0": 9, "e1": 8, "e2": 0}, {"e0": ["a", "b", "c"], "e1": ["x", "y", "z"]})
    loads = {"e0": 9, "e1": 8, "e2": 0}
    for request_id, target in moves:
        loads["e0" if request_id in "abc" else "e1"] -= 1
        loads[target] += 1
    assert {t for _, t in moves} == {"e2"} and max(loads.values()) - min(loads.values()) <= 1


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_queued_turn_moves_to_an_idle_engine_with_its_answer_whole(nano_model_dir: Path) -> None:
    """Two engines that start one turn at a time: the router alternates four turns between them,
    so engine-a runs a long one with another long one queued behind it, while engine-b's two
    short ones end at once. The queued one moves to engine-b (``router.rebalance_queued``) and
    every answer is whole: its length, every token a model token of version 0."""
    _, tok = load_pretrained_dir(nano_model_dir)
    config = EngineConfig(model=str(nano_model_dir), max_batch=1)
    async with LocalCluster(nodes=3, config=FAST) as cluster:
        a = await cluster.spawn(EngineActor, config, node=1, name="engine-a")
        b = await cluster.spawn(EngineActor, config, node=2, name="engine-b")
        async with Router([a, b], RouterConfig(load_refresh_s=0.1, rebalance_queued=True)) as router:
            rows = synthetic_rows("reverse", 4, seed=0, split="val")
            lengths = [TOKENS, 4, TOKENS, 4]  # alternating: a gets both long ones
            loops = [SingleTurnAgentLoop(router, tok, trajectory_id=f"t{i}") for i in range(4)]
            params = [
                SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i)
                for i, n in enumerate(lengths)
            ]
            trajectories = await asyncio.gather(
                *[loop.run(p, **row) for loop, p, row in zip(loops, params, rows)]
            )
            assert router.stats().migrations >= 1
        made = (await b.stats()).generated_tokens  # type: ignore[attr-defined]
    for t, n in zip(trajectories, lengths):
        assert len(t.response_ids) == n and all(t.response_mask) and set(t.versions) == {0}
    assert made >= TOKENS + 8  # engine-b made the moved long answer, besides its two short ones
