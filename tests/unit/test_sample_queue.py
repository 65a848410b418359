"""The sample queue's staleness bound over long randomized runs: never exceeded, nothing dropped."""

from __future__ import annotations

import asyncio
import random

import pytest

from rlasync.modes.queue import QueueClosed, SampleQueue, StalenessError


async def _run(
    seed: int,
    *,
    batch: int,
    steps_per_version: int,
    max_staleness: int,
    capacity: int | None,
    steps: int,
    released: bool = False,
) -> tuple[SampleQueue[int], list[tuple[int, int]]]:
    """A rollouter admitting as fast as the queue allows, samples finishing after random delays
    (a long tail), and a trainer taking ``steps`` steps; returns (admitted version, trained version) pairs.
    ``released``: the trainer goes on once it publishes a version, and the engines take it
    later (``serve`` after a random delay, sometimes longer than several steps); each admission
    is then checked against the version the engines really served at that instant."""
    rng = random.Random(seed)
    engines_serve = 0  # the oldest version the simulated engines serve
    queue: SampleQueue[int] = SampleQueue(
        batch, steps_per_version=steps_per_version, max_staleness=max_staleness, capacity=capacity
    )
    trained: list[tuple[int, int]] = []
    running: set[asyncio.Task[None]] = set()

    async def sample(ticket: object) -> None:
        await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.001, 0.01]))  # some samples are 10-20x slower
        await queue.put(ticket, ticket.index)  # type: ignore[attr-defined]

    async def rollouter() -> None:
        while True:
            ticket = await queue.admit()
            assert ticket.version <= engines_serve  # no token older than the version it is counted at
            task = asyncio.create_task(sample(ticket))
            running.add(task)
            task.add_done_callback(running.discard)

    async def engines_take(version: int, after_s: float) -> None:
        nonlocal engines_serve
        await asyncio.sleep(after_s)
        engines_serve = max(engines_serve, version)
        queue.serve(version)

    producer = asyncio.create_task(rollouter())
    for step in range(steps):
        for ticket, index in await queue.take():
            assert index == ticket.index
            trained.append((ticket.version, queue.version))
        if (step + 1) % steps_per_version == 0:
            await asyncio.sleep(rng.choice([0, 0.0005]))  # the weight sync
            if not released:
                await queue.advance()
                engines_serve = queue.version
                continue
            await queue.advance(served=False)
            running.add(asyncio.create_task(engines_take(queue.version, rng.choice([0, 0.001, 0.005, 0.02]))))
    producer.cancel()
    await asyncio.gather(producer, *running, return_exceptions=True)
    return queue, trained


@pytest.mark.parametrize(
    "batch, steps_per_version, max_staleness, capacity",
    [(4, 1, 0, None), (4, 1, 1, None), (3, 2, 2, None), (5, 4, 1, 7), (2, 3, 3, 9)],
)
async def test_no_sample_is_trained_past_its_bound_and_none_is_dropped(
    batch: int, steps_per_version: int, max_staleness: int, capacity: int | None
) -> None:
    for seed in range(2):
        queue, trained = await _run(
            seed,
            batch=batch,
            steps_per_version=steps_per_version,
            max_staleness=max_staleness,
            capacity=capacity,
            steps=60,
        )
        assert len(trained) == 60 * batch
        staleness = [at - admitted for admitted, at in trained]
        assert min(staleness) >= 0 and max(staleness) <= max_staleness
        if max_staleness:
            assert max(staleness) == max_staleness  # the bound is used, not just respected
        # Nothing dropped: everything admitted was trained on, or is still waiting (in flight or ready).
        assert queue.admitted == queue.consumed + queue.ready + queue.running
        assert queue.ready + queue.running <= queue.capacity


@pytest.mark.parametrize("batch, steps_per_version, max_staleness", [(4, 1, 0), (4, 1, 1), (3, 2, 2)])
async def test_with_engines_taking_versions_after_the_trainer_the_bound_holds_from_what_they_serve(
    batch: int, steps_per_version: int, max_staleness: int
) -> None:
    """Released delivery: the trainer's version moves at its publish, the engines' when they
    take it. Admissions count from the engines' oldest version, so the bound holds for every
    token; the run neither deadlocks nor drops a sample, even on-policy (staleness 0)."""
    for seed in range(2):
        queue, trained = await _run(
            seed,
            batch=batch,
            steps_per_version=steps_per_version,
            max_staleness=max_staleness,
            capacity=None,
            steps=60,
            released=True,
        )
        assert len(trained) == 60 * batch
        assert all(0 <= at - admitted <= max_staleness for admitted, at in trained)
        assert queue.admitted == queue.consumed + queue.ready + queue.running
    assert queue.served <= queue.version


async def test_on_policy_means_every_sample_trained_at_the_version_it_was_admitted_at() -> None:
    _, trained = await _run(7, batch=4, steps_per_version=1, max_staleness=0, capacity=None, steps=40)
    assert all(admitted == at for admitted, at in trained)


async def test_misuse_is_an_error_not_a_silent_violation() -> None:
    queue: SampleQueue[int] = SampleQueue(2, steps_per_version=1)
    with pytest.raises(StalenessError, match="advance"):
        await queue.advance()  # no step taken yet at this version
    for _ in range(2):
        await queue.put(await queue.admit(), 0)
    await queue.take()
    assert not queue.can_admit()  # on-policy: nothing new until the weights change
    with pytest.raises(StalenessError, match="advance"):
        await queue.take()
    with pytest.raises(ValueError, match="less than one batch"):
        SampleQueue(4, capacity=3)
    await queue.close()
    with pytest.raises(QueueClosed):
        await queue.admit()


async def test_close_wakes_waiters_with_queue_closed_and_cancelling_still_cancels() -> None:
    """Closing ends every wait with ``QueueClosed`` (no task was cancelled); cancelling a
    waiting task is still a ``CancelledError``."""
    queue: SampleQueue[int] = SampleQueue(1)
    admitted = await queue.admit()
    waiting = [asyncio.ensure_future(queue.admit()), asyncio.ensure_future(queue.take())]
    cancelled = asyncio.ensure_future(queue.take())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await queue.close()
    for task in waiting:
        with pytest.raises(QueueClosed):
            await task
    with pytest.raises(QueueClosed):
        await queue.take()
    await queue.put(admitted, 0)
    assert queue.take_nowait() is None


async def test_a_restored_queue_keeps_every_ticket_and_its_deadline() -> None:
    """A checkpoint's queue state, restored in a fresh queue: the same tickets with their
    versions and deadlines, finished samples ready, and the same admissions and batches after."""
    import msgspec

    from rlasync.modes.queue import QueueState, StalenessError

    def make() -> SampleQueue[str]:
        return SampleQueue(2, steps_per_version=1, max_staleness=1)

    queue = make()
    tickets = [await queue.admit() for _ in range(4)]
    for t in tickets[:2]:
        await queue.put(t, f"s{t.index}")
    assert [t.index for t, _ in await queue.take()] == [0, 1]
    await queue.advance()
    await queue.put(tickets[2], "s2")
    state, finished = queue.state()
    state = msgspec.msgpack.decode(
        msgspec.msgpack.encode(state), type=QueueState
    )  # as a checkpoint stores it
    restored = make()
    running = restored.restore(state, finished)
    assert [t.index for t in running] == [3] and (restored.version, restored.ready, restored.running) == (
        1,
        1,
        1,
    )
    assert {(t.index, t.version, t.deadline) for t in restored._open.values()} == {(2, 0, 1), (3, 0, 1)}
    for q in (queue, restored):  # both go on alike: the next ticket, then the same batch
        assert (await q.admit()).index == 4
        await q.put(next(t for i, t in q._open.items() if i == 3), "s3")
        assert [t.index for t, _ in await q.take()] == [2, 3]
    with pytest.raises(StalenessError, match="resume with the settings it was saved with"):
        SampleQueue(1, steps_per_version=1, max_staleness=0).restore(
            state, finished
        )  # batch 1, staleness 0: deadlines missed
    with pytest.raises(ValueError, match="not the state's"):
        make().restore(state, {})
