"""Tokens per second over the last few seconds: the ``tokens_per_s`` of every engine's stats."""

from __future__ import annotations

import collections
import threading
import time


class TokenRate:
    """Record tokens as they are produced (from any thread); read the recent rate."""

    def __init__(self, window_s: float = 5.0, events: int = 256) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque(maxlen=events)
        self.total = 0  # every token recorded (one thread records: the engine's)
        self.last = 0  # the last record's tokens (the torch engine: its last decode step's rows)
        # Copying a deque another thread appends to can raise ("mutated during iteration"):
        # /metrics reads the rate every scrape while the engine's thread records.
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:  # once per decode step, not per token
            self._events.append((time.monotonic(), tokens))
        self.total += tokens
        self.last = tokens

    def per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            events = list(self._events)
        recent = [(t, n) for t, n in events if now - t < self.window_s]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)
