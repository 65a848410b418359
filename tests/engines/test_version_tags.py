"""Every token carries the weight version that generated it, across swaps at the engine's own
step: checked token by token against an oracle.

The versions differ only in the final norm's weight (``model.norm``, applied after every
layer), so the keys and values a token leaves in the cache are the same under every version:
a full forward pass of the whole sequence under version ``v`` gives exactly the logprob the
engine computes at a position while it serves ``v``, whichever versions made the tokens
before. For each generated token the oracle finds the version whose logprob matches the one
the engine recorded; it must be the version the token is tagged with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from waiting import wait_until

from rlasync.agents import SingleTurnAgentLoop
from rlasync.data import synthetic_rows
from rlasync.engines import SamplingParams, TorchEngine
from rlasync.models import load_pretrained_dir
from rlasync.weights.commit import take_version

uvloop = pytest.mark.asyncio(loop_factories=["uvloop"])

VERSIONS = 4
# The engine decodes with a KV cache, the oracle in one pass: the same float32 arithmetic in
# another order, which moves a logprob by ~1e-6 at this size (3 layers, width 128). A token
# is attributed to a version only if that version matches within MATCH and every other
# version is at least SEPARATE away (the perturbed norms move logprobs by ~0.1-1).
MATCH, SEPARATE = 1e-3, 1e-2


def _norms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    base = model.model.norm.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    return {0: base} | {v: base * 4 * torch.rand(base.shape, generator=gen) for v in range(1, VERSIONS + 1)}


@pytest.mark.parametrize("interrupt", ["keep", "abort"])
@uvloop
async def test_every_generated_token_is_tagged_with_the_version_that_generated_it(
    interrupt: str, nano_model_dir: Path
) -> None:
    model, tok = load_pretrained_dir(nano_model_dir)
    engine = TorchEngine(model, max_batch=8, seed=0)
    norms = _norms(model)
    rows = synthetic_rows("reverse", 6, seed=0, split="val")
    loops = [SingleTurnAgentLoop(engine, tok, trajectory_id=f"t{i}") for i in range(len(rows))]
    tasks = [
        asyncio.ensure_future(
            loop.run(SamplingParams(temperature=1.0, max_new_tokens=160, ignore_eos=True, seed=i), **row)
        )
        for i, (loop, row) in enumerate(zip(loops, rows))
    ]
    for version in range(1, VERSIONS + 1):
        # A swap every ~25 decode steps of the whole batch: mid-turn for every trajectory.
        await wait_until(
            lambda v=version: engine.stats().generated_tokens >= v * 25 * len(rows),
            interval_s=0.001,
            timeout_s=60,
            what=f"tokens before version {version}",
        )
        weight = {"model.norm.weight": norms[version].clone()}
        commit = await take_version(
            engine,
            lambda w=weight, v=version: engine.swap_weights(w, v),
            version=version,
            interrupt=interrupt,
        )
        assert commit.version == version and (commit.cut == 0) == (interrupt == "keep")
    trajectories = await asyncio.gather(*tasks)
    await engine.close()

    attributed, spanning = 0, 0
    for t in trajectories:
        assert len(t.response_ids) == 160 and all(t.response_mask)
        assert t.versions == sorted(t.versions)  # a turn moves forward through versions only
        spanning += len(set(t.versions)) > 1
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        oracle = []
        with torch.no_grad():
            for version in range(VERSIONS + 1):
                model.model.norm.weight.data = norms[version]
                logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1].float()
                oracle.append(
                    torch.log_softmax(logits, -1).gather(1, torch.tensor(t.response_ids)[:, None])[:, 0]
                )
        table = torch.stack(oracle)  # [version, token]
        error = (table - torch.tensor(t.logprobs)[None]).abs()
        for i, tagged in enumerate(t.versions):
            others = [error[v, i] for v in range(VERSIONS + 1) if v != tagged]
            if (
                min(abs(table[v, i] - table[tagged, i]) for v in range(VERSIONS + 1) if v != tagged)
                < SEPARATE
            ):
                continue  # two versions give this token about the same logprob: it proves nothing
            assert error[tagged, i] < MATCH, (t.trajectory_id, i, tagged, error[:, i].tolist())
            assert min(others) > MATCH
            attributed += 1
    total = sum(len(t.response_ids) for t in trajectories)
    assert attributed >= 0.8 * total, (attributed, total)
    assert spanning == len(trajectories)  # every swap landed in the middle of every turn
