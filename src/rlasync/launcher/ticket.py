"""What a launched process is told on its stdin, never on its command line (``ps`` shows those).

The launcher writes one JSON line to each host's process, ``rlasync launch --from-stdin``: its
rank, the head's address, where to listen, the cluster secret, the launcher's version and the
run's whole config (overrides applied, so no host needs a copy of the file), and for the head,
whether it resumes. The stdin then stays open: when it closes (the launcher stopped, or died and
its ssh went with it) the process stops itself, so nothing is left running on any host.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, BinaryIO, Literal

import msgspec

from ..config import ConfigError


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    """The host's name in the hosts file (for messages)."""
    rank: int
    """Node rank: 0 is the head and runs the controller."""
    nodes: int
    head: str
    """The head's address, ``tcp://addr:port``."""
    listen: str
    """Where this node listens."""
    secret: str
    version: str
    """The launcher's rlasync version: a host with another one refuses to start."""
    config: dict[str, Any]
    resume: bool | Literal["auto"] = False
    """The head's ``--resume`` (``rlasync launch --nodes ... --resume[=auto]``)."""


class TicketError(ConfigError):
    """The launcher's line on stdin is missing or wrong, or this host runs another version."""


TICKET_ENV = "RLASYNC_LAUNCH_TICKET"
"""The ticket, for a host's process started again under its allocator (stdin gave it once)."""


def read_ticket(stream: BinaryIO | None = None, *, version: str) -> Ticket:
    """Read the ticket (the first line of stdin, or ``TICKET_ENV`` where this process was started
    again) and check the versions match."""
    given = os.environ.pop(TICKET_ENV, "")
    line = given.encode() if given else (stream or sys.stdin.buffer).readline()
    if not line.strip():
        raise TicketError(
            "--from-stdin: stdin closed before the launcher's ticket came (run this through `rlasync launch --nodes`)"
        )
    try:
        ticket = msgspec.json.decode(line, type=Ticket)
    except msgspec.DecodeError as exc:
        raise TicketError(f"--from-stdin: the first line of stdin is not a launch ticket: {exc}") from None
    if ticket.version != version:
        raise TicketError(
            f"{ticket.host} runs rlasync {version} and the launcher (with it the head) runs {ticket.version}: "
            "install the same version on every host (or point the host's python= at the right environment)"
        )
    return ticket


def stop_when_stdin_closes(fd: int = 0) -> threading.Thread:
    """SIGTERM this process once its stdin closes: the launcher is gone, or stops the run."""

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader's lock
        # aborts the interpreter at exit.
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="rlasync-stdin-watch", daemon=True)
    thread.start()
    return thread
