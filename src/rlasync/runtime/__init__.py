"""The actor runtime: actors with typed async endpoints, nodes, membership, local clusters."""

from .actor import Actor, BoundEndpoint, BoundStream, Endpoint, StreamEndpoint, endpoint
from .cluster import ExternalCluster, LocalCluster
from .errors import (
    ActorError,
    ActorNotFound,
    CallTimeout,
    ClusterStartError,
    JoinError,
    NodeLostError,
    NotAnEndpoint,
    RuntimeErrorBase,
)
from .node import Node
from .ref import ActorRef, as_task
from .types import ActorInfo, NodeInfo, NodeStats

__all__ = [
    "Actor", "ActorError", "ActorInfo", "ActorNotFound", "ActorRef", "BoundEndpoint", "BoundStream",
    "CallTimeout", "ClusterStartError", "Endpoint", "ExternalCluster", "JoinError", "LocalCluster", "Node", "NodeInfo",
    "NodeLostError", "NodeStats", "NotAnEndpoint", "RuntimeErrorBase", "StreamEndpoint", "as_task", "endpoint",
]  # fmt: skip
