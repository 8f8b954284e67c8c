"""Ray at the edge: connecting, sizing the fleet, and an elastic pull-based pool of actors wrapping
`workers.Worker`; what the pool reports is in `cluster.events` (no Ray there)."""

from fleetgen.cluster.connect import ClusterShape, connect, disconnect
from fleetgen.cluster.events import (
    PoolEvent,
    ShardFailed,
    ShardSpeculated,
    Tick,
    Waiting,
    WorkerFailed,
    WorkerLost,
    WorkerPlaced,
    WorkerReady,
    WorkerReleased,
    WorkerUnreachable,
)
from fleetgen.cluster.pool import WorkerPool
from fleetgen.cluster.reclaim import reclaim_at_exit, reclaim_nodes
from fleetgen.cluster.sizing import Sizing, size_fleet

__all__ = [
    "ClusterShape",
    "PoolEvent",
    "ShardFailed",
    "ShardSpeculated",
    "Sizing",
    "Tick",
    "Waiting",
    "WorkerFailed",
    "WorkerLost",
    "WorkerPlaced",
    "WorkerPool",
    "WorkerReady",
    "WorkerReleased",
    "WorkerUnreachable",
    "connect",
    "disconnect",
    "reclaim_at_exit",
    "reclaim_nodes",
    "size_fleet",
]
