"""What the pool tells its caller as it runs (`WorkerPool.run` yields them): workers placed, ready,
failed, lost and released; shards failed or speculated; the worker's own `BatchDone`, `PartCommitted`
and `ShardResult`; images an attempt made that are made again (`ImagesRedone`); a `Tick` while nothing happens. Plain data: no Ray here, so `jobs/` can follow a
fleet without importing it."""

from __future__ import annotations

from dataclasses import dataclass

from fleetgen.workers.spec import BatchDone, PartCommitted, ShardResult

__all__ = [
    "BatchDone",
    "ImagesRedone",
    "PartCommitted",
    "PoolEvent",
    "ShardFailed",
    "ShardResult",
    "ShardSpeculated",
    "Tick",
    "Waiting",
    "WorkerFailed",
    "WorkerLost",
    "WorkerPlaced",
    "WorkerReady",
    "WorkerReleased",
    "WorkerUnreachable",
]


@dataclass(frozen=True)
class ShardFailed:
    """A shard that failed `attempts` times; it is not committed."""

    shard_id: str
    error: str
    attempts: int


@dataclass(frozen=True)
class ShardSpeculated:
    """A straggling shard was also given to an idle worker; the first commit wins."""

    shard_id: str
    worker: str
    running_seconds: float  # how long the first attempt had been running


@dataclass(frozen=True)
class WorkerPlaced:
    """Ray placed an actor on a node; it is loading the model now. `placement` is its `where()`."""

    worker: str
    placement: dict


@dataclass(frozen=True)
class WorkerReady:
    """An actor finished loading; `info` is its `Worker.describe()`."""

    worker: str
    info: dict


@dataclass(frozen=True)
class WorkerFailed:
    """An actor that cannot run (e.g. the model fits nothing in its budget); the job goes on without it."""

    worker: str
    error: str
    placement: dict | None


@dataclass(frozen=True)
class WorkerLost:
    """An actor's process or node died; `restarting`: Ray will start it again when capacity allows."""

    worker: str
    error: str
    restarting: bool


@dataclass(frozen=True)
class WorkerUnreachable:
    """Ray lost contact with an actor mid-shard; its shard waits until it answers or is known dead."""

    worker: str
    shard_id: str
    error: str


@dataclass(frozen=True)
class WorkerReleased:
    """An actor with nothing left to do was shut down, freeing its node for the autoscaler."""

    worker: str
    reason: str


@dataclass(frozen=True)
class Waiting:
    """No worker is placed yet; `pending` actors are waiting for capacity."""

    pending: int
    seconds: float
    asks: str  # what each asks Ray for
    hint: str = ""  # e.g. GPUs asked on a cluster whose nodes have none


@dataclass(frozen=True)
class ImagesRedone:
    """An attempt ended (lost, killed, beaten to a commit) with `images` it made that no commit of its
    holds: made again by another attempt, or already made by the one that won."""

    worker: str
    shard_id: str
    images: int


@dataclass(frozen=True)
class Tick:
    """Nothing happened for a while (a first batch at a large size can take minutes on a CPU): the
    driver redraws its progress line so that a long wait still shows the job alive."""


PoolEvent = (
    WorkerPlaced
    | WorkerReady
    | WorkerFailed
    | WorkerLost
    | WorkerUnreachable
    | WorkerReleased
    | Waiting
    | BatchDone
    | PartCommitted
    | ImagesRedone
    | ShardResult
    | ShardFailed
    | ShardSpeculated
    | Tick
)
