"""``NodeRelay``: what one engine of a node received, copied by the node's others. A version is
copied whole or the copy is an error: one overtaken by a newer version says so (the puller then
takes the newest), one that never comes fails at its deadline; a slot being copied from is never
overwritten. On a GPU node the slots are pinned host memory."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlasync.weights import SyncError, plan_for
from rlasync.weights.node_relay import NodeRelay

pytestmark = pytest.mark.asyncio(loop_factories=["uvloop"])


def _relay(key: str, device: str = "cpu") -> tuple[NodeRelay, NodeRelay, int]:
    plan = plan_for({"a": torch.zeros(16), "b": torch.zeros(3, dtype=torch.int64)}, 64)
    first, filler = NodeRelay.of(key, plan, slots=2, device=torch.device(device))
    second, other = NodeRelay.of(key, plan, slots=2, device=torch.device(device))
    assert filler and not other and first is second  # one relay per node process and synchroniser
    return first, second, int(first._nbytes)


async def test_a_node_with_one_engine_keeps_nothing() -> None:
    plan = plan_for({"a": torch.zeros(16)}, 64)
    relay, filler = NodeRelay.of("alone", plan, slots=2, device=torch.device("cpu"))
    relay.put(1, torch.ones(64, dtype=torch.uint8))
    assert filler and relay.datas == [] and relay.versions == [-1, -1]  # no copy, no memory
    NodeRelay.forget("alone")


async def test_the_nodes_other_engines_copy_each_version_the_first_one_put() -> None:
    relay, _, nbytes = _relay("copy")
    staging = torch.zeros(nbytes, dtype=torch.uint8)
    waiting = asyncio.ensure_future(relay.copy_into(staging, 1, timeout_s=10))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # v1 has not reached the node yet
    await asyncio.to_thread(relay.put, 1, torch.full((nbytes,), 1, dtype=torch.uint8))  # the filler's thread
    await waiting
    assert torch.equal(staging, torch.full((nbytes,), 1, dtype=torch.uint8))
    for version in (2, 3):
        relay.put(version, torch.full((nbytes,), version, dtype=torch.uint8))
    with pytest.raises(SyncError, match="waited for version 1, the node holds 3"):
        await relay.copy_into(staging, 1, timeout_s=1)  # overtaken: the puller takes the newest
    with pytest.raises(SyncError, match="did not reach this node within"):
        await relay.copy_into(staging, 4, timeout_s=0.05)
    NodeRelay.forget("copy")
    assert NodeRelay.of("copy", relay.plan, slots=2, device=torch.device("cpu"))[1]  # a new filler
    NodeRelay.forget("copy")


async def test_a_slot_being_copied_from_is_not_overwritten() -> None:
    relay, _, nbytes = _relay("pinned-slot")
    relay.put(1, torch.full((nbytes,), 1, dtype=torch.uint8))
    relay.put(2, torch.full((nbytes,), 2, dtype=torch.uint8))
    relay._pins[relay.versions.index(1)] += 1  # an engine is copying v1 (as copy_into holds it)
    relay.put(3, torch.full((nbytes,), 3, dtype=torch.uint8))  # into v2's slot, the free one
    assert sorted(relay.versions) == [1, 3]
    relay._pins[relay.versions.index(1)] -= 1
    NodeRelay.forget("pinned-slot")


@pytest.mark.gpu
async def test_on_a_gpu_node_the_slots_are_pinned_and_copies_land_on_the_engines_device() -> None:
    relay, _, nbytes = _relay("cuda", device="cuda")
    received = torch.arange(nbytes, dtype=torch.uint8, device="cuda")  # what the filler got over NCCL
    await asyncio.to_thread(relay.put, 1, received)
    assert all(data.is_pinned() for data in relay.datas)
    staging = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    await relay.copy_into(staging, 1, timeout_s=10)
    assert torch.equal(staging, received)
    NodeRelay.forget("cuda")
