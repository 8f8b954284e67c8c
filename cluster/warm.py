"""Workers kept warm between runs in one process (`fleetgen.warm_workers()`).

A worker's process spends seconds importing torch, diffusers and transformers before it loads a
model (BENCHMARKS.md, "A worker's start"). A notebook or a script that runs several jobs in a row
can keep those processes: inside the block, a worker whose run is over is closed (its pipeline and
offload directories released, as always) but not killed — it is *parked*. The next run's pool takes
a parked worker that asked Ray for the same resources and environment instead of starting a new one,
and loads that run's model in it. A parked worker never carries a model, a plan or a setting from
one run to the next: `start(spec)` loads from the spec it is given, so pixels do not depend on
which process made them.

Parked workers hold what they asked Ray for (CPUs, GPUs, memory) until a run takes them or the block
ends. So a run that finds parked workers it cannot use (other resources, another environment) kills
them before it starts its own, as does `fleetgen score`; outside fleetgen, Ray work that needs those
resources waits for the block to end. Only workers that closed cleanly and never died are parked,
and a run takes one only if it still answers from the process it was parked in; the block kills them
all on leaving, and Ray kills them with the driver in any case.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

from fleetgen.cluster.connect import connect, disconnect
from fleetgen.errors import ConfigError


class WarmWorkers:
    """The parked workers of one Ray connection: `(key, handle)` pairs, a key being what a worker
    asked Ray for (its actor options, environment and restart budget)."""

    def __init__(self, job_id: str):
        self.job_id = job_id  # Ray's id for this driver's connection: handles are good only on it
        self.parked: list[tuple[tuple, ray.actor.ActorHandle]] = []
        self.reused = 0  # runs' workers that were parked ones (the tests read it)

    def current(self) -> bool:
        return ray.is_initialized() and ray.get_runtime_context().get_job_id() == self.job_id

    def park(self, key: tuple, handle) -> None:
        self.parked.append((key, handle))

    def take(self, key: tuple):
        """The parked worker with this key that ran last and is still as it was parked, else None —
        and then every parked worker is killed: they hold resources the new one may need. One whose
        process died meanwhile (its node lost, a kill) or that Ray restarted (a restart spent) is
        killed and passed over."""
        for i in reversed(range(len(self.parked))):
            parked_key, handle = self.parked[i]
            if parked_key != key:
                continue
            del self.parked[i]
            if _intact(handle):
                self.reused += 1
                return handle
            ray.kill(handle, no_restart=True)
        self.kill_all()
        return None

    def kill_all(self) -> None:
        for _, handle in self.parked:
            ray.kill(handle, no_restart=True)
        self.parked = []


def _intact(handle) -> bool:
    """The parked actor answers, from the process it was parked in."""
    try:
        return ray.get(handle.intact.remote(), timeout=PING_TIMEOUT)
    except (ray.exceptions.RayError, TimeoutError):
        return False


PING_TIMEOUT = 10.0  # seconds a parked worker has to answer before a run passes it over
_scope: WarmWorkers | None = None


def scope() -> WarmWorkers | None:
    """The warm-workers block this process is in, if it is on the Ray connection now open."""
    return _scope if _scope is not None and _scope.current() else None


def free_parked() -> None:
    """Kill every parked worker (anything else this process places on Ray calls this first)."""
    if (warm := scope()) is not None:
        warm.kill_all()


@contextmanager
def warm_workers(address: str | None = None) -> Iterator[WarmWorkers]:
    """Keep workers between the runs made inside the block (module docstring). Joins `address`
    (else `RAY_ADDRESS`, else starts a local Ray) for the whole block, as a run would for itself."""
    global _scope
    if _scope is not None:
        raise ConfigError(
            "`fleetgen.warm_workers()` blocks do not nest: one block keeps the workers of every run in it"
        )
    connect(address)
    _scope = warm = WarmWorkers(ray.get_runtime_context().get_job_id())
    try:
        yield warm
    finally:
        _scope = None
        if ray.is_initialized():
            warm.kill_all()
        disconnect()
