"""The store a run's torch.distributed groups meet at, when the launcher names one.

Under torchrun (or a Slurm job script) ``MASTER_ADDR:MASTER_PORT`` is where a run's processes
meet. torchrun's agent hosts a TCP store there (``TORCHELASTIC_USE_AGENT_STORE=True``);
otherwise the head's process hosts it, once: the launcher (publishing the head's address to
the nodes) and the trainer (its group) share that one store, each under its own key prefix.

    store = master_store(timeout_s=60)      # None when MASTER_ADDR/MASTER_PORT are not set
"""

from __future__ import annotations

import datetime
import os
from typing import Any

_hosted: dict[int, Any] = {}  # the stores this process hosts, by port, kept for its whole life


def master_address() -> tuple[str, int] | None:
    """``(MASTER_ADDR, MASTER_PORT)`` when both are set."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return addr.strip("[]"), int(port)


def master_store(timeout_s: float, *, host: bool | None = None) -> Any:
    """A client of the store at ``MASTER_ADDR:MASTER_PORT``; this process hosts it when ``host``
    (default: when no torchrun agent does and this is the head, ``RANK`` 0 or unset). None when
    the variables are not set. The hosted store lives as long as this process."""
    import torch.distributed as dist

    where = master_address()
    if where is None:
        return None
    addr, port = where
    timeout = datetime.timedelta(seconds=timeout_s)
    if host is None:
        host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ.get("RANK", "0") == "0"
    if host and port not in _hosted:
        try:
            _hosted[port] = dist.TCPStore(
                "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout
            )
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(
                f"cannot host the rendezvous store on MASTER_PORT={port}: {exc} (another process holds the port?)"
            ) from None
    if port in _hosted:
        return _hosted[port]
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)
