"""Connecting to the Ray cluster a job runs under, or starting a local one."""

from __future__ import annotations

import os
from dataclasses import dataclass

# A local Ray started by fleetgen binds to loopback: nothing else needs to reach it. Ray reads this
# switch at import time; it only matters when no address is given (a laptop run or a test).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from fleetgen.errors import ClusterError  # noqa: E402

HOST_SHARE = 0.8  # of a node's Ray-schedulable memory that its workers' offloaded copies may use


@dataclass(frozen=True)
class ClusterShape:
    cpus: int
    gpus: int
    started_here: bool  # we started a local Ray and must shut it down
    node_memory: tuple[tuple[int, int, int], ...] = ()  # per alive node: (memory bytes, GPUs, CPUs)

    def host_share(self, workers: int) -> int | None:
        """Host RAM per worker: on GPU nodes a node's memory split between its GPUs (one worker
        each); on CPU-only clusters the smallest node's memory split between the workers it could
        hold. The smallest share over nodes, so that every node fits its workers."""
        shares = [int(mem * HOST_SHARE / (gpus if self.gpus else max(1, min(cpus, workers))))
                  for mem, gpus, cpus in self.node_memory if mem and (gpus or not self.gpus)]
        return min(shares) if shares else None


_started_here = False


def connect(address: str | None = None, num_cpus: int | None = None) -> ClusterShape:
    """Join `address`, else `RAY_ADDRESS` (set by `ray job submit`), else start a local Ray.

    Reuses an existing connection (a test session's, or an embedding application's).
    """
    global _started_here
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
                _started_here = True
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = f"the Ray cluster at `{address}`" if address else "a local Ray"
            raise ClusterError(f"Could not start or join {where}: {err}") from err
    return cluster_shape()


def cluster_shape() -> ClusterShape:
    res = ray.cluster_resources()
    nodes = tuple((int(n["Resources"].get("memory", 0)), int(n["Resources"].get("GPU", 0)),
                   int(n["Resources"].get("CPU", 0))) for n in ray.nodes() if n.get("Alive"))
    return ClusterShape(cpus=int(res.get("CPU", 0)), gpus=int(res.get("GPU", 0)), started_here=_started_here,
                        node_memory=nodes)


def disconnect() -> None:
    """Shut Ray down only if `connect` started it."""
    global _started_here
    if _started_here and ray.is_initialized():
        ray.shutdown()
        _started_here = False
