"""One run over the pool (`WorkerPool.run`): the queue of shards, the attempts in flight, the actors'
states as their answers move them on, and the loop that yields what happens as `PoolEvent`s.

The rules are the pool's (cluster/pool.py says them): a failed attempt is queued again up to
`max_attempts`; a dead actor is restarted by Ray up to `max_restarts` while its shard goes back on
the queue; an unavailable one keeps its shard until it answers or is known dead; an idle actor takes
the next queued shard, else the longest-running straggler once; actors with nothing left to do are
released; no actor placed for `placement_timeout` seconds is a `ClusterError`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

from fleetgen.cluster.events import (
    ImagesRedone,
    PoolEvent,
    ShardFailed,
    ShardSpeculated,
    Tick,
    Waiting,
    WorkerFailed,
    WorkerLost,
    WorkerPlaced,
    WorkerReady,
    WorkerUnreachable,
)
from fleetgen.cluster.sizing import format_asks, gpu_hint, unplaceable
from fleetgen.errors import ClusterError, one_line
from fleetgen.workers.rows.shard import Shard
from fleetgen.workers.spec import BatchDone, PartCommitted, ShardResult, WorkerSpec

if TYPE_CHECKING:
    from fleetgen.cluster.pool import WorkerPool

POLL = 0.5  # seconds between looks at actors that are restarting or unavailable
GATHER_ABOVE, GATHER = 64, 0.02  # above this many calls in flight, the loop lets 20 ms of events gather per pass
WAITING_NOTE = 15.0  # seconds between progress notes while no worker is placed
# What Ray 2.60 says in an ActorUnavailableError when the actor's process is gone and being restarted
# (core_worker: "The actor is temporarily unavailable: IOError: The actor was restarted").
RESTARTED = "The actor was restarted"
TICK = 1.0  # seconds without an event after which the loop yields a Tick

_failed = None


def failed_counter():
    """Shards that failed for good, as a Ray metric (counted by the driver, which decides that)."""
    global _failed
    if _failed is None:
        from ray.util.metrics import Counter

        _failed = Counter("fleetgen_shard_failures", "Shards that failed after every attempt")
    return _failed


def _message(err: Exception) -> str:
    """The error a worker raised (not Ray's wrapper around it), on one line."""
    return one_line(err.cause if isinstance(err, RayTaskError) and err.cause is not None else err)


class ActorState(Enum):
    PLACING = "placing"  # created; Ray has not placed it yet (pending demand for an autoscaler)
    LOADING = "loading"  # placed; loading the model and fitting it to its device
    IDLE = "idle"  # ready for a shard
    BUSY = "busy"  # running a shard
    UNAVAILABLE = "unavailable"  # Ray lost contact mid-call; its shard waits for it
    FAILED = "failed"  # cannot run; kept idle to the end, holding its slot


@dataclass
class PoolActor:
    name: str
    handle: ray.actor.ActorHandle
    state: ActorState = ActorState.PLACING
    call: ray.ObjectRef | None = None  # the where()/start() in flight
    retry_at: float = 0.0  # placing/loading/unavailable: when to ask again after an unavailable answer
    deaths: int = 0
    placement: dict | None = None
    shard: Shard | None = None  # the shard an unavailable actor may still be running
    created: float = field(default_factory=time.monotonic)
    spec: WorkerSpec | None = None  # what its `start` loads (a parked or restarted actor's included)


class PoolRun:
    """One `WorkerPool.run`: the queue, the attempts in flight, and the loop that moves them."""

    def __init__(self, pool: WorkerPool, shards: list[Shard], stop: threading.Event, grace: float):
        self.pool, self.stop, self.grace = pool, stop, grace
        self.queue = deque(shards)
        self.attempts: dict[str, int] = {}
        self.running: dict[ray.ObjectRefGenerator, tuple[str, Shard]] = {}
        self.began: dict[ray.ObjectRefGenerator, float] = {}
        self.tally: dict[ray.ObjectRefGenerator, list[int]] = {}  # per attempt: images made, images committed
        self.live: dict[str, int] = {}  # shard -> attempts running now (an unavailable actor's included)
        self.done: set[str] = set()  # shards committed (by whichever attempt)
        self.reported: set[str] = set()  # shards whose winning attempt's result was passed on
        self.speculated: set[str] = set()
        self.errors: list[str] = []  # why actors could not run, for the error when none is left
        self.stopping_since: float | None = None
        self.unplaced_since = self.noted = time.monotonic()

    def _in(self, *states: ActorState) -> list[PoolActor]:
        return [a for a in self.pool.actors.values() if a.state in states]

    def events(self) -> Iterator[PoolEvent]:
        ticked = time.monotonic()
        while self.queue or self.running or self._in(ActorState.UNAVAILABLE):
            now = time.monotonic()
            if now - ticked >= TICK:
                ticked = now
                yield Tick()
            if self.stop.is_set():
                if self.stopping_since is None:
                    self.stopping_since = now
                    self.queue.clear()
                if now - self.stopping_since >= self.grace:
                    return
            self.pool.reap_closing(now)
            yield from self._dispatch(now)
            yield from self._follow_work()
            yield from self._check_placement(now)
            for actor in self._in(ActorState.PLACING, ActorState.LOADING, ActorState.UNAVAILABLE):
                self.pool.ask(actor, now)
            calls = {a.call: a for a in self.pool.actors.values() if a.call is not None}
            if not calls and not self.running:
                time.sleep(POLL)
                continue
            refs = [*calls, *self.running]
            ready, _ = ray.wait(refs, num_returns=1, timeout=POLL)
            if ready and len(refs) > 1:  # then everything ready by now: one pass of the loop serves them all
                if len(refs) > GATHER_ABOVE:
                    time.sleep(GATHER)  # a wait costs ~1 µs per ref: let a big fleet's events gather first
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                yield from self._answer(calls[ref], ref) if ref in calls else self._stream(ref)

    def _start_attempt(self, actor: PoolActor, shard: Shard, now: float) -> None:
        ref = actor.handle.iter_shard.remote(shard)
        actor.state, self.running[ref], self.began[ref] = ActorState.BUSY, (actor.name, shard), now
        self.tally[ref] = [0, 0]
        self.live[shard.id] = self.live.get(shard.id, 0) + 1

    def _dispatch(self, now: float) -> Iterator[PoolEvent]:
        """Queued shards first; then an idle worker also takes the longest-running straggler (once per shard)."""
        idle = self._in(ActorState.IDLE)
        while idle and self.queue:
            shard = self.queue.popleft()
            self.attempts[shard.id] = self.attempts.get(shard.id, 0) + 1
            self._start_attempt(idle.pop(0), shard, now)
        while (
            idle
            and not self.queue
            and self.stopping_since is None
            and (
                stragglers := [
                    r for r, (_, sh) in self.running.items() if sh.id not in self.speculated and sh.id not in self.done
                ]
            )
        ):
            first = min(stragglers, key=self.began.__getitem__)
            actor, shard = idle.pop(0), self.running[first][1]
            self.speculated.add(shard.id)
            self._start_attempt(actor, shard, now)  # its own staging: the first commit wins
            yield ShardSpeculated(shard.id, actor.name, now - self.began[first])

    def _follow_work(self) -> Iterator[PoolEvent]:
        """Release workers with nothing left to do; add workers while there is work for them."""
        pool = self.pool
        if not self.queue:
            for actor in self._in(ActorState.IDLE, ActorState.PLACING, ActorState.LOADING):
                yield pool.release(actor, "nothing left to do")
        active = len(pool.actors) - len(self._in(ActorState.FAILED))
        want = min(pool.max_workers, len(self.queue) + len(self._in(ActorState.BUSY, ActorState.UNAVAILABLE)))
        while self.stopping_since is None and active < want and len(pool.actors) + pool.spent < pool.max_workers:
            pool.create()
            active += 1

    def _check_placement(self, now: float) -> Iterator[PoolEvent]:
        """Nobody can work: either nothing can be placed (a bounded wait), or no worker is left."""
        if self._in(ActorState.LOADING, ActorState.IDLE, ActorState.BUSY, ActorState.UNAVAILABLE):
            self.unplaced_since = self.noted = now
        elif self.queue and not self._in(ActorState.PLACING):
            raise ClusterError(
                f"No worker left to run {len(self.queue)} shard(s): {'; '.join(self.errors) or 'none could start'}."
            )
        elif self.queue and self.stopping_since is None:
            if now - self.unplaced_since >= self.pool.placement_timeout:
                raise ClusterError(unplaceable(self.pool.options, now - self.unplaced_since))
            if now - self.noted >= WAITING_NOTE:
                self.noted = now
                yield Waiting(
                    len(self._in(ActorState.PLACING)),
                    now - self.unplaced_since,
                    format_asks(self.pool.options),
                    gpu_hint(self.pool.options),
                )

    def _requeue_or_fail(self, shard: Shard, error: str) -> Iterator[PoolEvent]:
        self.live[shard.id] -= 1
        if shard.id in self.done or self.live[shard.id] > 0:
            return  # committed, or another attempt is still at it
        if self.attempts[shard.id] < self.pool.max_attempts:
            self.queue.append(shard)
        else:
            failed_counter().inc(1)
            yield ShardFailed(shard.id, error, self.attempts[shard.id])

    def _died(self, actor: PoolActor, err: Exception) -> Iterator[PoolEvent]:
        actor.deaths += 1
        actor.call, actor.shard = None, None
        restarting = actor.deaths <= self.pool.max_restarts
        if restarting:  # Ray starts it again where it can; ask where once it is back
            actor.state, actor.retry_at = ActorState.PLACING, time.monotonic() + POLL
        else:
            del self.pool.actors[actor.name]
            self.pool.spent += 1
            self.pool.factory.kill(actor.handle)
            self.errors.append(f"{actor.name}: died {actor.deaths} times ({_message(err)})")
        yield WorkerLost(actor.name, _message(err), restarting)

    def _ended(
        self, ref: ray.ObjectRefGenerator, name: str, shard: Shard, redone: int | None = None
    ) -> Iterator[PoolEvent]:
        """An attempt is over: the images it made that none of its commits holds (its own count where
        it says, else what its events said it made less what they said it committed)."""
        del self.running[ref]
        made, committed = self.tally.pop(ref, (0, 0))
        redone = made - committed if redone is None else redone
        if redone > 0:
            yield ImagesRedone(name, shard.id, redone)

    def _stream(self, ref: ray.ObjectRefGenerator) -> Iterator[PoolEvent]:
        """The next event of a running shard attempt."""
        name, shard = self.running[ref]
        actor = self.pool.actors[name]  # busy actors are never released
        try:
            event = ray.get(next(ref))
        except StopIteration:
            yield from self._ended(ref, name, shard)
            self.live[shard.id] -= 1
            actor.state = ActorState.IDLE
            return
        except ActorUnavailableError as err:
            yield from self._ended(ref, name, shard)
            if RESTARTED in str(err):  # its process is gone, and the attempt with it
                yield from self._died(actor, err)
                yield from self._requeue_or_fail(shard, _message(err))
                return
            # "May or may not have been executed": the attempt may still be writing. Keep the
            # shard with this actor until it answers (its tasks run in order, so an answer means
            # the attempt is over) or is known dead.
            actor.state, actor.shard, actor.call, actor.retry_at = (
                ActorState.UNAVAILABLE,
                shard,
                None,
                time.monotonic() + POLL,
            )
            yield WorkerUnreachable(name, shard.id, _message(err))
            return
        except (RayActorError, RayTaskError) as err:
            yield from self._ended(ref, name, shard)
            if isinstance(err, RayActorError):  # the process or its node died
                yield from self._died(actor, err)
            else:
                actor.state = ActorState.IDLE
            yield from self._requeue_or_fail(shard, _message(err))
            return
        if isinstance(event, BatchDone):
            self.tally[ref][0] += event.made
        elif isinstance(event, PartCommitted):
            self.tally[ref][1] += event.made
        if isinstance(event, ShardResult) and event.stopped:
            yield from self._stopped(ref, actor, shard, event)
            return
        if isinstance(event, ShardResult):  # an attempt's last item: the worker takes its next shard now
            yield from self._ended(ref, name, shard, event.redone)
            self.live[shard.id] -= 1
            actor.state = ActorState.IDLE
            self.done.add(shard.id)  # committed (by this attempt, or by another one first)
            if event.committed_by_other or shard.id in self.reported:
                return  # the winner reports the commit (its counts and manifest version), once
            self.reported.add(shard.id)
        elif shard.id in self.done:
            return  # progress of an attempt that has lost
        yield event

    def _stopped(self, ref, actor: PoolActor, shard: Shard, event: ShardResult) -> Iterator[PoolEvent]:
        """A worker told to stop (SIGTERM) committed what it made and ended its attempt: the rest of the
        shard goes back on the queue, not counted as a failed attempt, and the worker is let go (its
        process is on its way out); another is started for the work left."""
        yield from self._ended(ref, actor.name, shard, event.redone)
        self.attempts[shard.id] -= 1
        actor.state = ActorState.FAILED  # never parked for a later run: its process is ending
        yield self.pool.release(actor, "told to stop (SIGTERM): it committed what it made")
        yield from self._requeue_or_fail(shard, "stopped")

    def _answer(self, actor: PoolActor, ref: ray.ObjectRef) -> Iterator[PoolEvent]:
        """The answer to a placing actor's `where()` or a loading/unavailable actor's `start()`."""
        actor.call = None
        try:
            answer = ray.get(ref)
        except ActorUnavailableError:  # restarting or unreachable for now: ask again shortly
            actor.retry_at = time.monotonic() + POLL
            return
        except RayActorError as err:
            shard, actor.shard = actor.shard, None
            yield from self._died(actor, err)
            if shard is not None:  # it was unavailable while running this shard
                yield from self._requeue_or_fail(shard, _message(err))
            return
        except RayError as err:  # raised in start() (fits nothing, no CUDA) or a runtime env that failed
            actor.state = ActorState.FAILED
            self.errors.append(f"{actor.name}: {_message(err)}")
            yield WorkerFailed(actor.name, _message(err), actor.placement)
            return
        if actor.state == ActorState.PLACING:
            actor.state, actor.placement = ActorState.LOADING, answer
            yield WorkerPlaced(actor.name, answer)
        elif actor.state == ActorState.LOADING:
            actor.state = ActorState.IDLE
            yield WorkerReady(actor.name, answer)
        else:  # unavailable, and now answering: its attempt is over, committed or not
            shard, actor.shard, actor.state = actor.shard, None, ActorState.IDLE
            if actor.placement and answer.get("pid") != actor.placement.get("pid"):
                # It answered from a new process: the old one died (its node lost) and Ray restarted it.
                actor.deaths += 1
                yield WorkerLost(actor.name, "its process ended while it was unreachable; Ray restarted it", True)
                actor.placement = answer.get("placement")
                yield WorkerReady(actor.name, answer)
            yield from self._requeue_or_fail(shard, "the worker was unreachable while it ran this shard")
