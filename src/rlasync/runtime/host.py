"""``Host``: what an actor may ask of the node that hosts it (``Actor.node``).

An actor sees its node through this protocol rather than as the whole ``Node``: which node it
is and where, its settings and its ``/metrics``, and what any caller may ask of the cluster
(spawn an actor, look one up, start a supervised process, read counters). The runtime's own
actors need the node's hooks for the membership besides (``membership.ServiceHost``). Actor
classes are typed ``Any`` here: this module sits under ``actor``, which names it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..config import RuntimeConfig
from .types import NodeInfo, NodeStats

if TYPE_CHECKING:  # prometheus-client is imported only where metrics are on
    from ..metrics.exporter import Exporter


class Host(Protocol):
    """A started node, as the actors it hosts see it (``Node`` is one)."""

    node_id: str  # node-<rank>, or a supervised child's node-<rank>.<index>
    address: str  # where other nodes reach it
    config: RuntimeConfig
    metrics: Exporter | None  # its /metrics (runtime.metrics_port); None: off

    @property
    def info(self) -> NodeInfo: ...

    @property
    def is_head(self) -> bool: ...

    async def spawn(
        self,
        cls: type[Any],
        *args: Any,
        node: int | str | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> Any: ...

    async def lookup(self, name: str, cls: type[Any] | None = None, *, timeout: float = 0.0) -> Any: ...

    async def members(self) -> list[NodeInfo]: ...

    async def start_child(
        self, *, preload: tuple[str, ...] = (), on: int | str | None = None
    ) -> NodeInfo: ...

    async def stop_nodes(self, node_ids: list[str]) -> None: ...

    async def node_stats(self, node: int | str | None = None) -> NodeStats: ...

    def live_member(self, node_id: str) -> NodeInfo | None: ...

    def local_actor(self, name: str) -> Any: ...

    def stats(self) -> NodeStats: ...

    def request_stop(self) -> None: ...
