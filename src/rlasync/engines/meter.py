"""Tokens per second over the last few seconds: the ``tokens_per_s`` of every engine's stats."""

from __future__ import annotations

import collections
import time


class TokenRate:
    """Record tokens as they are produced (from any thread); read the recent rate."""

    def __init__(self, window_s: float = 5.0, events: int = 256) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque(maxlen=events)
        self.total = 0  # every token recorded (one thread records: the engine's)
        self.last = 0  # the last record's tokens (the torch engine: its last decode step's rows)

    def add(self, tokens: int) -> None:
        self._events.append((time.monotonic(), tokens))  # deque.append is atomic under the GIL
        self.total += tokens
        self.last = tokens

    def per_second(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._events) if now - t < self.window_s]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)
