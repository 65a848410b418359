"""rlasync: an asyncio-first runtime for asynchronous RL post-training of language models.

import rlasync

class Echo(rlasync.Actor):
    @rlasync.endpoint
    async def echo(self, x: str) -> str:
        return x

async def main() -> None:
    async with rlasync.LocalCluster(nodes=2) as cluster:
        echo = await cluster.spawn(Echo, node=1)
        print(await echo.echo("hi"))

rlasync.run(main())
"""

from __future__ import annotations

import importlib
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .config import RuntimeConfig
    from .runtime import (
        Actor,
        ActorError,
        ActorNotFound,
        ActorRef,
        CallRefused,
        CallTimeout,
        ClusterStartError,
        Forbidden,
        JoinError,
        LocalCluster,
        Node,
        NodeLostError,
        NotAnEndpoint,
        endpoint,
    )
    from .transport.auth import new_secret

# Loaded when first named (PEP 562): `rlasync` itself imports nothing heavy, so the command
# line starts (and takes over Ctrl-C, rlasync.interrupts) before the runtime has loaded.
_ELSEWHERE = {"RuntimeConfig": ".config", "new_secret": ".transport.auth", "run": ""}
"""Where the lazily loaded names live, if not in ``rlasync.runtime`` (``run`` is defined here)."""


def __getattr__(name: str) -> Any:
    where = _ELSEWHERE.get(name, ".runtime")
    if name in __all__ and where:
        return getattr(importlib.import_module(where, __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop, the event loop every rlasync process uses."""
    import uvloop

    return uvloop.run(main)


__all__ = [
    "Actor",
    "ActorError",
    "ActorNotFound",
    "ActorRef",
    "CallRefused",
    "CallTimeout",
    "ClusterStartError",
    "Forbidden",
    "JoinError",
    "LocalCluster",
    "Node",
    "NodeLostError",
    "NotAnEndpoint",
    "RuntimeConfig",
    "endpoint",
    "new_secret",
    "run",
]
