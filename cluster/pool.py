"""An elastic, pull-based pool of Ray actors, one `workers.Worker` each, that follows the cluster.

The pool keeps as many actors as there is work for, up to `max_workers`. An actor that Ray cannot
place yet is pending demand, which is what makes an autoscaler start a node for it; nodes that
join later are filled that way, of any GPU type. Each actor is placed first (`where`), then loads
(`start`), then takes shards: an idle actor takes the next one, so a faster device takes more.

- A shard whose attempt fails goes back on the queue until `max_attempts`.
- An actor whose process died (a kill, its node lost) is restarted by Ray up to `max_restarts`
  times, wherever capacity returns; its shard goes back on the queue meanwhile.
- `ActorUnavailableError` is not a death: the attempt may still be running, so the shard stays
  with that actor until the actor answers again (its attempt is then over) or is known dead.
- An actor that cannot run (fits nothing, a GPU without CUDA) is reported once and kept idle to
  the end, holding its slot, so no other worker is started on the same unusable device.
- At the tail, actors with nothing left to do are released (closed, then killed) so that an
  autoscaler can remove their nodes.
- When no actor could be placed for `placement_timeout` seconds, the pool raises `ClusterError`
  naming what each actor asks for and what the nodes have.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import ray

from fleetgen.cluster.actor import RayActors
from fleetgen.cluster.events import PoolEvent, WorkerReleased
from fleetgen.cluster.run import ActorState, PoolActor, PoolRun
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import WorkerSpec

CLOSE_TIMEOUT = 10.0  # seconds a released worker gets to close before it is killed


class WorkerPool:
    """The actors: created as work asks (`create`), moved on while placing or loading (`ask`),
    released at the tail (`release`, `reap_closing`), all closed at the end (`close`). `run` is one run
    of shards over them (cluster/run.py: the queue, the attempts, the loop)."""

    def __init__(
        self,
        spec_for: Callable[[int], WorkerSpec],
        actor_options: dict,
        max_workers: int,
        max_attempts: int = 3,
        max_restarts: int = 2,
        placement_timeout: float = 300.0,
        env_vars: dict[str, str] | None = None,
        actors: RayActors | None = None,
    ):
        self.spec_for = spec_for  # the spec of the i-th actor created
        self.factory = actors or RayActors()
        self.options = actor_options
        self.env_vars = env_vars or {}  # set in every worker's process (its runtime env), e.g. the hub token
        self.max_workers = max_workers
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.placement_timeout = placement_timeout
        self.actors: dict[str, PoolActor] = {}
        self.created = 0
        self.spent = 0  # slots used for good: actors that failed to start or died too often
        self.closing: dict[ray.ObjectRef, PoolActor] = {}  # close() calls of released actors
        self.close_deadline: dict[ray.ObjectRef, float] = {}

    # -- actors ---------------------------------------------------------------------------------

    def create(self) -> None:
        name = f"w{self.created}"
        spec = self.spec_for(self.created)
        self.created += 1
        handle = self.factory.create(spec, self.options, self.env_vars, self.max_restarts)
        actor = PoolActor(name, handle, spec=spec)
        actor.call = handle.where.remote()
        self.actors[name] = actor

    def release(self, actor: PoolActor, reason: str) -> WorkerReleased:
        """Close an actor (its offload directories go with it), then kill it; never wait here."""
        del self.actors[actor.name]
        if actor.state in (ActorState.IDLE, ActorState.FAILED):
            ref = actor.handle.close.remote()
            self.closing[ref], self.close_deadline[ref] = actor, time.monotonic() + CLOSE_TIMEOUT
        else:  # placing or loading: nothing to close, or busy loading
            self.factory.kill(actor.handle)
        return WorkerReleased(actor.name, reason)

    def reap_closing(self, now: float) -> None:
        if not self.closing:
            return
        done, _ = ray.wait(list(self.closing), num_returns=len(self.closing), timeout=0)
        for ref in [*done, *[r for r, t in self.close_deadline.items() if t <= now]]:
            if ref in self.closing:
                self._retire(self.closing.pop(ref), ref if ref in done else None)
                del self.close_deadline[ref]

    def _retire(self, actor: PoolActor, closed: ray.ObjectRef | None) -> None:
        """Kill a released actor, or park it for a later run (cluster/warm.py) if its `closed` call
        answered without error and it is one that never died or failed to start."""
        clean = closed is not None and actor.deaths == 0 and actor.state == ActorState.IDLE
        if clean:
            try:
                ray.get(closed, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                clean = False
        self.factory.retire(actor.handle, clean)

    def ask(self, actor: PoolActor, now: float) -> None:
        """(Re)issue the call that moves a placing/loading/unavailable actor on."""
        if actor.call is None and actor.retry_at <= now:
            actor.call = (
                actor.handle.where.remote()
                if actor.state == ActorState.PLACING
                else actor.handle.start.remote(actor.spec)
            )

    # -- the loop -------------------------------------------------------------------------------

    def run(self, shards: list[Shard], stop: threading.Event | None = None, grace: float = 0.0) -> Iterator[PoolEvent]:
        """Generate every shard; yields progress as it happens. Returns when each shard has
        committed or failed, or raises `ClusterError` when no worker can run. Once `stop` is set
        nothing new is dispatched, and running shards get `grace` seconds to commit; the rest are
        abandoned uncommitted (a rerun redoes them)."""
        return PoolRun(self, shards, stop or threading.Event(), grace).events()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close every worker (offload directories removed), waiting at most `timeout` seconds for
        those still busy, then kill them all. Attempts abandoned here (a stop, a lost store) may end
        in errors no one reads: Ray would print each worker's traceback as an "unhandled error" when
        their refs are collected, burying the job's one-line reason; the pool has said what failed."""
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        refs = dict(self.closing)
        for actor in self.actors.values():
            if actor.state in (ActorState.IDLE, ActorState.FAILED, ActorState.BUSY, ActorState.UNAVAILABLE):
                refs[actor.handle.close.remote()] = actor
            else:
                self.factory.kill(actor.handle)
        done = []
        if refs and timeout > 0:
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref, actor in refs.items():
            self._retire(actor, ref if ref in done else None)
        self.actors, self.closing, self.close_deadline = {}, {}, {}
