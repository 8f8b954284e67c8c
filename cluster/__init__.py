"""Ray at the edge: connecting, and a pull-based pool of actors wrapping `workers.Worker`."""

from cluster.connect import cluster_shape, connect, disconnect
from cluster.pool import PoolEvent, ShardFailed, ShardSpeculated, WorkerPool, WorkerReady

__all__ = ["PoolEvent", "ShardFailed", "ShardSpeculated", "WorkerPool", "WorkerReady", "cluster_shape", "connect", "disconnect"]
