"""Waiting on a condition instead of sleeping a fixed time (issue 20).

A test that needs "X has happened" polls for X with `wait_until` (async tests) or `wait_until_sync`
(plain tests) rather than sleeping a guessed time: it goes on as soon as X holds, and on a slow
machine it waits longer instead of checking too early. On timeout it fails with an AssertionError
that names the condition. Importable from every test folder as ``from waiting import wait_until``
(``pythonpath = ["tests"]`` in pyproject's pytest options).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

__all__ = ["wait_until", "wait_until_sync"]


async def wait_until(
    predicate: Callable[[], object] | Callable[[], Awaitable[object]],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    what: str,
) -> None:
    """Poll ``predicate`` every ``interval_s`` seconds until it returns something truthy.

    ``predicate`` is a plain function or a coroutine function (its result is awaited). It is
    called at once, then after each pause; an exception it raises propagates. When it is still
    false after ``timeout_s`` seconds this raises ``AssertionError`` naming ``what`` (the
    condition, e.g. ``"the call reached the actor"``) and the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        await asyncio.sleep(interval_s)


def wait_until_sync(
    predicate: Callable[[], object],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    what: str,
) -> None:
    """`wait_until` for plain (not async) tests: polls ``predicate`` with ``time.sleep``.

    ``predicate`` is a plain function. When it is still false after ``timeout_s`` seconds this
    raises ``AssertionError`` naming ``what`` and the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(interval_s)
