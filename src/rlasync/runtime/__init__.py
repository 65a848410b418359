"""The actor runtime: actors with typed async endpoints, nodes, membership, local clusters."""

from .actor import Actor, BoundEndpoint, BoundStream, Endpoint, StreamEndpoint, endpoint
from .cluster import ExternalCluster, LocalCluster
from .errors import (
    ActorError,
    ActorNotFound,
    CallRefused,
    CallTimeout,
    ClusterStartError,
    Forbidden,
    JoinError,
    NodeLostError,
    NotAnEndpoint,
    RuntimeErrorBase,
)
from .node import Node
from .ref import ActorRef
from .types import ActorInfo, NodeInfo, NodeStats

__all__ = [
    "Actor",
    "ActorError",
    "ActorInfo",
    "ActorNotFound",
    "ActorRef",
    "BoundEndpoint",
    "BoundStream",
    "CallRefused",
    "CallTimeout",
    "ClusterStartError",
    "Endpoint",
    "ExternalCluster",
    "Forbidden",
    "JoinError",
    "LocalCluster",
    "Node",
    "NodeInfo",
    "NodeLostError",
    "NodeStats",
    "NotAnEndpoint",
    "RuntimeErrorBase",
    "StreamEndpoint",
    "endpoint",
]
