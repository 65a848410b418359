"""How one engine takes a staged version, and how a fleet's engines take it without all stopping.

    commit = await take_version(engine, swap, interrupt="keep")   # in the engine's process
    results = await in_waves(targets, lambda t: t.commit(...))    # the synchroniser, per fleet

An engine takes a version at its own decode-step boundary; what happens to the turns it is
generating then is ``async_training.interrupt``:

- ``keep``: they go on across the swap with their KV cache; their later tokens carry the new
  version, the earlier ones the old (the per-token versions say which). An engine whose
  commands already run between two of its steps (``swaps_between_steps``: the torch engine and
  the simulator) just swaps; any other engine (vLLM, SGLang) is held with ``pause("keep")``,
  which freezes its running requests without dropping their cache, for the load. An engine
  that cannot (``can_keep = False``: SGLang's adapter) takes ``abort`` instead.
- ``abort``: they are cut (``pause("abort")``) and their loops re-submit them: their tokens are
  kept but must be prefilled again (``reprefill_tokens``). Today's behaviour before this module.
- ``drain``: the engine admits nothing new and lets them finish first (up to
  ``drain_timeout_s``; those still running then are cut as ``abort`` cuts them).

``in_waves`` commits a fleet's engines in two halves, one after the other, so that at no
instant are all of them paused (with one engine that cannot be helped), for the cost of two
round trips however many engines there are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import msgspec

Interrupt = Literal["keep", "abort", "drain"]
INTERRUPTS: tuple[Interrupt, ...] = ("keep", "abort", "drain")

T = TypeVar("T")
R = TypeVar("R")


class Commit(msgspec.Struct, frozen=True, kw_only=True):
    """One engine taking one version."""

    version: int
    interrupt: Interrupt
    pause_s: float
    """Decoding time this engine lost to the version: the swap, plus for ``abort`` and ``drain``
    the whole window from its pause to its resume."""
    began: float
    """Wall-clock time (``time.time()``) the pause began: intervals of several engines on one
    machine compare; across machines only as well as their clocks agree."""
    reprefill_tokens: int = 0
    """Tokens of the turns this commit cut, which their engine must prefill again."""
    cut: int = 0
    """Turns cut."""

    @property
    def ended(self) -> float:
        return self.began + self.pause_s


async def take_version(
    engine: Any,
    swap: Callable[[], Awaitable[float | None]],
    *,
    version: int,
    interrupt: Interrupt = "keep",
    drain_timeout_s: float = 120.0,
) -> Commit:
    """Have ``engine`` take a staged version by running ``swap`` (which installs it and may return
    the seconds the engine was held for it) under the ``interrupt`` policy above."""
    if interrupt not in INTERRUPTS:
        raise ValueError(f"interrupt must be one of {INTERRUPTS}, got {interrupt!r}")
    if interrupt == "keep" and not getattr(engine, "can_keep", True):
        interrupt = "abort"  # it cannot hold a running turn across a load (SGLang): cut, as before
    began, wall = time.perf_counter(), time.time()
    if interrupt == "keep" and getattr(engine, "swaps_between_steps", False):
        held = await swap()  # the engine runs it between two steps: the only pause is the swap
        pause = float(held) if held is not None else time.perf_counter() - began
        return Commit(version=version, interrupt=interrupt, pause_s=pause, began=wall)
    cut: list[Any] = []
    if interrupt == "keep":
        await engine.pause("keep")
    elif interrupt == "abort":
        cut = list(await engine.pause("abort"))
    else:
        try:
            await engine.pause("wait", timeout=drain_timeout_s)
        except TimeoutError:
            cut = list(await engine.pause("abort"))
    try:
        await swap()
    finally:
        await engine.resume()
    return Commit(
        version=version,
        interrupt=interrupt,
        pause_s=time.perf_counter() - began,
        began=wall,
        reprefill_tokens=sum(len(out.prompt_ids) + len(out.token_ids) for out in cut),
        cut=len(cut),
    )


async def in_waves(items: Sequence[T], commit: Callable[[T], Awaitable[R]]) -> list[R | BaseException]:
    """``commit`` each item, half of them at once and then the other half, so that the two
    halves never pause together; results (or exceptions) in ``items``' order."""
    half = (len(items) + 1) // 2
    first = await asyncio.gather(*[commit(item) for item in items[:half]], return_exceptions=True)
    second = await asyncio.gather(*[commit(item) for item in items[half:]], return_exceptions=True)
    return [*first, *second]


def all_paused(commits: Sequence[Commit], engines: int) -> bool:
    """Was there an instant at which every one of ``engines`` engines was paused for this version?
    (Only if each of them reported a pause and all the pauses overlap.)"""
    if engines == 0 or len(commits) < engines:
        return False
    return max(c.began for c in commits) < min(c.ended for c in commits)


__all__ = ["INTERRUPTS", "Commit", "Interrupt", "all_paused", "in_waves", "take_version"]
