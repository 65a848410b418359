"""A torch.distributed group for weights alone: the trainer's rank 0 (rank 0 here) and the engines.

Made without ``init_process_group``, so a process can be in its trainer's data-parallel group
and in this one, and so a group whose peer died can be dropped and made again (a new
*generation*, with fresh keys in the same store) while the process lives on. Every collective
has the group's deadline: a dead peer fails it at once (the connection closes), a stalled
one when the deadline passes. Either way the error is ``SyncError`` and the group is unusable.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.errors import first_line
from .errors import SyncError
from .protocol import GroupAddress


class WeightGroup:
    """``local_host``: this process's address as the other members reach it (gloo listens there;
    default ``127.0.0.1``, every member on this machine)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        generation: int = 0,
        store: Any = None,
        local_host: str = "",
        peer: str = "",
    ) -> None:
        self.rank, self.size, self.backend, self.timeout_s, self.generation = (
            rank,
            size,
            backend,
            timeout_s,
            generation,
        )
        self.address = (host, port)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0 hosts the rendezvous store; it outlives groups, so a new generation reuses it.
        self.store = store or dist.TCPStore(
            host, port, size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        # A pair group's keys are its peer's own: pairs of one generation form independently.
        prefixed = dist.PrefixStore(
            f"rlasync/weights/{generation}" + (f"/{peer}" if peer else ""), self.store
        )
        try:
            if backend == "gloo":
                options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in the stubs
                options._timeout = timeout
                # Gloo listens where the machine's hostname resolves unless told: a node in another
                # network namespace (or behind another interface) could not reach that address.
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host or "127.0.0.1")]
                self._pg: Any = dist.ProcessGroupGloo(prefixed, rank, size, options)
            elif backend == "nccl":  # GPU path: one communicator spanning trainer rank 0 and the engines
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
            else:
                raise ValueError(f"weights backend must be gloo or nccl, got {backend!r}")
        except RuntimeError as exc:
            raise SyncError(
                f"weight group (generation {generation}): peers did not all join within {timeout_s} s: {exc}"
            ) from exc
        self._closed = False

    @classmethod
    def at(cls, address: GroupAddress, rank: int, *, store: Any = None, local_host: str = "") -> WeightGroup:
        """Become ``rank`` of the group ``address`` describes (``store``: the store already held,
        reused across generations)."""
        return cls(
            address.host,
            address.port,
            rank,
            address.size,
            backend=address.backend,
            timeout_s=address.timeout_s,
            generation=address.generation,
            store=store,
            local_host=local_host,
            peer=address.peer,
        )

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 into every rank's ``tensor``; ``wait`` on the result."""
        if self._closed:
            raise SyncError("the weight group is closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._pg.broadcast([tensor], options)

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            self.close()
            raise SyncError(
                f"weight sync failed during {what} (a peer died, or stalled past {self.timeout_s:g} s: raise the "
                f"deadline if it is only slow): {first_line(exc)}"
            ) from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.wait(self.broadcast_async(tensor), what)

    def barrier(self, what: str = "a barrier") -> None:
        """Every rank reaches this point (a one-element all-reduce), under the deadline."""
        self.wait(self._pg.allreduce([torch.zeros(1)]), what)

    def close(self) -> None:
        """Drop the communicator (idempotent). For NCCL, abort it so no kernel waits forever."""
        if self._closed:
            return
        self._closed = True
        abort = getattr(self._pg, "abort", None)
        if self.backend == "nccl" and abort is not None:
            abort()
        self._pg = None
