"""Ray at the edge: connecting, sizing the fleet, and an elastic pull-based pool of actors wrapping
`workers.Worker`."""

from cluster.connect import ClusterShape, connect, disconnect
from cluster.fleet import Fleet, size_fleet
from cluster.pool import (
                          PoolEvent,
                          ShardFailed,
                          ShardSpeculated,
                          Tick,
                          Waiting,
                          WorkerFailed,
                          WorkerLost,
                          WorkerPlaced,
                          WorkerPool,
                          WorkerReady,
                          WorkerReleased,
    WorkerUnreachable,
)

__all__ = ["ClusterShape", "Fleet", "PoolEvent", "ShardFailed", "ShardSpeculated", "Tick", "Waiting", "WorkerFailed",
           "WorkerLost", "WorkerPlaced", "WorkerPool", "WorkerReady", "WorkerReleased", "WorkerUnreachable", "connect", "disconnect",
           "size_fleet"]
