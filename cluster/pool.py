"""A pull-based pool of Ray actors, one `workers.Worker` each.

An idle actor takes the next shard, so a faster device takes more. A shard whose attempt fails
(the worker raised, or its process died) goes back on the queue until `max_attempts`; an actor
that died is restarted by Ray up to `max_restarts` times, then dropped from the pool.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from cluster.metrics import MeteredWorker, failed_counter
from fleetgen.errors import ClusterError
from workers.shard import Shard
from workers.worker import BatchDone, ShardResult, WorkerSpec

RemoteWorker = ray.remote(MeteredWorker)
RETRY_READY = 0.5  # seconds between asking a restarting actor whether it is back


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
class WorkerReady:
    """An actor finished loading; `info` is its `Worker.describe()`."""

    worker: str
    info: dict


PoolEvent = WorkerReady | BatchDone | ShardResult | ShardFailed | ShardSpeculated


def _message(err: Exception) -> str:
    if isinstance(err, RayTaskError) and err.cause is not None:
        return f"{type(err.cause).__name__}: {err.cause}"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


class WorkerPool:
    def __init__(self, specs: list[WorkerSpec], actor_options: dict, max_attempts: int = 3, max_restarts: int = 2):
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.actors = {
            spec.name: RemoteWorker.options(**actor_options, max_restarts=max_restarts, max_task_retries=0).remote(spec)
            for spec in specs
        }

    def run(self, shards: list[Shard], stop: threading.Event | None = None, grace: float = 0.0) -> Iterator[PoolEvent]:
        """Generate every shard; yields progress as it happens. Returns when each shard has
        committed or failed, or raises `ClusterError` when no worker can start. Once `stop` is
        set nothing new is dispatched, and running shards get `grace` seconds to commit; the rest
        are abandoned uncommitted (a rerun redoes them)."""
        queue = deque(shards)
        stopping_since = None
        attempts: dict[str, int] = {}
        deaths: dict[str, int] = {}
        pending = {self.actors[name].describe.remote(): name for name in self.actors}
        running: dict[ray.ObjectRefGenerator, tuple[str, Shard]] = {}
        began: dict[ray.ObjectRefGenerator, float] = {}
        live: dict[str, int] = {}  # shard -> attempts running now
        done: set[str] = set()  # shards committed (by whichever attempt)
        speculated: set[str] = set()
        idle: list[str] = []
        restarting: dict[str, float] = {}  # actor -> when to ask again whether it is back
        start_errors: list[str] = []
        while queue or running:
            if stop is not None and stop.is_set():
                if stopping_since is None:
                    stopping_since = time.monotonic()
                    queue.clear()
                if time.monotonic() - stopping_since >= grace:
                    return
            now = time.monotonic()
            for name in [n for n, at in restarting.items() if at <= now]:
                del restarting[name]
                pending[self.actors[name].describe.remote()] = name
            while idle and queue:
                name, shard = idle.pop(0), queue.popleft()
                attempts[shard.id] = attempts.get(shard.id, 0) + 1
                ref = self.actors[name].iter_shard.remote(shard)
                running[ref], began[ref], live[shard.id] = (name, shard), time.monotonic(), live.get(shard.id, 0) + 1
            # Nothing queued and a worker idle: give it the longest-running shard too (once per shard).
            while idle and not queue and stopping_since is None and (stragglers := [r for r, (_, sh) in running.items()
                                                         if sh.id not in speculated and sh.id not in done]):
                first = min(stragglers, key=began.__getitem__)
                name, shard = idle.pop(0), running[first][1]
                speculated.add(shard.id)
                ref = self.actors[name].iter_shard.remote(shard, True)
                running[ref], began[ref], live[shard.id] = (name, shard), time.monotonic(), live[shard.id] + 1
                yield ShardSpeculated(shard.id, name, time.monotonic() - began[first])
            if not running and not pending and not restarting:
                if queue:
                    raise ClusterError(f"No worker left to run {len(queue)} shard(s): {'; '.join(start_errors)}.")
                break
            if not pending and not running:
                time.sleep(RETRY_READY)
                continue
            ready, _ = ray.wait([*pending, *running], num_returns=1, timeout=RETRY_READY)
            for ref in ready:
                if ref in pending:
                    name = pending.pop(ref)
                    try:
                        info = ray.get(ref)
                    except ActorUnavailableError:  # still restarting: ask again shortly
                        restarting[name] = time.monotonic() + RETRY_READY
                        continue
                    except (RayActorError, RayTaskError) as err:  # could not (re)start: dropped
                        start_errors.append(f"{name}: {_message(err)}")
                        continue
                    idle.append(name)
                    yield WorkerReady(name, info)
                    continue
                name, shard = running[ref]
                try:
                    event = ray.get(next(ref))
                except StopIteration:
                    del running[ref]
                    live[shard.id] -= 1
                    idle.append(name)
                    continue
                except (RayActorError, RayTaskError) as err:
                    del running[ref]
                    live[shard.id] -= 1
                    if isinstance(err, RayActorError):  # the process died: wait for Ray to restart it
                        deaths[name] = deaths.get(name, 0) + 1
                        if deaths[name] <= self.max_restarts:
                            restarting[name] = time.monotonic()
                        else:
                            start_errors.append(f"{name}: died {deaths[name]} times")
                    else:
                        idle.append(name)
                    if shard.id in done or live[shard.id] > 0:
                        continue  # committed, or another attempt is still at it
                    if attempts[shard.id] < self.max_attempts:
                        queue.append(shard)
                    else:
                        failed_counter().inc(1)
                        yield ShardFailed(shard.id, _message(err), attempts[shard.id])
                    continue
                if isinstance(event, ShardResult):
                    if shard.id in done:
                        continue  # the other attempt's result came first
                    done.add(shard.id)
                elif shard.id in done:
                    continue  # progress of an attempt that has lost
                yield event

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors = {}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


