"""Bucket plans: where each parameter travels, and packing it there and back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlasync.weights import contiguous_bucket, flat_layout, pack, plan_buckets, plan_for, unpack
from rlasync.weights.buckets import ALIGN, solo


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(100).bfloat16(),
        "d": torch.randn(2),
        "e": torch.empty(0, 3),
        "f": torch.randn(4, 4).t(),  # non-contiguous
    }


@pytest.mark.parametrize("bucket_bytes", [1, 40, 64, 300, 1000, 1 << 20])
def test_every_tensor_round_trips_through_its_bucket(bucket_bytes: int) -> None:
    tensors = _tensors()
    plan = plan_for(tensors, bucket_bytes)
    out = {}
    for index in range(len(plan.sizes)):
        buffer = pack(plan, index, tensors).clone()
        out.update({name: view.clone() for name, view in unpack(plan, index, buffer)})
    assert out.keys() == tensors.keys()
    assert all(out[k].dtype == tensors[k].dtype and torch.equal(out[k], tensors[k]) for k in tensors)
    assert [t.name for t in plan.tensors] == list(tensors)  # order kept
    assert all(t.offset % ALIGN == 0 for t in plan.tensors)


def test_buckets_fill_up_to_their_size_and_big_tensors_travel_alone() -> None:
    plan = plan_buckets(
        [("x", (10,), "float32"), ("y", (10,), "float32"), ("z", (100,), "float32"), ("w", (1,), "float32")],
        100,
        alone_bytes=400,
    )
    # x (40 B) and y (40 B at offset 48) share a bucket; z (400 B) is alone; w starts a new one.
    assert [(t.name, t.bucket, t.offset) for t in plan.tensors] == [
        ("x", 0, 0),
        ("y", 0, 48),
        ("z", 1, 0),
        ("w", 2, 0),
    ]
    assert plan.sizes == [88, 400, 4] and solo(plan, 1) is not None and solo(plan, 0) is None
    assert plan.digest != plan_buckets([("x", (10,), "float32")], 100).digest
    with pytest.raises(ValueError, match="at least one byte"):
        plan_buckets([], 0)


def test_packing_a_tensor_that_changed_shape_is_an_error() -> None:
    tensors = _tensors()
    plan = plan_for(tensors, 1 << 20)
    tensors["a"] = torch.randn(5, 3)
    with pytest.raises(ValueError, match="a: planned float32"):
        pack(plan, 0, tensors)


def test_parameters_laid_out_as_the_buckets_are_sent_from_their_own_memory() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    plan = plan_for({n: p.detach() for n, p in params.items()}, 300)
    assert (
        len(plan.bucket(1)) > 1
        and contiguous_bucket(plan, 1, {n: p.detach() for n, p in params.items()}) is None
    )  # scattered
    flat = flat_layout(plan, params)
    live = {name: p.detach() for name, p in model.named_parameters()}
    assert all(torch.equal(live[n], before[n]) for n in before)  # values kept
    for index in range(len(plan.sizes)):
        view = contiguous_bucket(plan, index, live)
        assert view is not None and view.data_ptr() >= flat.data_ptr()
        assert torch.equal(view, pack(plan, index, live))  # the same bytes packing would send
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # training goes on in place
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert not torch.equal(live["0.weight"], before["0.weight"])
    assert torch.equal(contiguous_bucket(plan, 0, live), pack(plan, 0, live))


def test_shared_weights_are_found_only_by_their_nonce_and_a_changed_buffer_is_never_copied(
    tmp_path: Path,
) -> None:
    from rlasync.weights import SharedWeights, ShmOffer, SyncError, flat_layout, plan_for

    params = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64)}
    plan = plan_for(params, 64)
    shared = SharedWeights.create(tmp_path, plan)
    flat_layout(plan, params, out=shared.data)  # the tensors now live in the file
    offer = shared.offer
    assert (
        SharedWeights.open(ShmOffer(offer.path, offer.nonce + 1, offer.nbytes), plan) is None
    )  # another machine's file
    assert SharedWeights.open(ShmOffer(str(tmp_path / "missing"), offer.nonce, offer.nbytes), plan) is None
    view = SharedWeights.open(offer, plan)
    assert view is not None
    staging = torch.zeros(offer.nbytes, dtype=torch.uint8)
    with pytest.raises(SyncError, match="not published within"):
        view.copy_into(staging, 1, timeout_s=0.05)  # created as "changing": nothing to copy yet
    shared.publish(1)
    view.copy_into(staging, 1, timeout_s=1)
    assert torch.equal(staging, shared.data)
    shared.publish(2)
    with pytest.raises(SyncError, match="published 2"):
        view.copy_into(staging, 1, timeout_s=1)
    shared.close()
    assert not Path(offer.path).exists()


def test_the_relay_holds_the_newest_versions_as_snapshots_the_parameters_may_change_after(
    tmp_path: Path,
) -> None:
    from rlasync.weights import SharedWeights, SyncError, flat_layout, flat_views, plan_for

    params = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64)}
    plan = plan_for(params, 64)
    flat = flat_layout(plan, params)  # the trainer's own memory, not the file
    relay = SharedWeights.create(tmp_path, plan, slots=2)
    engine = SharedWeights.open(relay.offer, plan)
    assert engine is not None and engine.slots == 2
    held = {}
    for version in (1, 2):
        relay.hold(version, lambda out: out.copy_(flat))
        held[version] = flat.clone()
        params["a"].add_(1.0)  # the next step changes the parameters: the snapshot does not move
    assert relay.hold(2, lambda out: out.fill_(0)) is relay.datas[1]  # held already: not copied again
    staging = torch.zeros(relay.data.numel(), dtype=torch.uint8)
    for version in (1, 2):  # both still readable, whatever the trainer did since
        engine.copy_into(staging, version, timeout_s=1)
        assert torch.equal(staging[: flat.numel()], held[version])
    assert torch.equal(flat_views(plan, staging)["a"], flat_views(plan, held[2])["a"])
    relay.hold(3, lambda out: out.copy_(flat))  # into version 1's slot
    with pytest.raises(SyncError, match=r"published 3 \(its relay holds versions \[2, 3\]"):
        engine.copy_into(staging, 1, timeout_s=1)
    relay.close()


def test_a_relay_slot_being_sent_from_is_never_overwritten(tmp_path: Path) -> None:
    """A pair group sends a version from its slot (``pin``): a newer version goes into another
    slot, even the newest one's, and with every slot being sent from the trainer waits (up to
    its deadline) instead of overwriting what a send still reads."""
    from rlasync.weights import SharedWeights, SyncError, plan_for

    plan = plan_for({"a": torch.zeros(8)}, 64)
    relay = SharedWeights.create(tmp_path, plan, slots=2)
    for version in (1, 2):
        relay.hold(version, lambda out, v=version: out.fill_(v))
    slot, release = relay.pin(1)  # an engine two versions behind is still receiving v1
    assert int(slot[0]) == 1
    relay.hold(3, lambda out: out.fill_(3))  # into v2's slot, the one free
    assert int(slot[0]) == 1 and sorted(int(h[1]) for h in relay.headers) == [1, 3]
    _, release_3 = relay.pin(3)
    with pytest.raises(SyncError, match="every slot is being sent"):
        relay.hold(4, lambda out: out.fill_(4), wait_s=0.05)
    release()
    release()  # a second call does nothing (a pair closed while its send still ran)
    relay.hold(4, lambda out: out.fill_(4))  # into v1's slot, free again
    assert sorted(int(h[1]) for h in relay.headers) == [3, 4]
    with pytest.raises(SyncError, match=r"version 1 is no longer held \(it holds \[3, 4\]\)"):
        relay.pin(1)
    release_3()
    relay.close()
