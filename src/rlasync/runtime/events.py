"""Milestones of a run that a launcher waits for: a node joined, every node is in, the
trainer's group did its first collective.

Code anywhere calls ``emit("joined", node="node-1")``: a log record of the ``rlasync.events``
logger. A process started by ``rlasync launch`` prints each one on stdout as one line,
``@rlasync {"event": "joined", "node": "node-1"}``, which the launcher reads (``parse``) from
the output it relays; elsewhere they are ordinary INFO log lines.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

MARK = "@rlasync "
log = logging.getLogger("rlasync.events")


def emit(event: str, **fields: Any) -> None:
    log.info(
        "%s %s",
        event,
        " ".join(f"{k}={v}" for k, v in fields.items()),
        extra={"rlasync_event": {"event": event, **fields}},
    )


class _Printer(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "rlasync_event", None)
        if event is not None:
            sys.stdout.write(MARK + json.dumps(event) + "\n")
            sys.stdout.flush()


def print_events() -> None:
    """From now on this process prints its milestones on stdout for a launcher (only there)."""
    if not any(isinstance(h, _Printer) for h in log.handlers):
        log.addHandler(_Printer())
    log.setLevel(logging.INFO)
    log.propagate = False


def parse(line: str) -> dict[str, Any] | None:
    """The milestone a line of a launched process's output carries, or None."""
    if not line.startswith(MARK):
        return None
    try:
        event = json.loads(line[len(MARK) :])
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None
