"""Connecting to the Ray cluster a job runs under, or starting a local one."""

from __future__ import annotations

import os
from dataclasses import dataclass

# A local Ray started by fleetgen binds to loopback: nothing else needs to reach it. Ray reads this
# switch at import time; it only matters when no address is given (a laptop run or a test).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from fleetgen.errors import ClusterError  # noqa: E402


@dataclass(frozen=True)
class ClusterShape:
    cpus: int
    gpus: int
    started_here: bool  # we started a local Ray and must shut it down
    on_cluster: bool  # joined a cluster by address: its nodes may come and go (autoscaling)


_started_here = False
_holds = 0  # connect() calls not yet matched by disconnect() (a warm-workers block holds one over its runs)
inits = 0  # Ray connections this process made (a test that makes one must say so: tests/conftest.py)


def connect(address: str | None = None, num_cpus: int | None = None) -> ClusterShape:
    """Join `address`, else `RAY_ADDRESS` (set by `ray job submit`), else start a local Ray.

    A run with no address always starts its own Ray (`address="local"`): a bare `ray.init()`
    would join whatever cluster a stale `ray_current_cluster` file in Ray's temp directory names,
    and hang there if it is gone. Reuses an existing connection (a test session's, or an
    embedding application's).
    """
    global _started_here, _holds, inits
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        inits += 1
        try:
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
                _started_here = True
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = f"the Ray cluster at `{address}`" if address else "a local Ray"
            raise ClusterError(f"Could not start or join {where}: {err}") from err
    _holds += 1
    res = ray.cluster_resources()
    return ClusterShape(
        cpus=int(res.get("CPU", 0)), gpus=int(res.get("GPU", 0)), started_here=_started_here, on_cluster=bool(address)
    )


def disconnect() -> None:
    """Shut Ray down only if `connect` started it and no other `connect` still holds it (a run inside
    `fleetgen.warm_workers()` leaves the block's Ray up)."""
    global _started_here, _holds
    _holds = max(0, _holds - 1)
    if _started_here and not _holds and ray.is_initialized():
        ray.shutdown()
        _started_here = False
